"""`jphoton serve --frontends 2`: two gRPC processes on one port (SO_REUSEPORT), each with its own pipe pair to the
one engine process (jphoton/server/app.py, jphoton/server/engine_process.py). Streams equal LLM.generate whichever frontend a
connection lands on, Abort finds a stream that lives on the other frontend, cancels free every page, GetStats and
/metrics add both frontends up, and stopping ends every process with exit code 0."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from jphoton import LLM, SamplingParams
from jphoton.server import jphoton_pb2 as pb
from jphoton.server import jphoton_pb2_grpc as pb_grpc
from jphoton.server.app import serve
from jphoton.server.engine_process import TWO_FRONTENDS_MIN_CPUS, Spawn, default_frontends

from conftest import ENGINE_ARGS, FIXTURES

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
NEW = 8
CHANNELS = 16
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # else the channels of a process share one connection


def test_jphoton_serve_runs_two_frontends_on_a_host_with_the_cores():
    """`jphoton serve` without --frontends: one process per event loop, two where the CPUs allow (the CLI's default)."""
    assert [default_frontends(n) for n in (1, 2, TWO_FRONTENDS_MIN_CPUS - 1, TWO_FRONTENDS_MIN_CPUS, 128)] == [1, 1, 1, 2, 2]
    assert default_frontends() == default_frontends(len(os.sched_getaffinity(0)))
    from jphoton.cli import build_parser

    assert build_parser().parse_args(["serve", "--model", "x"]).frontends is None  # resolved by default_frontends
    assert build_parser().parse_args(["serve", "--model", "x", "--frontends", "1"]).frontends == 1


@pytest.fixture(scope="module")
def two_frontends(embedded_llm):
    refs = embedded_llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0))
    build = functools.partial(LLM, None, dtype="float32", freeze_gc=False, warmup="full", **ENGINE_ARGS)
    handle = serve(Spawn(build), port=0, max_queue=64, wait=True, frontends=2)
    channels = [grpc.insecure_channel(f"127.0.0.1:{handle.port}", options=OWN_CONNECTION) for _ in range(CHANNELS)]
    yield handle, [pb_grpc.EngineStub(ch) for ch in channels], refs
    for ch in channels:
        ch.close()
    handle.stop(grace=5)


def _greedy(text: str, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=NEW, temperature=0, **kw))


def test_streams_over_both_frontends_equal_llm_generate(two_frontends):
    handle, stubs, refs = two_frontends
    before = handle.server.servicer.calls
    # the connections' streams at once (CI time: batched, not one after another); each connection one stream
    with concurrent.futures.ThreadPoolExecutor(CHANNELS) as pool:
        got = list(pool.map(lambda i: list(stubs[i].Generate(_greedy(PROMPTS[i % 4]), timeout=60)), range(CHANNELS)))
    assert len(got) == len(stubs) == CHANNELS
    for i, msgs in enumerate(got):
        assert [t for m in msgs for t in m.token_ids] == refs[i % 4].token_ids
        assert "".join(m.text for m in msgs) == refs[i % 4].text
    here = handle.server.servicer.calls - before  # the first frontend's share; the rest went to the other process
    assert 0 < here < CHANNELS, f"{here} of {CHANNELS} connections on the first frontend"
    assert handle.server.admission.capacity == 32  # max_queue split between the two


def test_abort_reaches_a_stream_on_the_other_frontend_and_pages_come_back(two_frontends):
    handle, stubs, _ = two_frontends
    compiles = stubs[0].GetStats(pb.GetStatsRequest(), timeout=10).num_compiles
    call = stubs[0].Generate(pb.GenerateRequest(text=PROMPTS[0], request_id="long", sampling=pb.SamplingParams(
        max_tokens=2000, temperature=0, ignore_eos=True)), timeout=120)
    next(call)
    # GetStats' `queued` counts the answering frontend's open calls: 0 on the frontend that does not hold the stream
    other = next(s for s in stubs[1:] if s.GetStats(pb.GetStatsRequest(), timeout=10).queued == 0)
    assert other.Abort(pb.AbortRequest(request_id="long"), timeout=10).found
    assert [m.finish_reason for m in call][-1] == "abort"
    assert not other.Abort(pb.AbortRequest(request_id="no-such-request"), timeout=10).found

    async def cancels():  # 24 streams (3x the engine's 8 rows) over 8 connections, every third cancelled by its client
        chs = [grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}", options=OWN_CONNECTION) for _ in range(8)]

        async def one(i):
            call = pb_grpc.EngineStub(chs[i % 8]).Generate(pb.GenerateRequest(
                text=PROMPTS[i % 4], sampling=pb.SamplingParams(max_tokens=24, temperature=0.8, seed=i,
                                                                ignore_eos=True)), timeout=120)
            async for m in call:
                if i % 3 == 0 and m.token_ids:
                    call.cancel()
                    return "cancelled"
                if m.finish_reason:
                    return m.finish_reason

        try:
            return await asyncio.gather(*(one(i) for i in range(3 * ENGINE_ARGS["max_num_seqs"])))
        finally:
            for ch in chs:
                await ch.close()

    reasons = asyncio.run(cancels())
    assert reasons.count("cancelled") == 8 and reasons.count("length") == 16
    deadline = time.monotonic() + 30
    while True:
        s = stubs[0].GetStats(pb.GetStatsRequest(), timeout=10)
        if s.kv_pages_free + s.kv_pages_evictable == s.kv_pages_total and s.running == s.waiting == 0:
            break
        assert time.monotonic() < deadline, f"pages not released: {s}"
        time.sleep(0.05)
    assert s.num_compiles == compiles


def test_stop_ends_every_process_cleanly(two_frontends, caplog):
    handle, _, _ = two_frontends
    engine = handle.server.servicer.engine
    frontends = list(handle.server._frontend_procs)
    handle.stop(grace=5)
    assert [p.exitcode for p in frontends] == [0]
    assert engine._proc.exitcode == 0
    assert "did not exit" not in caplog.text


def test_jphoton_serve_frontends_sum_their_metrics(tmp_path):
    """The CLI sets PROMETHEUS_MULTIPROC_DIR before prometheus_client is imported: one /metrics for both frontends."""
    proc = subprocess.Popen([sys.executable, "-m", "jphoton", "serve", "--model", str(FIXTURES / "tiny" / "llama3"),
                             "--port", "0", "--frontends", "2", "--metrics-port", "0", "--max-num-seqs", "2",
                             "--max-model-len", "128", "--grace", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        address = metrics = None
        for line in proc.stdout:
            if m := re.search(r"gRPC on (\S+) .*metrics on (\S+)", line):
                address, metrics = m.group(1), m.group(2)
            if "jphoton: SERVING" in line:
                break
        assert address and metrics, "no startup line"
        with grpc.insecure_channel(address) as ch:
            shapes_at_start = pb_grpc.EngineStub(ch).GetStats(pb.GetStatsRequest(), timeout=10).shapes_compiled
        for _ in range(8):
            with grpc.insecure_channel(address, options=OWN_CONNECTION) as ch:
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParams(
                    max_tokens=4, temperature=0, ignore_eos=True))
                assert sum(len(m.token_ids) for m in pb_grpc.EngineStub(ch).Generate(req, timeout=60)) == 4
        # The engine child's background warm-up imports tqdm (a semaphore, checked below): wait until it has
        # compiled a shape, not for all of them (CI time: ~25 s more here); SIGTERM then comes mid-warm-up
        with grpc.insecure_channel(address) as ch:
            deadline = time.monotonic() + 120
            while True:
                s = pb_grpc.EngineStub(ch).GetStats(pb.GetStatsRequest(), timeout=10)
                if s.all_shapes_ready or s.shapes_compiled > shapes_at_start:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.2)
        text = urllib.request.urlopen(metrics, timeout=10).read().decode()
        assert re.search(r'jphoton_requests_total\{code="OK",finish_reason="length"\} 8\.0', text), text
        assert re.search(r"jphoton_generation_tokens_total 32\.0", text)
        assert "jphoton_kv_pages_free" in text
        assert list(tmp_path.glob("jphoton-metrics-*"))  # the frontends' value files
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, rest
    assert not list(tmp_path.glob("jphoton-metrics-*")) and "did not exit" not in rest
    assert "leaked semaphore" not in rest  # the engine child runs multiprocessing's exit hooks before os._exit


def test_a_taken_port_fails_with_two_frontends_too(capsys):
    """The frontends bind with SO_REUSEPORT, which would share a port with another server that did too (another
    `jphoton serve --frontends 2`): the port is bound plainly first."""
    import socket

    from jphoton.cli import main

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--port", str(port), "--frontends", "2"]) == 2
    err = capsys.readouterr().err
    assert "jphoton: error: cannot bind" in err and "Traceback" not in err
