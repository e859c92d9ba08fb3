"""Programs from the compile worker (deserialized `Compiled` objects, called directly) vs the same programs compiled
by the jitted step in this process: the pipelined decode period and the device step, alternated in one process.
    python lab/probes/worker_dispatch.py [--model random:llama3.2-1b] [--rounds 2] [--options '{"max_num_seqs": 8}']
The engine is the default `LLM(model)` (compile worker on); B=1 runs a first-tier shape (always
this process's own compile: the control), B=32 a worker program. "jit" clears the installed programs, so the jitted
step compiles that shape here (the same HLO) and dispatches it through its own cache. First, the greedy tokens of 16
requests (mixed lengths, so prefill, mixed and decode steps all run) with the loaded programs and with this process's
own: they must be the same."""

import argparse
import json
import time

from jphoton import LLM
from lab.ab_trees import CASES, _decode_cases

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="random:llama3.2-1b")
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--options", default="{}", help="LLM keyword options, JSON")
args = ap.parse_args()
t0 = time.perf_counter()
llm = LLM(args.model, progress=False, compile_worker=True, **json.loads(args.options))
llm.wait_until_ready()
print(f"ready after {time.perf_counter() - t0:.1f} s, path {llm.stats()['compile_path']}", flush=True)
runner = llm.engine.runner
installed = dict(runner._programs)


def greedy_tokens():
    import numpy as np

    from jphoton import SamplingParams

    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(0, llm.config.vocab_size, n).tolist()}
               for n in rng.integers(5, 700, 16)]
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))]


loaded_tokens = greedy_tokens()
runner._programs.clear()
own_tokens = greedy_tokens()
own_again = greedy_tokens()
runner._programs.update(installed)
loaded_again = greedy_tokens()


def same(a, b):
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)} requests the same"


print(f"{len(installed)} loaded programs; greedy tokens: loaded vs own programs {same(loaded_tokens, own_tokens)}; "
      f"controls: own vs own {same(own_tokens, own_again)}, loaded vs loaded {same(loaded_tokens, loaded_again)}",
      flush=True)
rows = []
for r in range(args.rounds):
    for variant in ("worker", "jit"):
        runner._programs.clear()
        if variant == "worker":
            runner._programs.update(installed)
        res = _decode_cases(llm, list(CASES), CASES)
        for case, row in res.items():
            rows.append({"round": r, "variant": variant, "case": case, "ms_step": row["ms_step"],
                         "device_step_ms": row["device_step_ms"], "tick_over_device_step": row["tick_over_device_step"],
                         "dispatch_ms": row["host_ms"]["dispatch"]})
            print(json.dumps(rows[-1]), flush=True)
for case in CASES if args.rounds else ():
    for key in ("ms_step", "device_step_ms", "dispatch_ms"):
        w = [x[key] for x in rows if x["case"] == case and x["variant"] == "worker"]
        j = [x[key] for x in rows if x["case"] == case and x["variant"] == "jit"]
        print(f"{case} {key}: worker {sum(w) / len(w):.4f} jit {sum(j) / len(j):.4f} ratio {sum(w) / sum(j):.4f}")
