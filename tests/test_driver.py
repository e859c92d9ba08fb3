"""The one engine loop (jphoton/engine/driver.py) behind every entry point: LLM.step is a driver tick; AsyncLLM and the
server's engine loop drive the same driver from their threads: quick requests prepared in the pass they arrive, idle
passes running each compiled program once, one driving thread at a time; and the first-token benchmark's smoke run."""

from __future__ import annotations

import asyncio
import json
import pathlib
import runpy
import sys

import pytest

from jphoton import AsyncLLM, SamplingParams
from jphoton.engine import driver as driver_lib
from jphoton.engine import warmup as warmup_lib

from conftest import make_llm

ROOT = pathlib.Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _generate(engine: AsyncLLM, prompt, params=GREEDY) -> list[int]:
    async def run():
        return [t async for out in engine.generate(prompt, params) for t in out.delta.token_ids]

    return asyncio.run(run())


def test_async_llm_prepares_quick_requests_inline_and_the_rest_on_workers(embedded_llm, monkeypatch):
    """A short prompt is prepared by the engine thread in the pass it arrives (no worker round trip, as the server's
    loop does); a chat prompt (a template to apply) goes to a worker. Both give LLM.generate's tokens."""
    llm = embedded_llm
    submitted = []
    submit = driver_lib.Preparer.submit
    monkeypatch.setattr(driver_lib.Preparer, "submit", lambda self, key, fn: submitted.append(key) or submit(self, key, fn))
    [ref] = llm.generate("Once upon a time", GREEDY)
    chat = [{"role": "user", "content": "Hi"}]
    [chat_ref] = llm.chat(chat, GREEDY)
    engine = AsyncLLM(llm)
    try:
        assert _generate(engine, "Once upon a time") == ref.token_ids
        assert submitted == []
        assert _generate(engine, engine.chat_prompt(chat)) == chat_ref.token_ids
        assert len(submitted) == 1
        with pytest.raises(RuntimeError, match="driven by another thread"):
            with llm.driving(lambda k, o: None, lambda k, m: None):
                pass
    finally:
        engine.shutdown()
    assert llm._driving_thread is None
    [again] = llm.generate("Once upon a time", GREEDY)  # the caller's thread drives it again
    assert again.token_ids == ref.token_ids


def test_an_idle_async_llm_runs_each_compiled_program_once(monkeypatch):
    """Shapes compiled in the background get their first run on an idle pass of the AsyncLLM's loop (as in the
    server's engine process), so no request pays it (on the CPU backend only when asked: FIRST_RUNS_ON_CPU)."""
    monkeypatch.setattr(warmup_lib, "FIRST_RUNS_ON_CPU", True)
    llm = make_llm(warmup="background")
    assert llm.warmup.wait(300)  # (every shape compiled; none run once since but the first ones)
    ran = llm.stats()["programs_run_once"]
    programs = len(llm.warmup.ready_programs())
    assert ran < programs  # (LLM() ran the first shapes' only)
    engine = AsyncLLM(llm)
    try:
        deadline = asyncio.run(_wait_for(lambda: llm.stats()["programs_run_once"] == programs, 120))
        assert deadline, (llm.stats()["programs_run_once"], programs)
        assert not llm.driver.programs_left
    finally:
        engine.shutdown()


async def _wait_for(done, seconds: float) -> bool:
    for _ in range(int(seconds / 0.05)):
        if done():
            return True
        await asyncio.sleep(0.05)
    return done()


def test_first_token_benchmark_smoke(tmp_path, monkeypatch):
    """The script's main path as `python benchmarks/first_token.py --smoke` runs it, in this process (CI time: one
    interpreter start fewer; its server's engine still runs in a process of its own)."""
    out = tmp_path / "first_token.json"
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "first_token.py"), "--smoke", "--out", str(out)])
    monkeypatch.setattr(sys, "path", list(sys.path))
    runpy.run_path(str(ROOT / "benchmarks" / "first_token.py"), run_name="__main__")
    rows = {r["entry"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"LLM", "AsyncLLM", "jphoton serve"}
    assert all(r["reps"] == 3 and r["ttft_ms_p50"] > 0 for r in rows.values())
