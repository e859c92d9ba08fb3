"""Soak: the gRPC server (engine in this process, the session's embedded LLM) under a random mix of well-behaved,
cancelled, aborted, constrained and hostile requests arriving at random times (issues 24 and 60: the second round's
inputs are the `hostile2` kind, each answered within HOSTILE_S).

At the end every KV page is free, nothing compiled after warm-up, every call ended with the status its kind allows
(never INTERNAL/UNKNOWN), and the process's RSS grew at most 10% after the first third of the run (the first minute
of the long variant). JPHOTON_SOAK_S sets the duration (default 30 s, CI); `JPHOTON_SOAK_LONG=1 pytest -m soak_long
tests/test_soak.py` runs the long variant (10 minutes).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import time

import grpc
import pytest

from jphoton.server import jphoton_pb2 as pb
from jphoton.server import jphoton_pb2_grpc as pb_grpc
from jphoton.server.app import serve

from conftest import return_freed_memory

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,", "Dear diary, today"]
OK = grpc.StatusCode.OK
BAD = grpc.StatusCode.INVALID_ARGUMENT
CLIENTS = 12  # concurrent callers, each sending one request after another with random pauses
HOSTILE_S = 10.0  # a hostile call is refused or served within this (alone on the CI box: 2 s, tests/test_server_hostile)


def _wire(*messages) -> bytes:
    """GenerateRequest bytes as a hostile client writes them: an empty unknown group (field 99: start, end) in front,
    then each message's fields (two inputs or two constraints: protobuf's parser keeps the last, the server refuses)."""
    return bytes([0x9B, 0x06, 0x9C, 0x06]) + b"".join(m.SerializeToString() for m in messages)


def _hostile2(rng: random.Random, i: int):
    """(request or raw bytes, the status codes allowed): the second hostile round (issue 60)."""
    sp = pb.SamplingParams(max_tokens=4, temperature=0.0)
    h = rng.randrange(9)
    if h == 0:  # many short options: refused by the choice budget, or scored in bounded time
        sp.choice.options.extend([f"option {k}" for k in range(1024)])
        return pb.GenerateRequest(text="Pick one:", sampling=sp), {OK, BAD}
    if h == 1:  # a legal-size schema with thousands of properties
        props = {f"p{k}": {"type": "integer"} for k in range(6000)}
        sp.json_schema = json.dumps({"type": "object", "properties": props})
        return pb.GenerateRequest(text="JSON:", sampling=sp), {OK, BAD}
    if h == 2:
        sp.stop_token_ids.extend(range(98_000))
        return pb.GenerateRequest(text="Hello", sampling=sp), {BAD}
    if h == 3:
        return pb.GenerateRequest(text="Hello", sampling=sp, request_id="r" * 1_000_000), {BAD}
    if h == 4:
        return _wire(pb.GenerateRequest(text="Hello"), pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]))), {BAD}
    if h == 5:
        return _wire(pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(regex="[a-z]+")),
                     pb.GenerateRequest(sampling=pb.SamplingParams(json_schema='{"type": "integer"}'))), {BAD}
    if h == 6:  # 1.4 million empty stop strings (sampling sent 700k times, merged), 4 MB
        return _wire(pb.GenerateRequest(text="Hi")) + bytes([0x2A, 0x04, 0x32, 0x00, 0x32, 0x00]) * 700_000, {BAD}
    if h == 7:  # 1.4 million unknown fields (field 99, varint 0), 4 MB: more than a request of this size may carry
        return _wire(pb.GenerateRequest(text="Hi", sampling=sp)) + bytes([0x98, 0x06, 0x00]) * 1_400_000, {BAD}
    sp.seed = 2**64 - 1  # legal: the whole uint64 range
    return pb.GenerateRequest(text="Hello", sampling=sp, request_id=f"soak-{i}"), {OK}


def _rss_bytes() -> int:
    """The process's resident memory after handing the heap's free pages back (glibc keeps freed pages in its arenas;
    the hostile requests' megabyte buffers, freed on gRPC threads, would otherwise show as growth that is not a leak)."""
    return_freed_memory()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _request(kind: str, rng: random.Random, i: int) -> pb.GenerateRequest:
    text = rng.choice(PROMPTS)
    sp = pb.SamplingParams(max_tokens=rng.randint(2, 16), temperature=rng.choice([0.0, 0.7, 1.0]), seed=i)
    if kind == "regex":
        sp.regex = rng.choice(["[a-z]{2,6}", "(yes|no)", "[0-9]+"])
    elif kind == "json":
        sp.json_schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    elif kind == "choice":
        sp.choice.options.extend(["Paris", "London", "Berlin"])
    elif kind == "logprobs":
        sp.logprobs = 3
    elif kind == "hostile":
        h = rng.randrange(7)
        if h == 0:
            sp.stop.extend([f"s{k}" for k in range(5000)])  # over max_stop_strings
        elif h == 1:
            sp.regex = "a{1000000}"  # past llguidance's limits: refused at submission
        elif h == 2:
            text = "   "  # blank
        elif h == 3:
            sp.top_p = 1e-45
        elif h == 4:
            sp.json_schema = "{not json"
        elif h == 5:
            text = "word " * rng.randint(400_000, 1_000_000)  # 2-5 MB: tokenized off the loop, then too long
        else:
            return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**9]), sampling=sp)
    return pb.GenerateRequest(text=text, sampling=sp, request_id=f"soak-{i}")


REQUIRED = ("plain", "cancel", "abort", "regex", "json", "choice", "hostile", "hostile2")  # each client's first request
# is one of these in turn, so that every kind runs however the dice fall on a slow box


async def _client(stub, raw, rng: random.Random, deadline: float, counter, outcomes: collections.Counter,
                  first: str) -> None:
    kinds = ["plain"] * 6 + ["cancel", "abort", "regex", "json", "choice", "logprobs", "hostile", "hostile",
                             "hostile2", "lora"]
    while time.monotonic() < deadline:
        await asyncio.sleep(rng.expovariate(1 / 0.15))
        kind, first = first or rng.choice(kinds), None
        i = next(counter)
        t0 = time.monotonic()
        if kind == "lora":  # this server has no LoRA slots and no --lora-dir: refused, whatever the path
            code = OK
            try:
                await stub.LoadLora(pb.LoadLoraRequest(name="x" * rng.choice([1, 100_000]),
                                                       path=rng.choice(["/etc", "/root/.ssh", "/nonexistent"])),
                                    timeout=HOSTILE_S)
            except grpc.aio.AioRpcError as e:
                code = e.code()
            outcomes[(kind, code.name)] += 1
            assert code in {BAD, grpc.StatusCode.FAILED_PRECONDITION}, f"LoadLora: {code}"
            continue
        allowed = {"hostile": {BAD}, "cancel": {OK, grpc.StatusCode.CANCELLED}}.get(kind, {OK})
        if kind == "hostile2":
            request, allowed = _hostile2(rng, i)
            call = (raw if isinstance(request, bytes) else stub.Generate)(request, timeout=120)
        else:
            request = _request(kind, rng, i)
            call = stub.Generate(request, timeout=120)
        code, n = OK, 0
        try:
            async for m in call:
                n += len(m.token_ids)
                if kind == "cancel" and n >= 1:
                    call.cancel()
                    code = grpc.StatusCode.CANCELLED
                    break
                if kind == "abort" and n >= 1:
                    await stub.Abort(pb.AbortRequest(request_id=request.request_id), timeout=10)
        except grpc.aio.AioRpcError as e:
            code = e.code()
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
        outcomes[(kind, code.name)] += 1
        assert code in allowed, f"{kind} request {i}: {code} ({str(request)[:300]})"
        if kind == "hostile2":
            assert time.monotonic() - t0 < HOSTILE_S, f"hostile request {i} took {time.monotonic() - t0:.1f} s"


def _soak(llm, seconds: float) -> None:
    import itertools

    compiles = llm.stats()["num_compiles"]
    handle = serve(llm, port=0, max_queue=256, wait=True)
    rss: dict[str, int] = {}
    outcomes: collections.Counter = collections.Counter()
    try:
        async def run():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
                stub = pb_grpc.EngineStub(ch)
                raw = ch.unary_stream("/jphoton.v1.Engine/Generate", request_serializer=None,
                                      response_deserializer=pb.GenerateResponse.FromString)
                start = time.monotonic()
                counter = itertools.count()

                async def sample_rss():
                    await asyncio.sleep(seconds / 3 if seconds < 180 else 60)
                    rss["early"] = _rss_bytes()

                sampler = asyncio.create_task(sample_rss())
                await asyncio.gather(*(_client(stub, raw, random.Random(c), start + seconds, counter, outcomes,
                                               REQUIRED[c % len(REQUIRED)])
                                       for c in range(CLIENTS)))
                await sampler
                deadline = time.monotonic() + 60
                while True:
                    s = await stub.GetStats(pb.GetStatsRequest(), timeout=10)
                    if s.kv_pages_free + s.kv_pages_evictable == s.kv_pages_total and s.running == s.waiting == s.queued == 0:
                        return s
                    assert time.monotonic() < deadline, f"pages/requests not released: {s}"
                    await asyncio.sleep(0.05)

        s = asyncio.run(run())
        rss["end"] = _rss_bytes()
    finally:
        handle.stop(grace=5)
    print(f"soak {seconds:.0f} s: {sum(outcomes.values())} calls {dict(outcomes)}; RSS {rss['early'] / 2**20:.0f} -> "
          f"{rss['end'] / 2**20:.0f} MiB")
    assert s.num_compiles == compiles, "compiled while serving"
    # the mix really ran: several calls a client, even on a busy CPU (CI's 2 cores with the other pytest worker beside
    # it made 60 calls in 30 s once, 2026-11-27; the floor was 5 a client)
    assert sum(outcomes.values()) >= 4 * CLIENTS
    assert {k for k, _ in outcomes} >= set(REQUIRED)
    assert rss["end"] <= 1.10 * rss["early"], f"RSS grew {rss['end'] / rss['early'] - 1:.0%} after the first third"


def test_soak(embedded_llm):
    _soak(embedded_llm, float(os.environ.get("JPHOTON_SOAK_S", "30")))


@pytest.mark.soak_long
@pytest.mark.skipif(os.environ.get("JPHOTON_SOAK_LONG") != "1", reason="the long soak: JPHOTON_SOAK_LONG=1")
def test_soak_long(embedded_llm):
    _soak(embedded_llm, 600.0)
