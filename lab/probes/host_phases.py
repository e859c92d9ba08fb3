"""Where a pipelined decode tick's host time goes, function by function (issue 22: the tick is host-bound at B=64 on
some H100 hosts). The ab_trees B=64 engine (random 1B, 8k context); each phase (scheduler plan, pack, launch, commit)
timed in the loop, then profiled with cProfile in a second pass. Prints the medians and each phase's top functions.

    python3 lab/probes/host_phases.py [--model random:llama3.2-1b] [--rows 64]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import statistics
import time

from jphoton import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    B = args.rows
    llm = LLM(args.model, pipeline_depth=2, max_model_len=8192, max_num_seqs=64, decode_buckets=(1, 64),
              prefill_buckets=((1, 512), (32, 128)), max_num_batched_tokens=32 * 128 + 64,
              num_kv_pages=64 * 24 + 400, warmup=False, progress=False)
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 500 + 1 for j in range(128)]} for i in range(B)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, params)
    eng = llm.engine
    targets = {"plan": (eng.scheduler, "plan"), "pack": (eng.runner, "pack"), "launch": (eng.runner, "launch"),
               "commit": (eng, "_commit"), "dispatch": (eng.runner, "_dispatch_into")}
    originals = {k: getattr(o, n) for k, (o, n) in targets.items()}
    times: dict[str, list[float]] = {k: [] for k in targets}

    def timed(name, fn):
        def f(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            times[name].append(time.perf_counter() - t)
            return r
        return f

    for k, (o, n) in targets.items():
        setattr(o, n, timed(k, originals[k]))
    llm.generate(prompts, params)
    print({k: round(statistics.median(v) * 1e3, 3) for k, v in times.items() if v}, "ms (median)")
    profiles = {k: cProfile.Profile() for k in targets if k != "dispatch"}
    for k, pr in profiles.items():
        o, n = targets[k]
        setattr(o, n, functools.partial(pr.runcall, originals[k]))
    llm.generate(prompts, params)
    transfer_cost(llm, B)
    for k, pr in profiles.items():
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(10)
        print(f"==== {k}\n" + "\n".join(line for line in s.getvalue().splitlines()[6:] if line.strip()))


def transfer_cost(llm, rows: int) -> None:
    """Host ms a decode step's dispatch takes with its packed input as a host array (the call transfers it) vs already on
    the device, and a separate `jax.device_put` of it: what the packed input's size costs the tick."""
    import jax
    import numpy as np

    from jphoton.engine.scheduler import StepShape

    r = llm.engine.runner
    shape = StepShape(min(b for b in r.sched.decode_buckets if b >= rows), 0, 0, 0)
    host = r.layout(shape).empty(r.static.trash_page)["_buffer"]
    out = {"packed_words": int(host.size)}
    for name, make in (("host", lambda: host.copy()), ("device", lambda: jax.device_put(host))):
        ts = []
        for i in range(120):
            packed = make()
            jax.block_until_ready(packed) if name == "device" else None
            t = time.perf_counter()
            r._dispatch_into(r._take_slot(), shape, packed)
            ts.append(time.perf_counter() - t)
            if i % 10 == 9:
                jax.block_until_ready(r.kv)
        out[f"dispatch_{name}_ms"] = round(statistics.median(ts[10:]) * 1e3, 3)
    for words in (4096, 16384, host.size, 4 * host.size):
        a = np.zeros(words, np.int32)
        ts = []
        for _ in range(100):
            t = time.perf_counter()
            jax.device_put(a)
            ts.append(time.perf_counter() - t)
        out[f"device_put_{words}_ms"] = round(statistics.median(ts[10:]) * 1e3, 3)
    jax.block_until_ready(r.kv)
    print(out)


if __name__ == "__main__":
    main()
