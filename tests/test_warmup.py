"""Step shapes (issue 22): the shape set, planning with only the ready shapes while the rest compile, the background
warm-up end to end, and zero compiles once every shape is ready under a random request mix."""

from __future__ import annotations

import dataclasses
import random
import sys
import threading
import time

import numpy as np
import pytest

from jphoton import SamplingParams
from jphoton.engine import compiles, warmup
from jphoton.engine.config import EngineConfig, Kernels
from jphoton.engine.plan import SchedulerConfig, StepShape
from jphoton.engine.warmup import Warmup, background_order, first_shapes

from conftest import FIXTURES, make_llm, tiny_reference

LLAMA = str(FIXTURES / "tiny" / "llama3")


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _record_shapes(llm) -> list[StepShape]:
    """Every shape the engine packs from now on; each must be ready when it is packed."""
    shapes, pack, sched = [], llm.engine.runner.pack, llm.engine.scheduler

    def recording(plan, *args):
        assert sched.ready is None or plan.shape in sched.ready, f"planned {plan.shape}, not ready"
        shapes.append(plan.shape)
        return pack(plan, *args)

    llm.engine.runner.pack = recording
    return shapes


def test_default_shape_count_is_decode_buckets_plus_two_per_prefill_bucket():
    """The GPU defaults: 6 decode buckets (2..64) + prefill steps with no decode part or the full 64 rows, for 4
    prefill buckets = 14 shapes, no context bucket (the Pallas kernels follow each row's length; 38 with 4 context
    buckets for prefill rows before, 90 before issue 22: every decode bucket in every mixed step)."""
    cfg = EngineConfig().resolve_kernels("gpu").resolve_shapes(8192, min_decode_rows=2).scheduler_config()
    assert cfg.context_buckets == ()
    shapes = cfg.all_shapes()
    assert len(shapes) == len(set(shapes)) == 6 + 2 * 4
    assert {s.decode_rows for s in shapes if s.prefill_rows} == {0, 64}
    assert all(s.ctx_pages == 0 for s in shapes)
    static = SchedulerConfig(decode_buckets=(2, 8), prefill_buckets=((1, 32),), context_buckets=(4, 16))
    assert len(static.all_shapes()) == 2 * 2 + 2 * 2  # static attention: decode steps take a context bucket too


def test_first_shapes_serve_a_first_request_and_the_rest_come_in_a_useful_order():
    cfg = EngineConfig().resolve_kernels("gpu").resolve_shapes(8192, min_decode_rows=2).scheduler_config()

    class Sched:  # first_shapes reads only the config
        config = cfg

    shapes = cfg.all_shapes()
    first = first_shapes(shapes, Sched)
    assert first == [StepShape(0, 1, 128, 0), StepShape(2, 0, 0, 0)]
    rest = background_order(shapes, first, Sched)
    assert sorted(rest + first, key=str) == sorted(shapes, key=str)
    assert [s.decode_rows for s in rest[:5]] == [4, 8, 16, 32, 64]  # more requests at once
    assert rest[5] == StepShape(64, 1, 128, 0)  # then a newcomer's prefill beside them

    # static attention (context buckets): the first prefill over 512 tokens, then the smaller context (a short first
    # chunk, issue 23), then longer prompts
    Sched.config = EngineConfig(kernels=Kernels(attention="static")).resolve_kernels("gpu").resolve_shapes(
        8192, min_decode_rows=2).scheduler_config()
    shapes = Sched.config.all_shapes()
    first = first_shapes(shapes, Sched)
    assert first == [StepShape(0, 1, 128, 32), StepShape(2, 0, 0, 512)]
    rest = background_order(shapes, first, Sched)
    assert rest[:3] == [StepShape(0, 1, 128, 8), StepShape(0, 1, 128, 128), StepShape(0, 1, 128, 512)]


@pytest.mark.parametrize("attention", ["dynamic", "static"])
def test_planning_with_only_the_ready_shapes_matches_all_shapes(attention):
    """With only the first tier ready, long prompts run in chunks through the small prefill shape, the decode rows fit
    the one ready decode bucket, prefill alternates with decode; whatever a plan wanted is compiled between steps
    (as the background thread would). Greedy tokens equal those of a run with every shape ready."""
    extra = dict(attention=attention, context_buckets=(2, 4, 16)) if attention == "static" else {}
    llm = make_llm(LLAMA, warmup="off", max_num_seqs=8, decode_buckets=(1, 2, 8),
                   prefill_buckets=((1, 16), (2, 64)), max_num_batched_tokens=128, **extra)
    ref = tiny_reference("llama3")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, llm.config.vocab_size, n).tolist() for n in (90, 5, 40, 17, 3, 70)]
    params = [_greedy(n) for n in (6, 9, 4, 12, 7, 5)]
    want = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert want[0] and ref  # the reference run itself is checked against HF elsewhere (test_engine)

    sched = llm.engine.scheduler
    first = first_shapes(sched.config.all_shapes(), sched)
    sched.ready = frozenset(first)
    used = _record_shapes(llm)
    ids = [llm.add_request({"prompt_token_ids": p}, sp) for p, sp in zip(prompts, params, strict=True)]
    got: dict[int, list[int]] = {i: [] for i in ids}
    compiled_late = []
    while llm.has_unfinished_requests():
        for out in llm.step():
            got[out.request_id] += out.delta.token_ids
        if len(used) == 12 and sched.wanted is None:  # later on, one more decode bucket becomes ready
            sched.wanted = StepShape(2, 0, 0, first[1].ctx_pages)
        if sched.wanted is not None:  # the background compiler's part: make the wanted shape ready
            compiled_late.append(sched.wanted)
            sched.ready, sched.wanted = sched.ready | {sched.wanted}, None
    assert [got[i] for i in ids] == want
    assert compiled_late and set(used) <= set(first) | set(compiled_late)
    assert any(s.prefill_rows and s.prefill_tokens == 16 for s in used)  # chunks through the small prefill shape
    sched.ready = None


def test_background_warmup_serves_while_compiling_then_compiles_nothing(monkeypatch):
    """warmup="background": LLM() returns after the first two shapes; requests are served (token-exact) while the
    rest compile; all_shapes_ready turns True; then a random mix of prompt lengths, counts, sampling options,
    logprobs, stops and constraints compiles nothing."""
    monkeypatch.setattr(warmup, "FIRST_RUNS_ON_CPU", True)
    ref = tiny_reference("llama3")
    llm = make_llm(LLAMA, warmup="background")
    greedy = SamplingParams(max_tokens=len(ref[0][1]), temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p, _, _ in ref], greedy)
    assert [o.token_ids for o in outs] == [t.tolist() for _, t, _ in ref]
    runner = llm.engine.runner
    assert llm.warmup.wait(timeout=600)
    # then wait_until_ready runs each program once (its first execution costs more), compiling nothing
    compiled, before = compiles.num_compiles(), set(runner.first_ran)
    assert llm.wait_until_ready(timeout=600)
    assert compiles.num_compiles() == compiled
    keys = llm.warmup.ready_programs()
    assert runner.first_ran == set(keys) and len(keys) > len(before) > 0
    assert {k[0] for k in keys} == {"step", "sampler"} and any(k[2] for k in keys if k[0] == "step")
    assert llm.stats()["programs_run_once"] == len(keys) and llm.run_programs_once() == 0
    stats = llm.stats()
    variants = runner.filtered_shapes()  # the decode steps' top-k / top-p variants, compiled last
    assert variants and runner.filtered_ready == set(variants)
    assert stats["all_shapes_ready"] and stats["shapes_compiled"] == stats["shapes_total"] == 4 + len(variants)
    assert llm.engine.scheduler.ready is None

    _random_mix(llm, random.Random(7), constraints=False)  # the tiny model's vocabulary is smaller than its tokenizer's


def test_programs_run_once_in_any_order_leave_the_engine_serving(monkeypatch):
    """warmup="full": LLM() runs every program once (padding rows, the trash page); steps and samplers run in any
    order after that leave the slots as serving expects (a step never donates the tokens it carries from), the pool
    whole, and greedy tokens exact. On the CPU backend nothing runs by default."""
    monkeypatch.setattr(warmup, "FIRST_RUNS_ON_CPU", True)
    ref = tiny_reference("llama3")
    llm = make_llm(LLAMA, warmup="full")
    runner = llm.engine.runner
    keys = llm.warmup.ready_programs()
    assert runner.first_ran == set(keys) and llm.stats()["programs_run_once"] == len(keys)
    steps, samplers = [k for k in keys if k[0] == "step"], [k for k in keys if k[0] == "sampler"]
    compiled = compiles.num_compiles()
    for i, key in enumerate(steps):  # step, sampler, sampler, step, ...
        runner.first_run(key)
        for s in samplers[i % len(samplers):][:i % 3]:
            runner.first_run(s)
    assert compiles.num_compiles() == compiled
    greedy = SamplingParams(max_tokens=len(ref[0][1]), temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p, _, _ in ref], greedy)
    assert [o.token_ids for o in outs] == [t.tolist() for _, t, _ in ref]
    s = llm.stats()
    assert s["kv_pages_free"] + s["kv_pages_evictable"] == s["kv_pages_total"]
    runner.first_ran.clear()
    monkeypatch.setattr(warmup, "FIRST_RUNS_ON_CPU", False)
    assert llm.run_programs_once() == 0 and llm.stats()["programs_run_once"] == 0


@pytest.fixture
def cpu_compile_worker(monkeypatch):
    monkeypatch.setattr(warmup.compile_worker, "ALLOW_CPU", True)  # (a GPU-only option: see ALLOW_CPU)


@pytest.mark.parametrize("family, loras", [("llama3", 2), ("qwen3_moe", 0)])
def test_a_compile_worker_process_compiles_the_background_programs(cpu_compile_worker, monkeypatch, family, loras):
    """compile_worker=True: the background programs come from a second process and load here, one per key of every
    task (steps and their LoRA variants, second samplers, top-k / top-p variants); a task is ready once its programs
    are in; the worker ends
    cleanly. (XLA:CPU cannot always run a program loaded from another process, `ALLOW_CPU`: here the engine serves
    through its own compiles, token-exact; 6e55017:lab/probes/worker_dispatch.py checks the loaded programs' tokens and
    speed on the GPU.)"""
    from jphoton.engine.runner import Runner

    installed = {}
    monkeypatch.setattr(Runner, "install", lambda self, key, program: installed.setdefault(key, program))
    ref = tiny_reference(family)
    # one decode bucket, one 32-token prefill row, no logprobs (CI time: 3 second samplers, not 7): the background
    # still holds a mixed step, its top-k / top-p variant, the second samplers and, with adapters, their LoRA variants
    llm = make_llm(str(FIXTURES / "tiny" / family), warmup="background", compile_worker=True, max_loras=loras,
                   max_lora_rank=8, max_num_seqs=2, decode_buckets=(2,), prefill_buckets=((1, 32),),
                   max_num_batched_tokens=64, max_model_len=64, max_logprobs=0)
    assert llm.wait_until_ready(timeout=600)
    stats, runner = llm.stats(), llm.engine.runner
    assert stats["compile_path"] == "worker" and stats["all_shapes_ready"]
    assert stats["shapes_compiled"] == stats["shapes_total"]
    shapes = runner.sched.all_shapes()
    background = [s for s in shapes if s not in first_shapes(shapes, llm.engine.scheduler)]
    tasks = ([("step", s, False) for s in background] + [("step", s, True) for s in runner.filtered_shapes()]
             + [("sampler", v) for v in runner.sampler_variants()])
    want = {key for t in tasks for key in warmup.compile_worker.program_keys(t, runner.lora_enabled)}
    assert set(installed) == want and all(callable(p) for p in installed.values())
    assert any(key[-1] is True for key in want if key[0] == "step") == (loras > 0)
    assert llm.warmup._worker.proc.poll() == 0
    greedy = SamplingParams(max_tokens=len(ref[0][1]), temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p.tolist()} for p, _, _ in ref]
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == [t.tolist() for _, t, _ in ref]


def test_stopping_the_warmup_stops_the_compile_worker(cpu_compile_worker):
    """Process exit (`Warmup.stop`, atexit) while the worker compiles: it finishes the program in progress and exits;
    the warm-up thread ends; nothing waits for the rest of the tasks."""
    llm = make_llm(LLAMA, warmup="background", compile_worker=True)
    t = time.perf_counter()
    llm.warmup.stop()
    assert not llm.warmup.running and time.perf_counter() - t < 120
    worker = llm.warmup._worker
    assert worker is None or worker.proc.poll() is not None
    assert not llm.stats()["all_shapes_ready"] or worker is None


@pytest.mark.parametrize("failure", ["error", "exit"])
def test_a_failed_compile_worker_leaves_the_rest_to_this_process(cpu_compile_worker, monkeypatch, caplog, failure):
    """A worker that reports an error or exits early: logged, and this process compiles what is left."""
    if failure == "error":  # the worker cannot rebuild the model: it reports the exception
        real = warmup.compile_worker.CompileWorker.__init__
        monkeypatch.setattr(warmup.compile_worker.CompileWorker, "__init__",
                            lambda self, spec: real(self, dataclasses.replace(spec, recipe={})))
    else:  # a process that ends without a word
        monkeypatch.setattr(warmup.compile_worker.sys, "executable", "true")
    ref = tiny_reference("llama3")
    with caplog.at_level("WARNING", logger="jphoton.engine"):
        llm = make_llm(LLAMA, warmup="background", compile_worker=True)
        assert llm.wait_until_ready(timeout=600)
    assert llm.stats()["compile_path"] == "in-process" and not llm.engine.runner._programs
    assert "compile worker failed" in caplog.text and ("KeyError" in caplog.text or failure == "exit")
    greedy = SamplingParams(max_tokens=len(ref[0][1]), temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p, _, _ in ref], greedy)
    assert [o.token_ids for o in outs] == [t.tolist() for _, t, _ in ref]


def test_background_traces_the_next_program_while_one_compiles():
    """The background thread traces program n+1 while program n compiles on the compile thread, never two compiles at
    once, and marks a shape ready only after its compile; a wanted shape goes next; a failed compile is reported."""
    cfg = SchedulerConfig(decode_buckets=(2, 4, 8), prefill_buckets=((1, 16),), context_buckets=(4, 16))
    shapes = cfg.all_shapes()
    events, lock, running, profiled = [], threading.Lock(), [0], []

    class Program:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def compile(self):
            profiled.append(("compile", sys.getprofile() is not None))
            with lock:
                running[0] += 1
                assert running[0] == 1, "two compiles at once"
                events.append(("compile", self.name))
            time.sleep(0.05)
            with lock:
                running[0] -= 1
                events.append(("compiled", self.name))
            if self.fail:
                raise RuntimeError("XLA said no")

    class Runner:
        filtered_ready = None
        fail_on = None

        def sampler_variants(self):
            return ["sampler"]

        def filtered_shapes(self):
            return [s for s in shapes if not s.prefill_rows][:1]

        def compile_step(self, shape, filtered=False):
            pass

        def lower_step(self, shape, filtered=False):
            profiled.append(("lower", sys.getprofile() is not None))
            name = ("filtered", shape) if filtered else shape
            with lock:
                events.append(("lower", name))
            if shape == wanted_after and not filtered:  # the plan asks for a shape while this one compiles
                sched.wanted = wanted
            return [Program(name, fail=shape == self.fail_on)]

        def lower_sampler(self, variant):
            with lock:
                events.append(("lower", variant))
            return Program(variant)

    class Sched:
        config = cfg
        ready = None
        wanted = None

    sched, runner = Sched(), Runner()
    first = first_shapes(shapes, sched)
    order = background_order(shapes, first, sched)
    wanted_after, wanted = order[0], order[-1]
    warm = Warmup(runner, sched, mode="background")
    warm.start()
    assert warm.wait(timeout=30) and warm.all_ready
    lowered = [e[1] for e in events if e[0] == "lower"]
    expected = order + ["sampler"] + [("filtered", s) for s in runner.filtered_shapes()]
    assert lowered[1] == wanted and sorted(map(str, lowered)) == sorted(map(str, expected))
    for i, name in enumerate(lowered[1:], 1):  # program i was traced before program i-1's compile ended
        assert events.index(("lower", name)) < events.index(("compiled", lowered[i - 1]))
    assert warm.compiled == set(shapes) and runner.filtered_ready == set(runner.filtered_shapes())
    # the tracing thread runs under the polite hook (it hands the GIL to the engine), the compile thread does not
    assert {p for what, p in profiled if what == "lower"} == {True}
    assert {p for what, p in profiled if what == "compile"} == {False}
    assert sched.ready is None

    runner.fail_on, sched.wanted = order[2], None
    broken = Warmup(runner, Sched(), mode="background")
    broken.start()
    with pytest.raises(RuntimeError, match="compiling the step shapes failed"):
        broken.wait(timeout=30)
    assert not broken.all_ready and order[2] not in broken.compiled and order[1] in broken.compiled


def test_polite_profile_sleeps_at_a_call_after_every_interval(monkeypatch):
    """The hook sleeps (hands the GIL over) at the first Python call after each interval of tracing, and never
    between (it costs the tracing thread its sleeps only)."""
    slept = []
    monkeypatch.setattr(warmup.time, "sleep", slept.append)

    def work(n):
        return sum(abs(i) for i in range(n))

    for every_s, expect_many in ((0.0, True), (60.0, False)):
        slept.clear()
        sys.setprofile(warmup.polite_profile(every_s))
        try:
            for _ in range(200):
                work(10)
        finally:
            sys.setprofile(None)
        assert (len(slept) >= 200) if expect_many else not slept


def test_no_compiles_under_a_random_mix_with_constraints(embedded_llm):
    """Every shape ready (the session's embedded engine): a random mix with constraints compiles nothing either."""
    assert embedded_llm.stats()["all_shapes_ready"]
    _random_mix(embedded_llm, random.Random(11), constraints=True)


def _random_mix(llm, rnd: random.Random, constraints: bool, rounds: int = 3) -> None:
    """Random batches of prompt lengths, request counts, sampling options, logprobs, stops (and constraints): not one
    compile."""
    before = llm.stats()["num_compiles"]
    kinds = [{}, {}, {"regex": "[a-z]{1,8}"}, {"choice": ["yes", "no"]},
             {"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}] if constraints else [{}]
    for _ in range(rounds):
        n = rnd.randint(1, 8)
        prompts = [{"prompt_token_ids": [rnd.randrange(1, 250) for _ in range(rnd.randint(1, 150))]} for _ in range(n)]
        params = [SamplingParams(max_tokens=rnd.randint(1, 12), temperature=rnd.choice([0, 0.7, 1.2]),
                                 top_p=rnd.choice([1.0, 0.9]), top_k=rnd.choice([0, 5]), seed=rnd.randrange(99),
                                 logprobs=rnd.choice([None, 2]), stop=rnd.choice([[], ["the"]]), **rnd.choice(kinds))
                  for _ in range(n)]
        assert len(llm.generate(prompts, params)) == n
    assert llm.stats()["num_compiles"] == before


def test_the_compile_worker_takes_the_jax_options_that_shape_a_lowering():
    """A notebook's runtime `jax.config.update` reaches the worker (engine/compile_worker.py LOWERING_OPTIONS)."""
    import jax

    options = warmup.compile_worker.jax_options()
    assert options["jax_default_matmul_precision"] == jax.config.values["jax_default_matmul_precision"]
    assert set(options) == set(warmup.compile_worker.LOWERING_OPTIONS)
    try:
        warmup.compile_worker.apply_jax_options({**options, "jax_default_matmul_precision": "highest"})
        assert jax.config.values["jax_default_matmul_precision"] == "highest"
    finally:
        warmup.compile_worker.apply_jax_options(options)
    assert jax.config.values["jax_default_matmul_precision"] == options["jax_default_matmul_precision"]


def test_compile_worker_option_is_checked():
    assert EngineConfig().compile_worker is None
    with pytest.raises(ValueError, match="compile_worker must be True, False or None"):
        EngineConfig(compile_worker="yes")
    with pytest.raises(ValueError, match="compile_worker=True needs a GPU"):
        make_llm(LLAMA, warmup="background", compile_worker=True)
    llm = make_llm(LLAMA, warmup="background")  # auto: off on the CPU
    assert llm.warmup.worker_config is None and llm.wait_until_ready(timeout=600)
    assert llm.stats()["compile_path"] == "in-process"


def test_warmup_option_is_checked():
    assert EngineConfig(warmup=True).warmup == "full" and EngineConfig(warmup=False).warmup == "off"
    assert EngineConfig().warmup == "background"
    with pytest.raises(ValueError, match="warmup must be one of"):
        EngineConfig(warmup="lazy")


def test_a_script_that_ends_while_shapes_compile_exits_cleanly():
    """The default warm-up compiles in the background; a script that ends first stops it after the compile in progress,
    with no error: the compiles ran on a ThreadPoolExecutor, which refuses work once the interpreter exits, and the
    warm-up logged "background compile failed" with a traceback."""
    import subprocess

    script = (f"import sys, time; sys.path.insert(0, {str(FIXTURES.parent)!r})\n"
              "from conftest import make_llm\n"
              f"llm = make_llm({LLAMA!r}, warmup='background', progress=False)\n"
              "time.sleep(1.0)\n"
              "print('compiling at exit:', llm.warmup.running, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "compiling at exit: True" in out.stdout  # (else the test proves nothing)
    assert "background compile failed" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_the_compile_worker_imports_this_jphoton_whatever_the_working_directory(cpu_compile_worker, monkeypatch,
                                                                                tmp_path):
    """A `jphoton` package in the working directory (another source tree) must not shadow the one this process runs:
    the worker would compile that tree's programs (or fail to start, here) and this one would fall back to compiling
    everything itself."""
    (tmp_path / "jphoton").mkdir()
    (tmp_path / "jphoton" / "__init__.py").write_text("raise ImportError('the shadowing tree')\n")
    monkeypatch.chdir(tmp_path)
    llm = make_llm(LLAMA, warmup="background", compile_worker=True)
    assert llm.wait_until_ready(timeout=600)
    assert llm.stats()["compile_path"] == "worker"
