"""The device memory each of an engine's programs needs (XLA's memory analysis of the compiled program: arguments,
outputs, temporaries), one line per program: the vision step at each crop bucket and every step shape, compiled one at
a time (a program whose temporaries overflow the memory left beside the weights and the KV pool makes XLA warn "Can't
reduce memory use below ..." without naming it; this names it).

    python lab/probes/program_memory.py --model random:moondream2 [--options '{"max_num_seqs": 64}'] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from jphoton import LLM  # noqa: E402


def gib(n) -> float:
    return round((n or 0) / 2**30, 3)


def report(name: str, compiled, t0: float) -> None:
    m = compiled.memory_analysis()
    print(json.dumps({"program": name, "temp_gib": gib(m.temp_size_in_bytes), "args_gib": gib(m.argument_size_in_bytes),
                      "out_gib": gib(m.output_size_in_bytes), "alias_gib": gib(m.alias_size_in_bytes),
                      "compile_s": round(time.perf_counter() - t0, 1)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:moondream2")
    ap.add_argument("--options", default="{}", help="LLM(...) keywords as JSON")
    ap.add_argument("--steps", type=int, default=0, help="step shapes to compile (0: all)")
    args = ap.parse_args()
    llm = LLM(args.model, **{**json.loads(args.options), "warmup": "off"})
    runner = llm.engine.runner
    print(json.dumps({"kv_gib": gib(runner.kv_bytes), "shapes": len(runner.sched.all_shapes())}), flush=True)
    for bucket in runner.vision.crop_buckets if runner.vision is not None else ():
        t0 = time.perf_counter()
        report(f"vision crops={bucket}", runner.lower_vision(bucket).compile(), t0)
    shapes = runner.sched.all_shapes()
    for shape in shapes[:args.steps or len(shapes)]:
        t0 = time.perf_counter()
        for lowered in runner.lower_step(shape):
            report(f"step {shape}", lowered.compile(), t0)


if __name__ == "__main__":
    main()
