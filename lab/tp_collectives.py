"""Issue 29 probe: a tensor-parallel decode step's all-reduces under XLA / NCCL settings (set in the environment before
JAX starts; lab/tp_collectives.sh runs one process per setting). Prints one JSON line: step ms at each batch.

    XLA_FLAGS=... python lab/tp_collectives.py --model random:llama3-8b --tp 2 --batches 1 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from jphoton import LLM  # noqa: E402


def gpu_mib_used() -> list[int]:
    q = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True)
    return [int(x) for x in q.stdout.split()] if q.returncode == 0 else []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])  # each a separate program
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    llm = LLM(args.model, tensor_parallel_size=args.tp, warmup="off", max_num_seqs=max(args.batches),
              max_model_len=2 * args.context, kv_memory_fraction=0.3, progress=False)
    out = {"label": args.label, "xla_flags": os.environ.get("XLA_FLAGS", ""), "tp": args.tp}
    out["mib_used_loaded"] = gpu_mib_used()
    for b in args.batches:
        llm.device_step_ms(b, context=args.context, steps=3)
        out[f"B{b}_ms"] = statistics.median(llm.device_step_ms(b, context=args.context, steps=30) for _ in range(3))
        out[f"mib_used_after_B{b}"] = gpu_mib_used()  # grows by what each new program takes outside JAX's pool
    print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
