"""Host cost of dispatching the engine's own decode step while the GPU is busy, the way the pipelined loop does it.

Why: on the H100 host a step's launch took 0.55 ms with a host input and ~1.0 ms with the input a grammar sampler
had just produced (RESULTS.md, constrained re-run of 2026-11-23), and the masked sampler's dispatch 0.57 ms: two such
dispatches per grammar step, one per free step, and at B=1 the loop's host time is as long as the device step. This
probe separates the parts, with the GPU kept busy by the steps queued before each timed call:

  step(host input)        the jitted step, packed input as a numpy array (one host->device copy in the call)
  step(device input)      the same, input already on the device
  sampler                 the masked sampler (bitmask + sampler fields + carrier of the next input: one copy)
  step(carried input)     the step, input = the carrier the sampler just wrote (the step after a grammar step)
  step(after sampler)     the step after a sampler, input a device array computed long before (only the tokens come
                          from the sampler)
  worker                  that same dependent step dispatched from a second thread while the main thread runs ~1 ms
                          of pure Python: the main thread's slowdown says whether the call holds the GIL while it
                          waits (if not, a dispatcher thread would hide the wait behind the commit's Python work)

(On 2026-11-23 17:30 the sampler returned its carrier as a new array each time, and the step that took it cost ~1 ms
more host time than one on a device input; the carrier is now one donated persistent buffer. RESULTS.md.)

and the device time of a step back to back. Run once per XLA_FLAGS setting (gpu_suite.sh section probe-dispatch),
since how XLA launches the step's ~100-400 kernels (one by one or as a CUDA graph) is what the host pays for.

    python lab/probes/dispatch_cost.py --model random:llama3.2-1b --rows 1 32 --out DIR --tag default
    python lab/probes/dispatch_cost.py --smoke      # tiny model on the CPU: checks the plumbing
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from benchmarks.common import device_info, write_json  # noqa: E402
from jphoton import LLM  # noqa: E402
from jphoton.engine.step import StepShape  # noqa: E402
from lab.common import decode_step_input, steps_back_to_back  # noqa: E402


def _step(runner, shape, packed):
    """One step into the next slot, as Runner._dispatch_into does; returns the host seconds the call took."""
    slot = runner.slots[runner._next_slot]
    t0 = time.perf_counter()
    slot.tokens, slot.logits, runner.kv = runner._step(shape, runner.params, runner.kv, runner._prev_tokens,
                                                       slot.tokens, slot.logits, packed)
    dt = time.perf_counter() - t0
    runner._prev_tokens = slot.tokens
    runner._next_slot ^= 1
    return slot, dt


def _sampler(runner, slot, inp):
    """The masked sampler on the step just dispatched (Runner._resample_into); (carrier, host seconds)."""
    t0 = time.perf_counter()
    slot.tokens, slot.logprobs, slot.top_ids, runner.carrier = runner._resample(
        *inp.variant, slot.logits, slot.tokens, slot.logprobs, slot.top_ids, runner.carrier, inp.buffer)
    dt = time.perf_counter() - t0
    runner._prev_tokens = slot.tokens
    return runner.carrier, dt


def _python_work(n: int) -> int:
    x = 0
    for i in range(n):
        x += i & 7
    return x


def _python_seconds(n: int) -> float:
    t0 = time.perf_counter()
    _python_work(n)
    return time.perf_counter() - t0


def measure(runner, shape, context: int, reps: int) -> dict:
    dev = decode_step_input(runner, shape, context)
    host = np.asarray(jax.device_get(dev))
    inp = runner._sampler_input((False, 0, True))
    inp.carrier[:] = host
    steps_back_to_back(runner, shape, dev, 3)  # compile + warm
    slot, _ = _step(runner, shape, host)
    carried, _ = _sampler(runner, slot, inp)
    _step(runner, shape, carried)
    jax.block_until_ready(runner.kv)
    device_ms = 1e3 * steps_back_to_back(runner, shape, dev, reps)
    out: dict[str, list[float]] = {"step_host_input": [], "step_device_input": [], "sampler": [],
                                   "step_carried_input": [], "step_after_sampler": [], "worker_call": [],
                                   "main_python_alone": [], "main_python_beside_worker": []}
    n = 20_000
    while _python_seconds(n) < 1e-3:  # ~1 ms of pure Python on this host
        n *= 2
    pool = concurrent.futures.ThreadPoolExecutor(1)
    for _ in range(reps):
        for _ in range(4):  # keep the GPU busy: the timed calls below queue behind these
            _step(runner, shape, dev)
        _, t = _step(runner, shape, host)
        out["step_host_input"].append(t)
        slot, t = _step(runner, shape, dev)
        out["step_device_input"].append(t)
        carried, t = _sampler(runner, slot, inp)
        out["sampler"].append(t)
        slot, t = _step(runner, shape, carried)
        out["step_carried_input"].append(t)
        carried, _ = _sampler(runner, slot, inp)
        _, t = _step(runner, shape, dev)
        out["step_after_sampler"].append(t)
        jax.block_until_ready(runner.kv)
        for _ in range(4):
            _step(runner, shape, dev)
        slot, _ = _step(runner, shape, dev)
        _sampler(runner, slot, inp)
        job = pool.submit(_step, runner, shape, dev)
        out["main_python_beside_worker"].append(_python_seconds(n))
        out["worker_call"].append(job.result()[1])
        out["main_python_alone"].append(_python_seconds(n))
        jax.block_until_ready(runner.kv)
    return {"rows": shape.decode_rows, "device_step_ms": device_ms,
            **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in out.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--ctx", type=int, default=512, help="tokens of context per row")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--tag", default="default", help="names the XLA_FLAGS setting in the output")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.rows, args.ctx, args.reps = "random:llama3.2-1b:layers=2:vocab=512", [1, 2], 32, 3
    info = {**device_info(), "xla_flags": os.environ.get("XLA_FLAGS", ""), "tag": args.tag}
    print(info, flush=True)
    pages = -(-args.ctx // 16)
    B = max(args.rows)
    llm = LLM(args.model, max_model_len=pages * 16 + 16, max_num_seqs=B, decode_buckets=tuple(sorted(args.rows)),
              prefill_buckets=((1, 32),), warmup=False, num_kv_pages=B * pages + 8,
              progress=False)
    runner = llm.engine.runner
    rows = []
    for b in args.rows:
        shape = StepShape(b, 0, 0, 0)  # Pallas (GPU) or dynamic (CPU) attention: no context bucket
        runner.layout(shape)
        r = measure(runner, shape, args.ctx, args.reps)
        rows.append(r)
        print(f"[{args.tag}] B={b}: device step {r['device_step_ms']:.3f} ms; host per call: step(host input) "
              f"{r['step_host_input_ms']:.3f}, step(device input) {r['step_device_input_ms']:.3f}, sampler "
              f"{r['sampler_ms']:.3f}, step(carried input) {r['step_carried_input_ms']:.3f}, step(after sampler) "
              f"{r['step_after_sampler_ms']:.3f} ms; on a worker thread {r['worker_call_ms']:.3f} ms while the main "
              f"thread's ~1 ms of Python took {r['main_python_beside_worker_ms']:.3f} ms (alone "
              f"{r['main_python_alone_ms']:.3f})", flush=True)
    if args.out:
        write_json(f"{args.out}/dispatch-{args.tag}.json", {"info": info, "model": args.model, "rows": rows})


if __name__ == "__main__":
    main()
