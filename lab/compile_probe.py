"""Issue 22's first measurements: what one step shape costs to compile, and what the choices around it buy.

    python lab/compile_probe.py --model random:llama3.2-1b --serial 2 --parallel 8 --threads 8 --out $OUT/compile.json

For each layer loop (unrolled, scanned) of the default engine (`LLM(model, warmup=False)`, default buckets):
- serial: AOT `lower().compile()` of N step shapes one after the other (seconds per shape, lowering and compiling apart);
- parallel: M other shapes compiled by a pool of T threads (XLA compiles with the GIL released: does the wall time fall
  by T, or does something serialise them?);
- the device step at B=1 and B=32 (context 512) back to back, to price what unrolling buys per step.
No persistent cache (every compile is cold). Shapes are taken spread over the default set (decode-only and mixed).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JPHOTON_XLA_CACHE", "0")


def _compile(runner, shape) -> tuple[float, float]:
    slot = runner.slots[0]
    packed = runner.layout(shape).empty(runner.static.trash_page)["_buffer"]
    t0 = time.perf_counter()
    lowered = runner._step.lower(shape, runner.params, runner.kv, runner._prev_tokens, slot.tokens, slot.logits, packed)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    try:  # what the compiled program runs: copies of weight slices would show as copy / dynamic-slice kernels
        text = compiled.as_text()
        _HLO_COUNTS[shape] = {k: text.count(k) for k in (" copy(", "dynamic-slice(", "fusion(", "custom-call(", " call(")}
    except Exception as e:  # noqa: BLE001 (a probe: report, go on)
        _HLO_COUNTS[shape] = {"error": repr(e)}
    return t1 - t0, t2 - t1


_HLO_COUNTS: dict = {}


def probe(model: str, variant: str, serial: int, parallel: int, threads: int, rows: list[int]) -> dict:
    import jax

    from jphoton import LLM
    from jphoton.models import llama

    unroll = variant != "scanned"
    if variant == "unrolled-stacked":  # the layout before per-layer params: layer i sliced out of each stack
        from jphoton.weights import load

        make = load.random_params
        load.random_params = lambda *a, per_layer=False, **k: make(*a, per_layer=False, **k)
        llama.unstack_layers = lambda params, consume=False: params
    t0 = time.perf_counter()
    llm = LLM(model, warmup=False, progress=False, unroll_layers=unroll, freeze_gc=False)
    load_s = time.perf_counter() - t0
    runner = llm.engine.runner
    shapes = runner.sched.all_shapes()
    picked = shapes[:: max(1, len(shapes) // (serial + parallel))][: serial + parallel]
    out = {"variant": variant, "xla_flags": os.environ.get("XLA_FLAGS", ""), "unroll_layers": unroll,
           "num_shapes_default": len(shapes), "load_s": load_s,
           "serial": [], "parallel": {}}
    for shape in picked[:serial]:
        lower_s, compile_s = _compile(runner, shape)
        out["serial"].append({"shape": list(dataclasses.astuple(shape)), "lower_s": lower_s, "compile_s": compile_s,
                              "hlo_counts": _HLO_COUNTS.get(shape)})
        print(f"  unroll={unroll} serial {dataclasses.astuple(shape)}: lower {lower_s:.1f} s, "
              f"compile {compile_s:.1f} s, HLO {_HLO_COUNTS.get(shape)}", flush=True)
    rest = picked[serial:]
    if rest:
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            each = list(pool.map(lambda s: _compile(runner, s), rest))
        wall = time.perf_counter() - t0
        out["parallel"] = {"threads": threads, "shapes": len(rest), "wall_s": wall,
                           "sum_of_shapes_s": sum(a + b for a, b in each), "per_shape": each}
        print(f"  unroll={unroll} {len(rest)} shapes on {threads} threads: {wall:.1f} s wall "
              f"(sum of per-shape times {out['parallel']['sum_of_shapes_s']:.1f} s)", flush=True)
    out["device_step_ms"], out["dispatch_ms"] = {}, {}
    out["argument_leaves"] = len(jax.tree.leaves(runner.params)) + len(jax.tree.leaves(runner.kv)) + 4
    calls: list[float] = []  # host seconds per jitted-step call (what the pipelined tick pays per step)
    dispatch = runner._dispatch_into

    def timed(*a, **k):
        t = time.perf_counter()
        dispatch(*a, **k)
        calls.append(time.perf_counter() - t)

    runner._dispatch_into = timed
    for b in rows:
        t0 = time.perf_counter()
        calls.clear()
        out["device_step_ms"][b] = llm.device_step_ms(b, context=512, steps=50)
        out["dispatch_ms"][b] = statistics.median(calls[3:]) * 1e3
        print(f"  unroll={unroll} B={b}: {out['device_step_ms'][b]:.3f} ms/step, dispatch "
              f"{out['dispatch_ms'][b]:.3f} ms a call, {out['argument_leaves']} argument buffers "
              f"(compile + time {time.perf_counter() - t0:.1f} s)", flush=True)
    del llm
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--serial", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--unroll", nargs="+", default=["scanned", "unrolled"],
                    choices=["scanned", "unrolled", "unrolled-stacked"],
                    help="unrolled: per-layer params (the engine's layout); unrolled-stacked: the stacked layout "
                         "sliced per layer (before issue 22). Run one per process for cold in-process caches.")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import jax

    result = {"model": args.model, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    for name in args.unroll:
        result["runs"].append(probe(args.model, name, args.serial, args.parallel, args.threads,
                                    args.rows))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
