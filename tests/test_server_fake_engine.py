"""The gRPC servicer against stand-in engines: a request that fails mid-flight, and outputs that arrive in bursts and
go out coalesced (split from test_server.py, whose tests share one served LLM)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from jphoton import SamplingParams
from jphoton.server import jphoton_pb2 as pb
from jphoton.server import jphoton_pb2_grpc as pb_grpc
from jphoton.server.app import Server, ServerThread

PROMPT = "def fibonacci(n):"
STREAM_PARAMS = SamplingParams(max_tokens=12, temperature=0, stop=["\n\n"])


# ---- mid-flight failure (fake engine: a correct mask never lets the matcher fail) -----------------------------------
class _FakeEngine:
    """Stands in for AsyncLLM: one token, then the request fails as a rejecting grammar matcher makes it fail."""

    def __init__(self):
        self.aborted = []

    def submit(self, prompt, params):
        from jphoton.sequence import Delta, RequestOutput

        q = asyncio.Queue()
        q.put_nowait(RequestOutput(0, Delta([7], "x"), None, 3, 1))
        q.put_nowait(RequestOutput(0, Delta([], "", "error"), None, 3, 1, "the grammar rejected token 9"))
        return 0, q

    def abort(self, request_id):
        self.aborted.append(request_id)

    def stats(self):
        return {"num_compiles": 0, "shapes_compiled": 0, "shapes_total": 0}

    info = {"name": "fake"}

    def has_unfinished_requests(self):
        return False

    def shutdown(self):
        pass


def test_a_mid_flight_failure_is_aborted_after_the_tokens_so_far():
    server = Server(port=0)
    fake = _FakeEngine()
    server.servicer.attach = lambda llm: setattr(server.servicer, "engine", fake) or setattr(
        server.servicer, "llm", llm)
    stats = {"num_compiles": 0, "shapes_compiled": 0, "shapes_total": 0}
    llm = type("FakeLLM", (), {"model": type("M", (), {"name": "fake"})(), "stats": lambda self: stats,
                               "has_unfinished_requests": lambda self: False})()
    handle = ServerThread(server).start(llm)
    handle.wait_ready(30)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            call = pb_grpc.EngineStub(ch).Generate(pb.GenerateRequest(text="hi"), timeout=30)
            got = []
            with pytest.raises(grpc.RpcError) as e:
                for m in call:
                    got.append(m)
            assert e.value.code() == grpc.StatusCode.ABORTED
            assert "grammar rejected token 9" in e.value.details()
            assert [t for m in got for t in m.token_ids] == [7] and got[-1].finish_reason == "error"
            assert fake.aborted == []  # it finished; nothing to abort
    finally:
        handle.stop(grace=1)


class _BurstEngine(_FakeEngine):
    """Replays a real request's deltas in bursts (3 at once, then one by one), as a busy server sees them queue up."""

    def __init__(self, deltas):
        super().__init__()
        self.deltas = deltas

    def submit(self, prompt, params):
        from jphoton.sequence import RequestOutput

        q = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for i, d in enumerate(self.deltas):
            out = RequestOutput(0, d, None, 5, i + 1)
            loop.call_later(0 if i < 3 else 0.01 * i, q.put_nowait, out)
        return 0, q


def test_coalesced_messages_carry_exactly_the_streamed_text(embedded_llm):
    """Outputs that queue while the stream is busy go out as one message: the concatenated text and tokens still equal
    LLM's own stream, held-back stop-string text included."""
    deltas = list(embedded_llm.stream(PROMPT, STREAM_PARAMS))
    ref = embedded_llm.generate(PROMPT, STREAM_PARAMS)[0]
    server = Server(port=0)
    server.servicer.attach = lambda llm: setattr(server.servicer, "engine", _BurstEngine(deltas))
    handle = ServerThread(server).start(object())
    handle.wait_ready(30)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            msgs = list(pb_grpc.EngineStub(ch).Generate(pb.GenerateRequest(text="hi"), timeout=30))
    finally:
        handle.stop(grace=1)
    assert len(msgs) < len(deltas) and max(len(m.token_ids) for m in msgs) > 1  # some were merged
    assert [t for m in msgs for t in m.token_ids] == ref.token_ids
    assert "".join(m.text for m in msgs) == ref.text
    assert msgs[-1].finish_reason == ref.finish_reason


@pytest.mark.parametrize("rate", [0.0, 1000.0])
def test_streams_past_the_message_rate_get_a_message_every_few_ticks(rate):
    """EngineProcess paces started streams once their tokens come faster than max_message_rate a second (here: ticks
    microseconds apart, so at the most, MAX_PACE): each stream's outputs then reach its queue every MAX_PACE ticks,
    spread over the ticks, while first tokens and finishes go at once and nothing is lost or reordered. rate 0: every
    tick."""
    import multiprocessing as mp

    from jphoton.server.engine_process import MAX_PACE, EngineLink, EngineProcess

    ends = mp.Pipe(duplex=False), mp.Pipe(duplex=False)
    proc = EngineProcess(link=EngineLink(0, 1, ends[0][1], ends[1][0]), max_message_rate=rate)
    streams, ticks = 16, 12
    for rid in range(streams):
        proc._sinks[rid] = asyncio.Queue()
    woken = []  # per tick: the streams whose queue got something
    for t in range(ticks):
        last = t == ticks - 1
        before = [proc._sinks[r].qsize() if r in proc._sinks else None for r in range(streams)]
        queues = dict(proc._sinks)
        skip = t in (5, 6)  # stream 0 gets no token (e.g. preempted): what it had held goes out at once
        proc._dispatch([("out", rid, [100 * rid + t], f"<{t}>", "length" if last else None, None, 3, t + 1, None, None)
                        for rid in range(streams) if not (skip and rid == 0)])
        woken.append({r for r in range(streams) if queues[r].qsize() != before[r]})
        if skip and t == 5:
            assert not (rate and 0 in proc._held)
    assert woken[0] == set(range(streams)) and woken[-1] == set(range(streams))  # first tokens, finishes
    for t in range(1, ticks - 1):
        if rate:  # a quarter of the streams each tick, taking turns
            turns = {r for r in range(streams) if (t + 1 + r) % MAX_PACE == 0} - ({0} if t in (5, 6) else set())
            assert woken[t] == turns | ({0} if t == 5 else set())  # stream 0's held token 4 goes out when it has none
        else:
            assert woken[t] == set(range(streams)) - ({0} if t in (5, 6) else set())
    for rid, q in queues.items():
        outs = [q.get_nowait() for _ in range(q.qsize())]
        sent = [t for t in range(ticks) if not (rid == 0 and t in (5, 6))]
        assert [tok for o in outs for tok in o.delta.token_ids] == [100 * rid + t for t in sent]
        assert "".join(o.delta.text for o in outs) == "".join(f"<{t}>" for t in sent)
        assert outs[-1].delta.finish_reason == "length"
    assert not proc._held and not proc._started and not proc._sinks
