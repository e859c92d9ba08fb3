"""The engine's host work per tick with no device at all (issue 23: at 32-64 rows the tick is host-bound on the H200,
and this box's Python runs the plan and commit about as fast as the H200 host's). The real Engine, scheduler, pages,
packer and sequences; a fake runner whose launch packs nothing extra and whose fetch returns token 1 for every row.
Static: C requests at once; staggered: C closed-loop clients, one new request as each finishes, starts spread over one
request (as benchmarks/serving.py engine_staggered). Prints median host us per tick by phase (plan incl. pack, launch,
commit, whole tick) and per step kind, for A/B of host-side changes on the CPU box.

    python lab/probes/host_sim.py --concurrency 64 [--ticks 3000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from jphoton.engine import pipeline  # noqa: E402
from jphoton.engine.config import EngineConfig  # noqa: E402
from jphoton.engine.packing import StepPacker  # noqa: E402
from jphoton.engine.slots import StepResult  # noqa: E402
from jphoton.engine.step import StepLayout, StepStatic  # noqa: E402
from jphoton.params import SamplingParams  # noqa: E402
from jphoton.sequence import Sequence  # noqa: E402


class _Slot:
    def __init__(self):
        self.step, self.awaiting_mask, self.sampler = None, False, None


class FakeRunner:
    """What Engine needs of a Runner, with no device: real packing, no dispatch, every sampled token is 1."""

    def __init__(self, model, config: EngineConfig, num_pages: int):
        sched = config.scheduler_config()
        pages_per_seq = -(-config.max_model_len // config.page_size)
        pages_per_seq = -(-pages_per_seq // 8) * 8
        max_rows = max(sched.decode_buckets) + max(r for r, _ in sched.prefill_buckets)
        self.static = StepStatic(pages_per_seq=pages_per_seq, page_size=config.page_size, pages_per_block=8,
                                 trash_page=num_pages, max_rows=max_rows, sliding_window=None,
                                 pallas_attention=True, lora_slots=0, lora_rank=0)
        size = max(StepLayout(s, self.static).size for s in sched.all_shapes())
        self.packer = StepPacker(self.static, size, False)
        self.automaton_states = 0
        self.input_transfers = 0
        self.vision = None  # a text model: no image encoder
        self.tokens = [1] * max_rows
        self.device_call = None
        self.pollute: np.ndarray | None = None

    def pack(self, plan, automata=False):
        return self.packer.pack(plan, automata)

    def has_filtered_variant(self, plan):
        return True

    def launch(self, step, defer_sampling=False):
        slot = _Slot()
        slot.step = step
        if self.device_call is not None:
            slot.out = self.device_call(step.input.packed)
            slot.out.copy_to_host_async()
        if self.pollute is not None:  # touch every cache line of a buffer, as a dispatch's C++ work might
            self.pollute += 1
        return slot

    def fetch(self, slot):
        slot.step = None
        if self.device_call is not None:
            np.asarray(slot.out)
        return StepResult(self.tokens, None, None)


def device_call(leaves: int, spin: int):
    """A jitted call shaped like the engine's step on the host side (`leaves` argument buffers plus the packed host
    input, a token vector out) whose device work is `spin` dependent tiny matmuls: the jax dispatch without the model."""
    import jax
    import jax.numpy as jnp

    params = [jnp.full((8, 8), i, jnp.float32) for i in range(leaves)]

    @jax.jit
    def f(params, packed):
        x = params[0] + packed[:64].astype(jnp.float32).sum()
        for _ in range(spin):
            x = jnp.tanh(x @ params[1])
        return jnp.zeros((64,), jnp.int32) + x[0, 0].astype(jnp.int32)

    return lambda packed: f(params, packed)


def build(c: int, prompt_len: int, new_tokens: int) -> pipeline.Engine:
    config = EngineConfig(max_model_len=1024).resolve_kernels("gpu").resolve_shapes(8192)  # the default engine
    real, pipeline.Runner = pipeline.Runner, FakeRunner
    try:
        pages = c * -(-(prompt_len + new_tokens) // config.page_size) + 64
        return pipeline.Engine(None, config, pages)
    finally:
        pipeline.Runner = real


def run(c: int, prompt_len: int, new_tokens: int, staggered: bool, requests_per_client: int, call=None,
        pollute_mb: float = 0) -> dict:
    eng = build(c, prompt_len, new_tokens)
    eng.runner.device_call = call
    if pollute_mb:
        eng.runner.pollute = np.zeros(int(pollute_mb * 2**20) // 8, np.int64)
    rng = random.Random(1)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    next_id = iter(range(10**9))

    def new():
        ids = [rng.randrange(1, 30000) for _ in range(prompt_len)]
        return Sequence(next(next_id), ids, params, tokenizer=None, eos_token_ids=(), max_model_len=1024,
                        seed=rng.randrange(2**62))

    left = {i: requests_per_client for i in range(c)}
    owner = {}
    start_at = [0 if not staggered else int(i * new_tokens / c) for i in range(c)]
    tick = 0
    ticks = []
    while True:
        for i in range(c):
            if start_at[i] == tick and left[i]:
                s = new()
                owner[s.request_id] = i
                left[i] -= 1
                eng.add(s)
        if not eng.has_work():
            break
        t0 = time.perf_counter()
        outs = eng.step()
        t1 = time.perf_counter()
        for o in outs:
            if o.finished:
                i = owner.pop(o.request_id)
                if left[i]:
                    s = new()
                    owner[s.request_id] = i
                    left[i] -= 1
                    eng.add(s)
        ticks.append((t1 - t0, time.perf_counter() - t1))
        tick += 1
    recs = eng.telemetry.records
    out = {}
    for kind in ("decode", "mixed"):
        rs = [r for r in recs if r.kind == kind]
        if not rs:
            continue
        out[kind] = {"n": len(rs), **{k: round(1e6 * statistics.median(f(r) for r in rs), 1) for k, f in {
            "plan_us": lambda r: r.t_planned - r.t_plan, "launch_us": lambda r: r.t_launched - r.t_launch,
            "commit_us": lambda r: r.t_committed - r.t_ready}.items()}}
    out["tick_us"] = round(1e6 * statistics.fmean(a for a, _ in ticks), 1)
    out["driver_us"] = round(1e6 * statistics.fmean(b for _, b in ticks), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device-call", type=int, nargs=2, default=None, metavar=("LEAVES", "SPIN"),
                    help="each launch makes a jitted device call with LEAVES argument buffers and SPIN tiny matmuls")
    ap.add_argument("--pollute-mb", type=float, default=0, help="each launch also rewrites a buffer of this many MiB")
    ap.add_argument("--pin", type=int, default=None, help="pin this thread to this CPU after jax started its threads")
    args = ap.parse_args()
    call = device_call(*args.device_call) if args.device_call else None
    if call is not None:
        call(np.zeros(100_000, np.int32)).block_until_ready()
    if args.pin is not None:
        import os

        os.sched_setaffinity(0, {args.pin})
    for name, stag, rpc in (("static", False, 1), ("staggered", True, args.requests_per_client)):
        best = None
        for _ in range(args.rounds):
            r = run(args.concurrency, args.prompt_len, args.new_tokens, stag, rpc, call, args.pollute_mb)
            best = r if best is None or r["tick_us"] < best["tick_us"] else best
        print(json.dumps({"scenario": name, "C": args.concurrency, "device_call": args.device_call, "pin": args.pin,
                          "pollute_mb": args.pollute_mb, **best}))


if __name__ == "__main__":
    main()
