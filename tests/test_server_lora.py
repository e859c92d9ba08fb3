"""LoRA adapters over gRPC (issue 28): LoadLora / UnloadLora / ListLoras, GenerateRequest.lora, the slot stats.

One server for the module with its engine in a child process (`Spawn`, what `jphoton serve` runs), on tiny llama3 with
two slots; references are HF PEFT's greedy tokens (tests/fixtures/tiny/lora). Warm-up is off: the few shapes the tests
use compile on first use (a full warm-up with the LoRA step variants costs ~30 s of this 2-core machine). The in-process
server (an LLM object) is checked for the same answers, and both engine loops for an adapter unloaded between a
request's check and its admission.
"""

from __future__ import annotations

import functools
import multiprocessing
import pickle
import shutil
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

from jphoton import LLM, SamplingParams
from jphoton.server import jphoton_pb2 as pb
from jphoton.server import jphoton_pb2_grpc as pb_grpc
from jphoton.server.app import serve
from jphoton.server.engine_loop import EngineLoop
from jphoton.server.engine_process import EngineProcess, Spawn

from conftest import ENGINE_ARGS, FIXTURES, make_llm

BASE = FIXTURES / "tiny" / "llama3"
ADAPTERS = FIXTURES / "tiny" / "lora"
NEW = 24  # the reference continuations' length
STEP_SLEEP_S = 0.01  # the served engine's steps are slowed by this much, so that a long request is still running


def _reference():
    ref = np.load(ADAPTERS / "reference.npz")
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(4)]
    tokens = {name: [ref[f"tokens_{name}_{i}"].tolist() for i in range(4)] for name in ("base", "a", "b", "c")}
    return prompts, tokens


PROMPTS, REF = _reference()


def _build_slowed(**kwargs) -> LLM:
    """The engine process's LLM (module level: pickled by reference into the child), each step slowed a little."""
    llm = LLM(str(BASE), **kwargs)
    step = llm.step

    def slowed():
        time.sleep(STEP_SLEEP_S)
        return step()

    llm.step = slowed
    return llm


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """A second --lora-dir of the module's server, for adapters the tests make."""
    return tmp_path_factory.mktemp("loras")


@pytest.fixture(scope="module")
def lora_srv(lora_dir):
    build = functools.partial(_build_slowed, dtype="float32", freeze_gc=False, warmup="off", max_loras=2,
                              max_lora_rank=16, **ENGINE_ARGS)
    handle = serve(Spawn(build), port=0, metrics_port=0, wait=True, lora_dirs=[ADAPTERS, lora_dir])
    assert isinstance(handle.server.servicer.engine, EngineProcess)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield handle, pb_grpc.EngineStub(channel)
    channel.close()
    handle.stop(grace=5)


def _generate(stub, prompt: list[int], lora: str = "", n: int = NEW, timeout: float = 60) -> list[int]:
    msgs = stub.Generate(_request(prompt, lora, n), timeout=timeout)
    return [t for m in msgs for t in m.token_ids]


def _request(prompt: list[int], lora: str = "", n: int = NEW) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), lora=lora,
                              sampling=pb.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))


def _error(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def _slots(stats: pb.Stats) -> tuple[int, int, int, int]:
    return stats.lora_slots_total, stats.lora_slots_loaded, stats.lora_slots_draining, stats.lora_slots_free


def _stats(stub) -> pb.Stats:
    return stub.GetStats(pb.GetStatsRequest(), timeout=10)


# ---- the engine in its own process ------------------------------------------------------------------------------------
def test_load_then_generate_with_and_without_an_adapter(lora_srv):
    handle, stub = lora_srv
    assert _slots(_stats(stub)) == (2, 0, 0, 2)
    a = stub.LoadLora(pb.LoadLoraRequest(name="a", path=str(ADAPTERS / "a")), timeout=30)
    b = stub.LoadLora(pb.LoadLoraRequest(name="b", path=str(ADAPTERS / "b")), timeout=30)
    assert (a.name, a.rank, a.source, a.running) == ("a", 8, str(ADAPTERS / "a"), 0)
    assert (b.name, b.rank) == ("b", 4) and {a.slot, b.slot} == {0, 1}
    assert _generate(stub, PROMPTS[0], "a") == REF["a"][0]
    assert _generate(stub, PROMPTS[0]) == REF["base"][0]  # no lora: the base model, as old clients get
    assert _generate(stub, PROMPTS[1], "b") == REF["b"][1]
    listing = stub.ListLoras(pb.ListLorasRequest(), timeout=10).loras
    assert [(e.name, e.slot, e.rank, e.running) for e in listing] == [("a", a.slot, 8, 0), ("b", b.slot, 4, 0)]
    assert _slots(_stats(stub)) == (2, 2, 0, 0)
    with urllib.request.urlopen(f"http://127.0.0.1:{handle.metrics_port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    for line in ("jphoton_lora_slots_total 2.0", "jphoton_lora_slots_loaded 2.0", "jphoton_lora_slots_draining 0.0",
                 "jphoton_lora_slots_free 0.0"):
        assert line in metrics.splitlines()


def test_a_third_adapter_with_every_slot_loaded_is_resource_exhausted(lora_srv):
    _, stub = lora_srv
    code, details = _error(lambda: stub.LoadLora(pb.LoadLoraRequest(name="c", path=str(ADAPTERS / "c")), timeout=30))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "all 2 LoRA slots" in details
    assert [e.name for e in stub.ListLoras(pb.ListLorasRequest(), timeout=10).loras] == ["a", "b"]


def test_bad_adapters_and_names_are_invalid_argument(lora_srv, lora_dir):
    from jphoton.weights.peft import ADAPTER_PATH_REFUSED

    _, stub = lora_srv
    code, details = _error(lambda: list(stub.Generate(_request(PROMPTS[0], "nope"), timeout=30)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown LoRA adapter 'nope' (loaded: 'a', 'b')" in details
    missing = lora_dir / "missing"  # (any path that is not an adapter directory in a --lora-dir: one message)
    code, details = _error(lambda: stub.LoadLora(pb.LoadLoraRequest(name="x", path=str(missing)), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details == ADAPTER_PATH_REFUSED
    big = lora_dir / "big"  # an adapter of rank 32 where the slots hold 16
    shutil.copytree(ADAPTERS / "a", big)
    (big / "adapter_config.json").write_text((big / "adapter_config.json").read_text().replace('"r": 8', '"r": 32'))
    code, details = _error(lambda: stub.LoadLora(pb.LoadLoraRequest(name="x", path=str(big)), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "rank 32 exceeds max_lora_rank=16" in details
    for request in (pb.LoadLoraRequest(path=str(ADAPTERS / "c")), pb.LoadLoraRequest(name="x")):
        code, details = _error(lambda r=request: stub.LoadLora(r, timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "needs a name and the path" in details
    assert _slots(_stats(stub)) == (2, 2, 0, 0)  # nothing was loaded, and the engine still serves
    assert _generate(stub, PROMPTS[2], "b", n=4) == REF["b"][2][:4]


def test_unload_while_running_drains_and_a_load_waits_for_the_slot_without_stalling(lora_srv):
    _, stub = lora_srv
    prompt = PROMPTS[3]
    long = stub.Generate(_request(prompt, "a", n=256 - len(prompt)), timeout=60)  # ~2 s of (slowed) steps
    tokens = list(next(long).token_ids)
    slot_a = {e.name: e.slot for e in stub.ListLoras(pb.ListLorasRequest(), timeout=10).loras}["a"]
    assert stub.UnloadLora(pb.UnloadLoraRequest(name="a"), timeout=10).found
    assert not stub.UnloadLora(pb.UnloadLoraRequest(name="a"), timeout=10).found
    assert _slots(_stats(stub)) == (2, 1, 1, 0)  # a drains: its request still runs on it
    code, details = _error(lambda: list(stub.Generate(_request(prompt, "a"), timeout=30)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown LoRA adapter 'a' (loaded: 'b')" in details
    load = stub.LoadLora.future(pb.LoadLoraRequest(name="c", path=str(ADAPTERS / "c")), timeout=60)
    while len(tokens) < NEW + 8:  # the engine keeps serving while the load waits for the slot
        tokens += next(long).token_ids
    assert not load.done()
    long.cancel()
    info = load.result()
    assert (info.name, info.slot, info.rank) == ("c", slot_a, 16)
    assert tokens[:NEW] == REF["a"][3]  # the unloaded adapter's request ran on it to the end
    assert _generate(stub, PROMPTS[2], "c") == REF["c"][2]
    assert _slots(_stats(stub)) == (2, 2, 0, 0)
    assert [e.name for e in stub.ListLoras(pb.ListLorasRequest(), timeout=10).loras] == ["b", "c"]


def test_an_adapter_unloaded_after_its_request_was_checked_is_refused_by_the_engine_loop():
    """The engine process's loop, driven over its pipes here: the request is rejected (INVALID_ARGUMENT), the loop
    goes on."""
    llm = make_llm(str(BASE), warmup="off", max_loras=1, max_lora_rank=16)
    commands, send_end = multiprocessing.Pipe(duplex=False)
    recv_end, events = multiprocessing.Pipe(duplex=False)
    loop = EngineLoop(llm, [(commands, events)])
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    got = []

    def send(command):
        send_end.send_bytes(pickle.dumps(command))

    def wait_for(kind, key):
        deadline = time.monotonic() + 30
        while True:
            for ev in got:
                if ev[:2] == (kind, key):
                    return ev
            assert recv_end.poll(max(0.0, deadline - time.monotonic())), f"no {kind} {key}: {got}"
            got.extend(pickle.loads(recv_end.recv_bytes()))

    try:
        send(("lora_load", 1, "a", str(ADAPTERS / "a")))
        assert wait_for("lora", 1)[2:] == (True, {"name": "a", "slot": 0, "rank": 8, "source": str(ADAPTERS / "a"),
                                               "running": 0})
        _unload_after_checking(llm, "a")
        send(("add", 7, {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=4, lora="a"), None))
        assert "unknown LoRA adapter 'a'" in wait_for("reject", 7)[2]
        send(("lora_load", 2, "b", str(ADAPTERS / "missing")))
        assert wait_for("lora", 2)[2:] == (False, ("invalid", f"LoRA adapter {str(ADAPTERS / 'missing')!r}: "
                                                              "not a directory"))
        send(("stats", 3))
        stats = wait_for("stats", 3)[2]
        assert (stats["lora_slots_loaded"], stats["lora_slots_free"], stats["running"]) == (0, 1, 0)
    finally:
        send(("shutdown",))
        thread.join(30)
    assert not thread.is_alive()


def _unload_after_checking(llm, name: str) -> None:
    """From now on, every request prepared for `llm` unloads `name` once it passed the checks (before it is added)."""
    prepare = llm.prepare_request

    def prepare_then_unload(*args, **kwargs):
        seq = prepare(*args, **kwargs)
        llm.unload_lora(name)
        return seq

    llm.prepare_request = prepare_then_unload


# ---- the engine in this process ---------------------------------------------------------------------------------------
def test_in_process_server_loads_lists_unloads_and_refuses_a_racing_request():
    llm = make_llm(str(BASE), warmup="off", max_loras=1, max_lora_rank=16)
    handle = serve(llm, port=0, lora_dirs=[ADAPTERS])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = pb_grpc.EngineStub(channel)
            info = stub.LoadLora(pb.LoadLoraRequest(name="b", path=str(ADAPTERS / "b")), timeout=30)
            assert (info.name, info.slot, info.rank) == ("b", 0, 4)
            code, details = _error(lambda: stub.LoadLora(pb.LoadLoraRequest(name="c", path=str(ADAPTERS / "c")),
                                                         timeout=30))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "all 1 LoRA slots" in details
            code, _ = _error(lambda: stub.LoadLora(pb.LoadLoraRequest(name="c", path=str(ADAPTERS / "nope")),
                                                   timeout=30))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert [e.name for e in stub.ListLoras(pb.ListLorasRequest(), timeout=10).loras] == ["b"]
            _unload_after_checking(llm, "b")
            code, details = _error(lambda: list(stub.Generate(_request(PROMPTS[0], "b"), timeout=30)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown LoRA adapter 'b' (loaded: none)" in details
            assert not stub.UnloadLora(pb.UnloadLoraRequest(name="b"), timeout=10).found
            assert _slots(_stats(stub)) == (1, 0, 0, 1)
    finally:
        handle.stop(grace=5)


def test_a_server_without_lora_slots_says_so():
    handle = serve(make_llm(str(BASE), warmup="off"), port=0, lora_dirs=[ADAPTERS])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = pb_grpc.EngineStub(channel)
            code, details = _error(lambda: stub.LoadLora(pb.LoadLoraRequest(name="a", path=str(ADAPTERS / "a")),
                                                         timeout=30))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "LoRA is off" in details
            code, details = _error(lambda: list(stub.Generate(_request(PROMPTS[0], "a"), timeout=30)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "LoRA is off" in details
            assert not stub.UnloadLora(pb.UnloadLoraRequest(name="a"), timeout=10).found
            assert list(stub.ListLoras(pb.ListLorasRequest(), timeout=10).loras) == []
            assert _slots(_stats(stub)) == (0, 0, 0, 0)
    finally:
        handle.stop(grace=5)
