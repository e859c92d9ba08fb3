"""Start-up cost of LoRA (issue 28): a fresh `LLM(model, max_loras=N)` compiles a LoRA variant of every step shape
beside the base one. One fresh process per arm, each with its own empty compile caches; prints seconds until LLM()
returns (first tier ready) and until every shape is ready.

    python lab/lora_startup.py --model random:llama3.2-1b --max-loras 0   # then 4
"""

import argparse
import json
import os
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="random:llama3.2-1b")
ap.add_argument("--max-loras", type=int, default=4)
args = ap.parse_args()
os.environ["JPHOTON_CACHE_DIR"] = tempfile.mkdtemp(prefix="jphoton-lora-startup-")  # cold caches
from jphoton import LLM, SamplingParams  # noqa: E402

t0 = time.perf_counter()
llm = LLM(args.model, max_loras=args.max_loras, progress=False)
first = time.perf_counter() - t0
llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))
llm.wait_until_ready()
s = llm.stats()
print(json.dumps({"max_loras": args.max_loras, "llm_s": round(first, 1), "all_ready_s": round(time.perf_counter() - t0, 1),
                  "shapes_total": s["shapes_total"], "num_compiles": s["num_compiles"]}), flush=True)
