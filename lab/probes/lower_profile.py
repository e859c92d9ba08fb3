"""Where a step shape's trace + lowering (`Runner.lower_step`, Python, holds the GIL) spends its time (issue 22).
    python lab/probes/lower_profile.py [model] [--top N]
Builds the default engine without warm-up, lowers a decode-only and a mixed shape twice each (the second time shows
what JAX caches across shapes), and prints cProfile's top functions by own time and by cumulative time."""

import argparse
import cProfile
import io
import json
import pstats
import time

from jphoton import LLM

ap = argparse.ArgumentParser()
ap.add_argument("model", nargs="?", default="random:llama3.2-1b")
ap.add_argument("--top", type=int, default=30)
args = ap.parse_args()
llm = LLM(args.model, warmup="off", progress=False)
runner = llm.engine.runner
shapes = runner.sched.all_shapes()
decode = max((s for s in shapes if not s.prefill_rows), key=lambda s: s.decode_rows)
mixed = max((s for s in shapes if s.prefill_rows and s.decode_rows), key=lambda s: s.tokens)
times = {}
prof = cProfile.Profile()
for name, shape in (("decode", decode), ("mixed", mixed), ("decode_again", decode), ("mixed_again", mixed)):
    t = time.perf_counter()
    prof.enable()
    runner.lower_step(shape)
    prof.disable()
    times[name] = round(time.perf_counter() - t, 3)
print(json.dumps({"model": args.model, "decode": str(decode), "mixed": str(mixed), "lower_s": times}))
stats = pstats.Stats(prof)
by_module: dict = {}
for (file, _, _), (_, _, tottime, _, _) in stats.stats.items():  # own time, summed by module (jax/_src/<x>/...)
    parts = file.split("/")
    key = "/".join(parts[parts.index("_src"):][:3]) if "_src" in parts else "/".join(parts[-2:])
    by_module[key] = by_module.get(key, 0.0) + tottime
print(json.dumps({k: round(v, 3) for k, v in sorted(by_module.items(), key=lambda kv: -kv[1])[:args.top]}, indent=0))
for key in ("tottime", "cumulative"):
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
    print(out.getvalue()[-12000:])
