"""End-to-end tests of the gRPC server on loopback with the embedded model (one server for the module).

Pages are checked server-side (GetStats), never inferred from the client's view of a cancelled call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import json
import os
import pathlib
import re
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jphoton import SamplingParams
from jphoton.server import jphoton_pb2 as pb
from jphoton.server import jphoton_pb2_grpc as pb_grpc
from jphoton.server.app import ServerThread, serve
from jphoton.server.service import SERVICE_NAME

SERVER_DIR = pathlib.Path(__file__).parent.parent / "jphoton" / "server"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
CHAT = "What is 2+2?"
NEW = 8  # tokens per stream: small, CPU time is the budget
GREEDY = pb.SamplingParams(max_tokens=NEW, temperature=0)
LOGPROB_CASES = [  # (over gRPC, through LLM.generate): greedy with the top 3, seeded with the chosen token's only
    (pb.SamplingParams(max_tokens=NEW, temperature=0, logprobs=3), SamplingParams(max_tokens=NEW, temperature=0,
                                                                                  logprobs=3)),
    (pb.SamplingParams(max_tokens=NEW, temperature=0.9, seed=5, logprobs=0),
     SamplingParams(max_tokens=NEW, temperature=0.9, seed=5, logprobs=0)),
]


@dataclasses.dataclass
class Harness:
    handle: ServerThread
    channel: grpc.Channel
    stub: pb_grpc.EngineStub
    health: health_pb2_grpc.HealthStub
    llm: object
    refs: list  # LLM.generate's completions of PROMPTS, greedy, NEW tokens
    lp_refs: list  # LLM.generate's completions of LOGPROB_CASES
    chat_ref: object
    status_while_loading: int
    code_while_loading: grpc.StatusCode

    def stats(self) -> pb.Stats:
        return self.stub.GetStats(pb.GetStatsRequest(), timeout=10)

    def wait_idle(self, timeout: float = 15.0) -> pb.Stats:
        """Poll GetStats until every KV page is free and nothing runs or waits (the engine's zombie release)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            idle = s.running == 0 and s.waiting == 0 and s.queued == 0
            if s.kv_pages_free + s.kv_pages_evictable == s.kv_pages_total and idle:
                return s
            assert time.monotonic() < deadline, f"pages/requests not released: {s}"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def srv(embedded_llm):
    llm = embedded_llm
    # References first: once the server runs, its engine thread owns the LLM.
    refs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0))
    [chat_ref] = llm.chat([{"role": "user", "content": CHAT}], SamplingParams(max_tokens=NEW, temperature=0))
    lp_refs = [llm.generate(PROMPTS[1], params)[0] for _, params in LOGPROB_CASES]  # one at a time, as served
    gate = threading.Event()

    def load():  # the model "loads" until the test has looked at the server in that state
        gate.wait(60)
        return llm

    handle = serve(load, port=0, max_queue=64, metrics_port=0, wait=False)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    stub, health = pb_grpc.EngineStub(channel), health_pb2_grpc.HealthStub(channel)
    loading = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10).status
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(text="hi", sampling=GREEDY), timeout=10))
    gate.set()
    handle.wait_ready(120)
    yield Harness(handle, channel, stub, health, llm, refs, lp_refs, chat_ref, loading, e.value.code())
    channel.close()
    handle.stop(grace=5)


@pytest.fixture(autouse=True)
def _idle_after(request):
    """Every test leaves the engine idle (before conftest's leak check looks at the LLM)."""
    yield
    if "srv" in request.fixturenames:
        h = request.getfixturevalue("srv")
        if h.handle.server.servicer.engine is not None and not h.handle.server._stopped:
            h.wait_idle()


def _code(call_fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call_fn()
    return e.value.code()


def _collect(responses) -> tuple[list[int], str, list]:
    msgs = list(responses)
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs), msgs


# ---- stubs ----------------------------------------------------------------------------------------------------------
def test_committed_stubs_match_the_proto_and_import_on_old_runtimes():
    proto_sha = hashlib.sha256((SERVER_DIR / "jphoton.proto").read_bytes()).hexdigest()
    for name in ("jphoton_pb2.py", "jphoton_pb2_grpc.py"):
        text = (SERVER_DIR / name).read_text()
        assert f"sha256={proto_sha}" in text.splitlines()[1], f"{name} is stale: run jphoton/server/gen_stubs.sh"
    # Generated code refuses runtimes older than its generator: keep it importable with grpcio 1.84 + protobuf 7.36.
    grpc_gen = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", (SERVER_DIR / "jphoton_pb2_grpc.py").read_text())
    assert tuple(map(int, grpc_gen.group(1).split("."))) <= (1, 84, 0)
    pb_gen = re.search(r"Protobuf Python Version: ([\d.]+)", (SERVER_DIR / "jphoton_pb2.py").read_text())
    assert tuple(map(int, pb_gen.group(1).split("."))) <= (7, 36, 2)


# ---- life cycle -----------------------------------------------------------------------------------------------------
def test_health_is_not_serving_until_the_model_is_warm(srv):
    assert srv.status_while_loading == health_pb2.HealthCheckResponse.NOT_SERVING
    assert srv.code_while_loading == grpc.StatusCode.UNAVAILABLE
    for service in ("", SERVICE_NAME):
        status = srv.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_model_info_and_stats(srv):
    info = srv.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.architecture == "llama" and "SmolLM2" in info.name
    assert info.vocab_size == srv.llm.config.vocab_size and info.max_context == srv.llm.max_model_len
    assert info.dtype == "float32"
    s = srv.stats()
    assert s.kv_pages_total > 0 and s.max_queue == 64 and s.num_compiles > 0


# ---- generation -----------------------------------------------------------------------------------------------------
def test_streamed_tokens_equal_llm_generate(srv):
    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.handle.port}") as ch:
            stub = pb_grpc.EngineStub(ch)

            async def one(request):
                return [m async for m in stub.Generate(request, timeout=60)]

            requests = [pb.GenerateRequest(text=p, sampling=GREEDY) for p in PROMPTS]
            requests.append(pb.GenerateRequest(text=CHAT, chat=True, sampling=GREEDY))
            requests.append(pb.GenerateRequest(token_ids=pb.TokenIds(ids=srv.refs[0].prompt_token_ids),
                                               sampling=GREEDY))
            return await asyncio.gather(*(one(r) for r in requests))

    results = asyncio.run(run())
    expected = [*srv.refs, srv.chat_ref, srv.refs[0]]
    for msgs, ref in zip(results, expected, strict=True):
        assert [t for m in msgs for t in m.token_ids] == ref.token_ids
        assert "".join(m.text for m in msgs) == ref.text
        assert [m.finish_reason for m in msgs[:-1]] == [""] * (len(msgs) - 1), "finish_reason only on the last"
        last = msgs[-1]
        assert last.finish_reason == ref.finish_reason
        assert last.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert last.usage.completion_tokens == len(ref.token_ids)
        assert msgs[0].request_id.startswith("jphoton-")  # server-assigned when the client gives none
    ids = {msgs[0].request_id for msgs in results}  # unguessable (issue 24: sequential ids let a client Abort another's)
    assert len(ids) == len(results) and all(len(i) == len("jphoton-") + 24 for i in ids)


def test_24_concurrent_streams_complete_without_compiling(srv):
    """3x the engine's batch (conftest.ENGINE_ARGS' max_num_seqs 8): streams wait behind running ones, every bucket
    serves (64 streams tested the same on 2 cores at 2.7x the time)."""
    from conftest import ENGINE_ARGS

    streams = 3 * ENGINE_ARGS["max_num_seqs"]
    compiles_before = srv.stats().num_compiles

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.handle.port}") as ch:
            stub = pb_grpc.EngineStub(ch)

            async def one(i):
                sampling = pb.SamplingParams(max_tokens=4, temperature=0 if i % 2 else 0.8, seed=i, ignore_eos=True)
                msgs = [m async for m in stub.Generate(
                    pb.GenerateRequest(request_id=f"c{i}", text=PROMPTS[i % len(PROMPTS)], sampling=sampling),
                    timeout=300)]
                return msgs

            return await asyncio.gather(*(one(i) for i in range(streams)))

    results = asyncio.run(run())
    assert len(results) == streams == 24
    for i, msgs in enumerate(results):
        assert msgs[0].request_id == f"c{i}"
        assert sum(len(m.token_ids) for m in msgs) == 4
        assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == 4
    assert srv.wait_idle().num_compiles == compiles_before, "serving compiled after warm-up"


# ---- cancellation and abort ----------------------------------------------------------------------------------------
def _long(request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, text=PROMPTS[0],
                              sampling=pb.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))


def test_client_cancellation_frees_pages(srv):
    call = srv.stub.Generate(_long(), timeout=120)
    for _ in range(3):
        next(call)
    mid = srv.stats()
    assert mid.running == 1 and mid.kv_pages_free + mid.kv_pages_evictable < mid.kv_pages_total
    call.cancel()
    srv.wait_idle(timeout=10)  # server-side proof: the engine aborted the request and took its pages back


def test_abort_by_request_id_ends_the_stream_normally(srv):
    call = srv.stub.Generate(_long("abort-me"), timeout=120)
    first = next(call)
    assert first.request_id == "abort-me"
    # A second live request with the same id is refused; the first is unaffected.
    assert _code(lambda: list(srv.stub.Generate(_long("abort-me"), timeout=30))) == grpc.StatusCode.ALREADY_EXISTS
    assert srv.stub.Abort(pb.AbortRequest(request_id="abort-me"), timeout=10).found
    rest = list(call)  # ends without an RpcError: status OK
    assert rest[-1].finish_reason == "abort"
    assert call.code() == grpc.StatusCode.OK
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) < 400
    srv.wait_idle(timeout=10)
    assert not srv.stub.Abort(pb.AbortRequest(request_id="abort-me"), timeout=10).found


# ---- status codes ---------------------------------------------------------------------------------------------------
def _raw_generate(srv, data: bytes):
    """Send bytes as they are: requests that a well-behaved client library cannot build."""
    method = srv.channel.unary_stream("/jphoton.v1.Engine/Generate", request_serializer=lambda b: b,
                                      response_deserializer=pb.GenerateResponse.FromString)
    return list(method(data, timeout=30))


def test_bad_inputs_are_invalid_argument_and_the_server_keeps_serving(srv):
    S = pb.SamplingParams
    bad = {
        "empty text": pb.GenerateRequest(text="", sampling=GREEDY),
        "no input": pb.GenerateRequest(sampling=GREEDY),
        "temperature < 0": pb.GenerateRequest(text="hi", sampling=S(temperature=-0.5)),
        "temperature nan": pb.GenerateRequest(text="hi", sampling=S(temperature=float("nan"))),
        "top_p = 0": pb.GenerateRequest(text="hi", sampling=S(top_p=0)),
        "top_p > 1": pb.GenerateRequest(text="hi", sampling=S(top_p=1.5)),
        "top_k < 0": pb.GenerateRequest(text="hi", sampling=S(top_k=-1)),
        "max_tokens = 0": pb.GenerateRequest(text="hi", sampling=S(max_tokens=0)),
        "max_tokens beyond the context": pb.GenerateRequest(text="hi", sampling=S(max_tokens=10**6)),
        "too many stop_token_ids": pb.GenerateRequest(text="hi", sampling=S(stop_token_ids=range(5000))),  # (every
        # uint64 seed is legal since issue 60)
        "invalid json schema": pb.GenerateRequest(text="hi", sampling=S(json_schema="{not json")),
        "invalid regex": pb.GenerateRequest(text="hi", sampling=S(regex="(unclosed")),
        "invalid grammar": pb.GenerateRequest(text="hi", sampling=S(grammar="start: ((( ")),
        "empty choice": pb.GenerateRequest(text="hi", sampling=S(choice=pb.Choice())),
        "token id outside the vocabulary": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**6])),
        "empty token ids": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])),
        "chat with token ids": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), chat=True),
        "stop token outside the vocabulary": pb.GenerateRequest(text="hi", sampling=S(stop_token_ids=[10**6])),
        "top_p denormal": pb.GenerateRequest(text="hi", sampling=S(top_p=1e-45)),
        "json schema nested too deeply": pb.GenerateRequest(text="hi", sampling=S(
            json_schema="[" * 100_000 + "]" * 100_000)),
        "a 200 KB invalid regex": pb.GenerateRequest(text="hi", sampling=S(regex="(" + "a" * 200_000)),
    }
    for name, request in bad.items():
        with pytest.raises(grpc.RpcError) as e:
            list(srv.stub.Generate(request, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {e.value.code()} {e.value.details()[:200]}"
        assert 0 < len(e.value.details()) <= 1100, name  # never the whole input back (issue 24)
    # Two constraints: a oneof keeps only the last one parsed, so build the bytes by hand (one SamplingParams per
    # constraint, concatenated: the wire format merges them).
    two = (pb.GenerateRequest(text="hi", sampling=S(regex="a+")).SerializeToString()
           + pb.GenerateRequest(sampling=S(choice=pb.Choice(options=["x", "y"]))).SerializeToString())
    with pytest.raises(grpc.RpcError) as e:
        _raw_generate(srv, two)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "constraint" in e.value.details()
    # Both a text and token ids (the oneof would keep the last): refused, not run with one of them (issue 24).
    both = (pb.GenerateRequest(text="hi", sampling=GREEDY).SerializeToString()
            + pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])).SerializeToString())
    with pytest.raises(grpc.RpcError) as e:
        _raw_generate(srv, both)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not both" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        _raw_generate(srv, b"\x12\x02\xff\xfe")  # text = invalid UTF-8
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        _raw_generate(srv, b"\x12\x10ab")  # truncated
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Still serving, and nothing was queued.
    tokens, _, msgs = _collect(srv.stub.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling=GREEDY), timeout=60))
    assert tokens == srv.refs[0].token_ids
    srv.wait_idle()


def test_constrained_requests_over_grpc(srv):
    S = pb.SamplingParams
    cases = [
        (S(max_tokens=40, temperature=0, regex=r"\d{3}-\d{4}"), lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
        (S(max_tokens=40, temperature=0, choice=pb.Choice(options=["yes", "no"])), lambda t: t in ("yes", "no")),
        (S(max_tokens=60, temperature=0.7, seed=3, json_schema=json.dumps(
            {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["n"], "additionalProperties": False})),
         lambda t: set(json.loads(t)) == {"n"} and 0 <= json.loads(t)["n"] <= 9),
    ]
    for sampling, ok in cases:
        _, text, msgs = _collect(srv.stub.Generate(pb.GenerateRequest(text=CHAT, chat=True, sampling=sampling),
                                                   timeout=60))
        assert msgs[-1].finish_reason == "stop" and ok(text), (sampling, text)
    srv.wait_idle()


def test_choice_over_grpc_reports_the_pick_and_the_scores(srv):
    question = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
    options = ["Paris", "London", "Berlin"]
    sampling = pb.SamplingParams(temperature=0, choice=pb.Choice(options=options))
    _, text, msgs = _collect(srv.stub.Generate(pb.GenerateRequest(text=question[0]["content"], chat=True,
                                                                  sampling=sampling), timeout=60))
    [ref] = srv.llm.chat(question, SamplingParams(temperature=0, choice=options))
    assert text == ref.text == "Paris" and msgs[-1].HasField("choice_index") and msgs[-1].choice_index == 0
    assert list(msgs[-1].choice_scores) == pytest.approx(ref.choice_scores, abs=1e-4)
    assert not any(m.HasField("choice_index") or m.choice_scores for m in msgs[:-1])
    s = srv.wait_idle()  # the same chat prompt twice: its full pages came from the prefix cache the second time
    assert s.prefix_hit_tokens > 0 and s.prefix_query_tokens >= s.prefix_hit_tokens and s.kv_pages_evictable > 0


def test_logprobs_over_grpc_equal_llm_generate(srv):
    """SamplingParams.logprobs over gRPC: one TokenLogprob per token, equal to LLM.generate's (greedy and seeded)."""
    for (sampling, params), ref in zip(LOGPROB_CASES, srv.lp_refs, strict=True):
        tokens, _, msgs = _collect(srv.stub.Generate(pb.GenerateRequest(text=PROMPTS[1], sampling=sampling),
                                                     timeout=60))
        got = [lp for m in msgs for lp in m.logprobs]
        assert tokens == ref.token_ids and len(got) == len(ref.logprobs) == len(tokens)
        for lp, (token, logprob, top) in zip(got, ref.logprobs, strict=True):
            assert lp.token_id == token and lp.logprob == pytest.approx(logprob, rel=1e-6, abs=1e-6)
            assert list(lp.top_token_ids) == list(top) and len(top) == params.logprobs
            assert list(lp.top_logprobs) == pytest.approx(list(top.values()), rel=1e-6, abs=1e-6)
    assert not any(m.logprobs for m in srv.stub.Generate(pb.GenerateRequest(text=PROMPTS[1], sampling=GREEDY),
                                                           timeout=60))  # none unless asked
    too_many = pb.SamplingParams(max_tokens=2, logprobs=srv.llm.engine_config.max_logprobs + 1)
    assert _code(lambda: list(srv.stub.Generate(pb.GenerateRequest(text="x", sampling=too_many), timeout=30))) == \
        grpc.StatusCode.INVALID_ARGUMENT
    srv.wait_idle()


def test_the_served_llm_takes_generate_from_another_thread(srv):
    """Issue 24 item 2: generate on the LLM the server drives dropped tokens from the server's streams. Now its requests
    join the server's batches (the server's engine thread ticks; generate waits for its ticks), and both get all their
    tokens. step() from another thread stays a clear error (it would take the server's outputs)."""
    import concurrent.futures

    greedy = SamplingParams(max_tokens=NEW, temperature=0)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        served = [pool.submit(lambda i=i: _collect(srv.stub.Generate(
            pb.GenerateRequest(text=PROMPTS[i % 4], sampling=GREEDY), timeout=60))[0]) for i in range(6)]
        local = [pool.submit(lambda i=i: srv.llm.generate(PROMPTS[i % 4], greedy)[0].token_ids) for i in range(2)]
        assert [f.result() for f in served] == [srv.refs[i % 4].token_ids for i in range(6)]
        assert [f.result() for f in local] == [srv.refs[i % 4].token_ids for i in range(2)]
    with pytest.raises(RuntimeError, match="drives this LLM"):
        srv.llm.step()
    srv.wait_idle()


@pytest.mark.parametrize("megabytes", [15, 2])
def test_a_huge_prompt_stalls_no_stream_and_no_health_check_in_process(srv, megabytes):
    """Issue 24 item 1 for `serve(llm)` (engine thread, event loop and preparation share one process and its GIL): a
    15 MB prompt that the limits admit is refused without tokenizing (it cannot fit the context); a 2 MB one is
    tokenized in the helper process, then refused for its length. Meanwhile another stream's largest gap stays within
    3x its undisturbed one and health checks answer within 250 ms."""
    from jphoton.engine.config import Limits

    llm = srv.llm
    saved = llm.engine_config
    llm.engine_config = dataclasses.replace(saved, limits=Limits(max_prompt_bytes=32 * 2**20))  # admit 15 MB
    # A served LLM has frozen its start-up objects out of garbage collection (EngineConfig.freeze_gc); the tests'
    # engines do not (conftest.make_llm), and a full collection held the GIL for 100-360 ms on the busy CI box.
    gc.collect()
    gc.freeze()
    big = ("All work and no play makes Jack a dull boy. " * (megabytes * 2**20 // 44 + 1))[:megabytes * 2**20]
    try:
        def gaps(during=None):
            times, result, thread = [], [], None
            request = pb.GenerateRequest(text=PROMPTS[2], sampling=pb.SamplingParams(max_tokens=40, temperature=0,
                                                                                     ignore_eos=True))
            for _ in srv.stub.Generate(request, timeout=120):
                times.append(time.perf_counter())
                if during is not None and thread is None:
                    thread = threading.Thread(target=lambda: result.append(during()))
                    thread.start()
            if thread is not None:
                thread.join()
            return max(b - a for a, b in zip(times[1:], times[2:], strict=False)), result

        # The request's bytes are made before anything is timed: a client builds them in its own process, and
        # building 15 MB here would hold this process's GIL (the server's) for the test's sake.
        wire = pb.GenerateRequest(text=big).SerializeToString()
        generate_bytes = srv.channel.unary_stream("/jphoton.v1.Engine/Generate",
                                                  response_deserializer=pb.GenerateResponse.FromString)

        def polling_health(work):
            checks, done = [], threading.Event()

            def poll():
                while not done.is_set():
                    t0 = time.perf_counter()
                    srv.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
                    checks.append(time.perf_counter() - t0)
                    time.sleep(0.02)

            poller = threading.Thread(target=poll)
            poller.start()
            try:
                result = work()
            finally:
                done.set()
                poller.join()
            return result, max(checks)

        def hostile():
            return polling_health(lambda: _code(lambda: list(generate_bytes(wire, timeout=120))))

        def calm():
            return polling_health(lambda: time.sleep(0.5))[1]

        # the undisturbed largest gap of two runs: one run's on the busy 2-core CI box once came to 80 ms and the
        # prepared run's to 244 (2026-11-28); the stall this guards against held the stream for seconds
        quiet = max(gaps()[0], gaps()[0])
        _, [quiet_health] = gaps(calm)
        # 250 ms (the acceptance, CPU) or twice the undisturbed slowest check; gaps: 2 MB puts the helper process on one
        # of the 2 CI cores. Up to three tries: a stall the huge prompt causes shows in every one (it took seconds); the
        # busy CI box stalls on its own now and then (health checks of 263, 312, 255 ms in three CI runs, 18 ms quiet).
        limit, bound, tries = max(0.25, 2 * quiet_health), 3 if megabytes == 15 else 4, []
        for _ in range(3):
            busy, [(code, slowest_health)] = gaps(hostile)
            tries.append(f"{slowest_health * 1e3:.0f} ms health, {busy * 1e3:.0f} ms gap")
            if code != grpc.StatusCode.INVALID_ARGUMENT or (slowest_health < limit and busy <= bound * quiet):
                break
    finally:
        llm.engine_config = saved
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert slowest_health < limit, f"a health check took too long ({quiet_health * 1e3:.0f} ms quiet; tries: {tries})"
    assert busy <= bound * quiet, f"largest gap vs {quiet * 1e3:.0f} ms undisturbed (tries: {tries})"
    srv.wait_idle()


OLD_CLIENT = r"""
import sys
from server import jphoton_pb2 as pb, jphoton_pb2_grpc as pb_grpc
import grpc
assert "logprobs" not in pb.GenerateResponse.DESCRIPTOR.fields_by_name  # really the old stubs
stub = pb_grpc.EngineStub(grpc.insecure_channel(sys.argv[1]))
msgs = list(stub.Generate(pb.GenerateRequest(text=sys.argv[2], sampling=pb.SamplingParams(max_tokens=int(sys.argv[3]),
                                                                                      temperature=0)), timeout=60))
stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
print(" ".join(str(t) for m in msgs for t in m.token_ids), msgs[-1].finish_reason, stats.kv_pages_total, sep="|")
"""


def test_a_client_built_from_the_wave_1_proto_still_works(srv):
    """Stubs generated from 98dc4d0's proto (tests/fixtures/client_98dc4d0) against today's server, in a process of
    their own (both define jphoton.v1 in protobuf's global pool)."""
    import subprocess
    import sys

    fixture = pathlib.Path(__file__).parent / "fixtures" / "client_98dc4d0"
    proc = subprocess.run([sys.executable, "-c", OLD_CLIENT, f"127.0.0.1:{srv.handle.port}", PROMPTS[0], str(NEW)],
                          cwd=fixture, env={**os.environ, "PYTHONPATH": str(fixture)}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens, reason, pages = proc.stdout.strip().split("|")
    assert [int(t) for t in tokens.split()] == srv.refs[0].token_ids and reason == srv.refs[0].finish_reason
    assert int(pages) == srv.stats().kv_pages_total


def test_full_queue_is_resource_exhausted(srv):
    admission = srv.handle.server.admission
    admission.capacity = 2
    calls = []
    try:
        calls = [srv.stub.Generate(_long(f"q{i}"), timeout=120) for i in range(2)]
        for c in calls:
            next(c)  # both admitted and streaming
        assert srv.stats().queued == 2
        code = _code(lambda: list(srv.stub.Generate(pb.GenerateRequest(text="hi", sampling=GREEDY), timeout=30)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert srv.stats().running == 2  # and the server still answers
    finally:
        for c in calls:
            c.cancel()
        admission.capacity = 64
    srv.wait_idle()
    tokens, _, _ = _collect(srv.stub.Generate(pb.GenerateRequest(text=PROMPTS[1], sampling=GREEDY), timeout=60))
    assert tokens == srv.refs[1].token_ids


# ---- reflection and metrics -----------------------------------------------------------------------------------------
def test_a_client_built_only_from_reflection_can_generate_and_get_stats(srv):
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(f"127.0.0.1:{srv.handle.port}") as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        assert {"jphoton.v1.Engine", "grpc.health.v1.Health"} <= set(db.get_services())
        pool = descriptor_pool.DescriptorPool(db)  # a fresh pool: nothing from server/'s stubs
        service = pool.FindServiceByName("jphoton.v1.Engine")
        gen, stats = service.methods_by_name["Generate"], service.methods_by_name["GetStats"]
        Req, Resp = (message_factory.GetMessageClass(d) for d in (gen.input_type, gen.output_type))
        SReq, SResp = (message_factory.GetMessageClass(d) for d in (stats.input_type, stats.output_type))
        assert Req is not pb.GenerateRequest
        request = Req(text=PROMPTS[2])
        request.sampling.max_tokens, request.sampling.temperature = NEW, 0.0
        call = ch.unary_stream("/jphoton.v1.Engine/Generate", request_serializer=Req.SerializeToString,
                               response_deserializer=Resp.FromString)
        msgs = list(call(request, timeout=60))
        assert [t for m in msgs for t in m.token_ids] == srv.refs[2].token_ids
        get_stats = ch.unary_unary("/jphoton.v1.Engine/GetStats", request_serializer=SReq.SerializeToString,
                                   response_deserializer=SResp.FromString)
        s = get_stats(SReq(), timeout=10)
        assert s.kv_pages_total > 0


def test_prometheus_metrics(srv):
    list(srv.stub.Generate(pb.GenerateRequest(text=PROMPTS[3], sampling=GREEDY), timeout=60))
    body = urllib.request.urlopen(f"http://127.0.0.1:{srv.handle.metrics_port}/metrics", timeout=10).read().decode()
    values = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["jphoton_time_to_first_token_seconds_count"] >= 1
    assert values["jphoton_inter_token_latency_seconds_count"] >= 1
    assert values["jphoton_kv_pages_total"] > 0 and 0 <= values["jphoton_kv_usage_ratio"] <= 1
    assert values["jphoton_num_compiles"] > 0
    for gauge in ("jphoton_queue_requests", "jphoton_running_requests", "jphoton_waiting_requests"):
        assert gauge in values
    assert values['jphoton_requests_total{code="OK",finish_reason="length"}'] >= 1


# ---- the CLI and shutdown -------------------------------------------------------------------------------------------
def test_serve_cli_flags(capsys):
    from jphoton.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--host", "--port", "--dtype", "--pipeline-depth", "--max-queue", "--metrics-port",
                 "--no-prefix-caching"):
        assert flag in out
    # A model that cannot load ends the command with an error (after the port was opened and closed again).
    assert main(["serve", "--model", "random:no-such-model", "--port", "0"]) == 2


def test_graceful_shutdown_drains_in_flight_streams(srv):
    """Last in the module: it stops the shared server."""
    n = 24
    call = srv.stub.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling=pb.SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True)), timeout=120)
    msgs = [next(call)]
    stopper = threading.Thread(target=srv.handle.stop, kwargs={"grace": 60})
    stopper.start()
    deadline = time.monotonic() + 10
    while not srv.handle.server.servicer.draining:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert srv.llm.stats()["running"] == 1  # shutdown began with the stream in flight
    msgs += list(call)
    stopper.join(60)
    assert not stopper.is_alive()
    assert sum(len(m.token_ids) for m in msgs) == n and msgs[-1].finish_reason == "length"
    assert _code(lambda: srv.stub.GetStats(pb.GetStatsRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE
    stats = srv.llm.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_evictable"] == stats["kv_pages_total"]


def test_sigterm_as_soon_as_the_port_opens_exits_cleanly():
    """`jphoton serve` stopped right after its startup line (the model still loading): exit 0, every time. It used to
    die of the signal (handlers were installed after the line) or abort (the interpreter unwound the loader thread
    inside XLA): 6 of 12 runs on a loaded 2-core machine."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "jphoton", "serve", "--port", str(port)], cwd=root, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline().startswith("jphoton: gRPC on")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
