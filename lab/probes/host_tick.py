"""Host work per decode step of a tree (run with PYTHONPATH=<tree>): plan+pack, launch (the jitted call), commit, on
an unrolled SmolLM2-135M shape with a small vocabulary, B rows. Issue 22: per-layer params add pytree leaves to every
dispatch.    PYTHONPATH=.ab/base python lab/probes/host_tick.py 32"""

import json
import statistics
import sys

from jphoton import LLM, SamplingParams

B = int(sys.argv[1]) if len(sys.argv) > 1 else 32
unroll = (sys.argv[2] != "scan") if len(sys.argv) > 2 else True
llm = LLM("random:smollm2-135m:vocab=512", unroll_layers=unroll, max_num_seqs=B, decode_buckets=(B,),
          prefill_buckets=((1, 64),), max_num_batched_tokens=64 + B, max_model_len=256, warmup=False, progress=False)
prompts = [{"prompt_token_ids": [(i * 7 + j) % 500 + 1 for j in range(16)]} for i in range(B)]
params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
llm.generate(prompts, params)
tel = llm.engine.telemetry
tel.clear()
llm.generate(prompts, params)
recs = [r for r in tel.records if r.kind == "decode"]
ms = {k: statistics.median(f(r) for r in recs) * 1e3 for k, f in {
    "plan": lambda r: r.t_planned - r.t_plan, "launch": lambda r: r.t_launched - r.t_launch,
    "dispatch": lambda r: r.t_dispatched - r.t_put, "commit": lambda r: r.t_committed - r.t_ready}.items()}
leaves = len(__import__("jax").tree.leaves(llm.engine.runner.params))
print(json.dumps({"B": B, "unroll": unroll, "leaves": leaves, "steps": len(recs), **{k: round(v, 4) for k, v in ms.items()}}))
