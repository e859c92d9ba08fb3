"""The gRPC server with its engine in a child process (`Spawn`, what `jphoton serve` runs): the same answers as the
in-process server and LLM.generate, bad input refused, pages freed after cancels, the child's death UNAVAILABLE.

One server for the module; its child builds the embedded model with the test engine arguments (conftest.ENGINE_ARGS),
so its greedy tokens equal the session's `embedded_llm`.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jphoton import LLM, SamplingParams
from jphoton.server import jphoton_pb2 as pb
from jphoton.server import jphoton_pb2_grpc as pb_grpc
from jphoton.server.app import serve
from jphoton.server.engine_process import EngineProcess, Spawn

from conftest import ENGINE_ARGS

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
NEW = 8


@pytest.fixture(scope="module")
def proc_srv(embedded_llm):
    refs = embedded_llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0))
    lp_ref = embedded_llm.generate(PROMPTS[1], SamplingParams(max_tokens=NEW, temperature=0, logprobs=3))[0]
    [chat_ref] = embedded_llm.chat([{"role": "user", "content": "What is 2+2?"}],
                                   SamplingParams(max_tokens=NEW, temperature=0))
    # max_prompt_bytes: a limit that admits the 15 MB prompt of the stall test (the default is 8 MiB)
    build = functools.partial(LLM, None, dtype="float32", freeze_gc=False, warmup="full", max_prompt_bytes=32 * 2**20,
                              **ENGINE_ARGS)
    handle = serve(Spawn(build), port=0, max_queue=256, wait=True, max_message_bytes=32 * 2**20)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield handle, pb_grpc.EngineStub(channel), refs, lp_ref, chat_ref
    channel.close()
    handle.stop(grace=5)


def _stats(stub) -> pb.Stats:
    return stub.GetStats(pb.GetStatsRequest(), timeout=10)


def _wait_idle(stub, timeout: float = 30.0) -> pb.Stats:
    deadline = time.monotonic() + timeout
    while True:
        s = _stats(stub)
        if s.kv_pages_free + s.kv_pages_evictable == s.kv_pages_total and s.running == 0 and s.waiting == 0 and s.queued == 0:
            return s
        assert time.monotonic() < deadline, f"pages/requests not released: {s}"
        time.sleep(0.02)


def _greedy(text: str, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=NEW, temperature=0, **kw))


def test_the_engine_runs_in_another_process(proc_srv):
    handle, stub, *_ = proc_srv
    ep = handle.server.servicer.engine
    assert isinstance(ep, EngineProcess) and ep.pid != os.getpid()
    assert handle.server.llm is None  # no LLM in the server process
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.vocab_size > 0 and info.dtype == "float32"


@pytest.mark.parametrize("paced", [False, True])
def test_streams_equal_llm_generate(proc_srv, paced, monkeypatch):
    """Also with every started stream paced (max_message_rate 1 token a second: a message every MAX_PACE ticks): the
    same tokens, text, logprobs and usage, in fewer messages."""
    handle, stub, refs, lp_ref, chat_ref = proc_srv
    if paced:
        monkeypatch.setattr(handle.server.servicer.engine, "max_message_rate", 1.0)
    compiles = _stats(stub).num_compiles

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            astub = pb_grpc.EngineStub(ch)

            async def one(request):
                msgs = [m async for m in astub.Generate(request, timeout=120)]
                return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs), msgs

            reqs = [_greedy(p) for p in PROMPTS] + [_greedy(PROMPTS[1], logprobs=3)]
            chat = pb.GenerateRequest(text="What is 2+2?", chat=True, sampling=pb.SamplingParams(max_tokens=NEW,
                                                                                                    temperature=0))
            return await asyncio.gather(*(one(r) for r in reqs + [chat]))

    got = asyncio.run(run())
    for (ids, text, msgs), ref in zip(got[:4], refs, strict=True):
        assert ids == ref.token_ids and text == ref.text
        assert msgs[-1].usage.completion_tokens == len(ref.token_ids)
    ids, _, msgs = got[4]
    lps = [lp for m in msgs for lp in m.logprobs]
    assert ids == lp_ref.token_ids and [lp.token_id for lp in lps] == [t for t, _, _ in lp_ref.logprobs]
    for lp, (_, logprob, top) in zip(lps, lp_ref.logprobs, strict=True):
        assert lp.logprob == pytest.approx(logprob, abs=1e-3)  # batched with 5 other streams: float32 rounding
        assert list(lp.top_token_ids) == list(top.keys())
    assert got[5][0] == chat_ref.token_ids and got[5][1] == chat_ref.text
    if paced:
        assert max(len(m.token_ids) for _, _, msgs in got for m in msgs) > 1
    assert _wait_idle(stub).num_compiles == compiles  # warm-up was "full": nothing compiles while serving


def test_bad_input_is_invalid_argument_and_nothing_is_queued(proc_srv):
    _, stub, *_ = proc_srv
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    bad = [
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, info.vocab_size + 5]), sampling=pb.SamplingParams(max_tokens=2)),
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * (info.max_context + 1))),  # longer than the context
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(json_schema="{not json")),
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(regex="a{1000000}")),  # issue 24 item 6
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=[f"s{i}" for i in range(100)])),  # item 3
        pb.GenerateRequest(text="   "),
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=1, choice=pb.Choice(options=["a b c d"]))),
    ]
    for request in bad:  # refused by the engine process, answered before any message
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # refused in the server process
        list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=2.0)), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _wait_idle(stub)
    ids, _, _ = _collect(stub.Generate(_greedy(PROMPTS[0]), timeout=60))
    assert len(ids) == NEW  # still serving
    choice = pb.SamplingParams(temperature=0, choice=pb.Choice(options=[" Paris", " London"]))
    _, text, msgs = _collect(stub.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling=choice), timeout=60))
    assert msgs[-1].HasField("choice_index") and text == [" Paris", " London"][msgs[-1].choice_index]
    assert len(msgs[-1].choice_scores) == 2  # the pick and the scores cross the process boundary


def _collect(responses):
    msgs = list(responses)
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs), msgs


def test_24_streams_with_cancels_and_aborts_free_every_page(proc_srv):
    """3x the child's batch (ENGINE_ARGS' max_num_seqs 8): streams queue behind running ones while others are
    cancelled and aborted (64 streams tested the same on 2 cores at 2.7x the time)."""
    handle, stub, *_ = proc_srv
    streams = 3 * ENGINE_ARGS["max_num_seqs"]
    compiles = _stats(stub).num_compiles

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            astub = pb_grpc.EngineStub(ch)

            async def one(i):
                req = pb.GenerateRequest(text=PROMPTS[i % 4], request_id=f"r{i}", sampling=pb.SamplingParams(
                    max_tokens=24, temperature=0.8, seed=i, ignore_eos=True))
                call = astub.Generate(req, timeout=120)
                n = 0
                async for m in call:
                    n += len(m.token_ids)
                    if i % 3 == 0 and n >= 2:
                        call.cancel()  # the client goes away
                        return "cancelled"
                    if i % 3 == 1 and n >= 2:
                        await astub.Abort(pb.AbortRequest(request_id=f"r{i}"), timeout=10)
                    if m.finish_reason:
                        return m.finish_reason
                return "cancelled"

            return await asyncio.gather(*(one(i) for i in range(streams)))

    reasons = asyncio.run(run())
    assert reasons.count("cancelled") == reasons.count("abort") == reasons.count("length") == streams // 3 == 8
    s = _wait_idle(stub)
    assert s.kv_pages_free + s.kv_pages_evictable == s.kv_pages_total and s.num_compiles == compiles


def _largest_gap(stub, during=None) -> tuple[float, list]:
    """The largest gap between two messages of a 40-token greedy stream (after its first token); `during()` runs on
    a thread started once the first token has arrived. Returns (gap in s, what during() returned)."""
    import threading

    result: list = []
    times = []
    thread = None
    request = pb.GenerateRequest(text=PROMPTS[2], sampling=pb.SamplingParams(max_tokens=40, temperature=0,
                                                                             ignore_eos=True))
    for _ in stub.Generate(request, timeout=120):
        times.append(time.perf_counter())
        if during is not None and thread is None:
            thread = threading.Thread(target=lambda: result.append(during()))
            thread.start()
    if thread is not None:
        thread.join()
    return max(b - a for a, b in zip(times[1:], times[2:], strict=False)), result


@pytest.mark.parametrize("megabytes", [15, 2])
def test_a_huge_prompt_stalls_no_stream_and_no_health_check(proc_srv, megabytes):
    """Issue 24 item 1: a 15 MB prompt stalled every stream and health check for ~8 s while it was tokenized on the
    event loop. Now preparation runs on worker threads after size checks that need no tokenizing (15 MB cannot fit an
    8,192-token context: refused at once; 2 MB is tokenized, then refused for its length)."""
    handle, stub, *_ = proc_srv
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{handle.port}"))
    big = ("All work and no play makes Jack a dull boy. " * (megabytes * 2**20 // 44 + 1))[:megabytes * 2**20]

    def hostile():
        import threading

        checks = []
        done = threading.Event()

        def poll_health():
            while not done.is_set():
                t0 = time.perf_counter()
                health.Check(health_pb2.HealthCheckRequest(service="jphoton.v1.Engine"), timeout=10)
                checks.append(time.perf_counter() - t0)
                time.sleep(0.02)

        poller = threading.Thread(target=poll_health)
        poller.start()
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text=big, sampling=pb.SamplingParams(max_tokens=4)), timeout=120))
        took = time.perf_counter() - t0
        done.set()
        poller.join()
        return e.value.code(), e.value.details(), took, max(checks)

    quiet, _ = _largest_gap(stub)
    busy, [(code, details, took, slowest_health)] = _largest_gap(stub, hostile)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "the context holds" in details and len(details) < 300
    # (the stall this guards against was ~8 s; on the busy 2-core CI box one check once took 286 ms while the 15 MB
    # request was in flight, so the bound leaves room for that and still fails at any tokenizing on the event loop)
    assert slowest_health < 1.0, f"a health check took {slowest_health * 1e3:.0f} ms"
    # 15 MB (the acceptance's case): refused from its size, within 3x. 2 MB: tokenized in the helper process, which on
    # the 2-core CI machine takes one of the cores the engine's CPU step runs on (niced, but 3.2x was seen once).
    # The client's own encoding of the 15 MB message shares the two cores too (a 261 ms gap beside 57 ms undisturbed
    # was seen once on CI), so a gap under 0.5 s passes whatever the ratio: tokenizing 2 MB on the event loop stalls
    # ~1 s and 15 MB ~8 s, so both still fail.
    bound = 3 if megabytes == 15 else 4
    assert busy <= max(bound * quiet, 0.5), \
        f"largest gap {busy * 1e3:.0f} ms while preparing vs {quiet * 1e3:.0f} ms undisturbed"
    _wait_idle(stub)


def test_a_child_that_cannot_build_its_llm_fails_the_load():
    ep = EngineProcess(Spawn(functools.partial(LLM, "random:no-such-model")))
    with pytest.raises(ValueError, match="no-such-model"):
        ep.start()


def test_the_engine_process_dying_is_unavailable_and_the_server_answers(proc_srv):
    """Last in the module: it kills the shared server's engine."""
    handle, stub, *_ = proc_srv
    call = stub.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling=pb.SamplingParams(
        max_tokens=400, temperature=0, ignore_eos=True)), timeout=120)
    next(call)
    os.kill(handle.server.servicer.engine.pid, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # (issue 60: INTERNAL, which a retry policy never retries)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_greedy(PROMPTS[0]), timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{handle.port}"))
    status = health.Check(health_pb2.HealthCheckRequest(service="jphoton.v1.Engine"), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING



def test_the_idle_engine_loop_runs_each_program_once(monkeypatch):
    """The engine process's loop, idle, runs each compiled program once (LLM.run_programs_once, one per pass) as the
    background warm-up makes them ready, then serves token-exact; it never does while a request runs."""
    import multiprocessing as mp
    import pickle
    import threading

    from jphoton.engine import warmup
    from jphoton.server.engine_loop import EngineLoop

    from conftest import FIXTURES, make_llm, tiny_reference

    monkeypatch.setattr(warmup, "FIRST_RUNS_ON_CPU", True)
    ref = tiny_reference("llama3")
    llm = make_llm(str(FIXTURES / "tiny" / "llama3"), warmup="background")
    first = llm.stats()["programs_run_once"]
    assert first >= 2  # LLM() ran the first shapes
    cmd_recv, cmd_send = mp.Pipe(duplex=False)
    ev_recv, ev_send = mp.Pipe(duplex=False)
    loop = threading.Thread(target=EngineLoop(llm, [(cmd_recv, ev_send)]).run)
    loop.start()
    try:
        assert llm.warmup.wait(timeout=600)  # every shape compiled; the runs are the loop's
        deadline = time.monotonic() + 60
        while llm.stats()["programs_run_once"] < len(llm.warmup.ready_programs()):
            assert time.monotonic() < deadline, llm.stats()
            time.sleep(0.05)
        greedy = SamplingParams(max_tokens=len(ref[0][1]), temperature=0, ignore_eos=True)
        for i, (p, _, _) in enumerate(ref):
            cmd_send.send_bytes(pickle.dumps(("add", i, {"prompt_token_ids": p.tolist()}, greedy, None)))
        got, done = {i: [] for i in range(len(ref))}, 0
        while done < len(ref):
            for e in pickle.loads(ev_recv.recv_bytes()):
                if e[0] == "out":
                    got[e[1]] += e[2]
                    done += e[4] is not None
        assert [got[i] for i in range(len(ref))] == [t.tolist() for _, t, _ in ref]
    finally:
        cmd_send.send_bytes(pickle.dumps(("shutdown",)))
        loop.join(timeout=60)
    assert not loop.is_alive()
    assert llm.engine.runner.first_ran == set(llm.warmup.ready_programs())


def test_quick_requests_are_prepared_in_the_engine_loop_and_others_wake_it(embedded_llm, monkeypatch):
    """Token ids and short text are prepared by the engine loop in the tick they arrive (a worker's result waited for the
    next tick: ~1 step of TTFT); a constraint or a long text still goes to a worker thread, whose result wakes an idle
    loop at once (it polled every 5 ms)."""
    import multiprocessing as mp
    import pickle
    import threading

    from jphoton.engine.driver import INLINE_MAX_CHARS
    from jphoton.server.engine_loop import EngineLoop

    llm = embedded_llm
    where, prepared, added, plain_prepare, plain_add = {}, {}, {}, llm.prepare_request, llm.add_request

    def prepare_request(prompt, params, request_id=None):
        where[params.max_tokens] = threading.current_thread().name
        seq = plain_prepare(prompt, params, request_id=request_id)
        prepared[params.max_tokens] = time.monotonic()
        return seq

    def add_request(seq):
        added[seq.params.max_tokens] = time.monotonic()
        return plain_add(seq)

    monkeypatch.setattr(llm, "prepare_request", prepare_request)
    monkeypatch.setattr(llm, "add_request", add_request)
    cmd_recv, cmd_send = mp.Pipe(duplex=False)
    ev_recv, ev_send = mp.Pipe(duplex=False)
    loop = threading.Thread(target=EngineLoop(llm, [(cmd_recv, ev_send)]).run, name="engine-loop")
    loop.start()
    requests = {1: {"prompt_token_ids": [5, 6, 7]}, 2: "A short prompt.", 3: "x" * (INLINE_MAX_CHARS + 1),
                4: "A short prompt with a constraint."}
    try:
        for max_tokens, prompt in requests.items():
            params = SamplingParams(max_tokens=max_tokens, regex="[ab]+" if max_tokens == 4 else None)
            cmd_send.send_bytes(pickle.dumps(("add", max_tokens, prompt, params, None)))
            finished = False
            while not finished:
                assert ev_recv.poll(30)
                finished = any(e[0] == "out" and e[1] == max_tokens and e[4] is not None
                               for e in pickle.loads(ev_recv.recv_bytes()))
            if max_tokens >= 3:  # a worker prepared it on an idle loop: 0.5 s (the idle wait) without the wake-up
                assert added[max_tokens] - prepared[max_tokens] < 0.4
    finally:
        cmd_send.send_bytes(pickle.dumps(("shutdown",)))
        loop.join(timeout=60)
    assert where[1] == where[2] == "engine-loop"
    assert where[3].startswith("jphoton-prepare") and where[4].startswith("jphoton-prepare")
