"""B=1 decode latency while the background warm-up compiles vs after (issue 22), at a given GIL switch interval.
    JAX_PLATFORMS=cpu python lab/probes/decode_during_warmup.py [switch_interval_s] [model]"""

import json
import statistics
import sys
import time

if len(sys.argv) > 1 and sys.argv[1] != "default":
    sys.setswitchinterval(float(sys.argv[1]))
from jphoton import LLM, SamplingParams  # noqa: E402

model = sys.argv[2] if len(sys.argv) > 2 else "random:smollm2-135m:layers=8:vocab=512"
llm = LLM(model, warmup="background", progress=False, unroll_layers=True, max_num_seqs=16, max_model_len=1024)
prompt = {"prompt_token_ids": list(range(1, 33))}
params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
during, after = [], []
while not llm.stats()["all_shapes_ready"]:
    t = time.perf_counter()
    llm.generate(prompt, params)
    during.append(time.perf_counter() - t)
for _ in range(20):
    t = time.perf_counter()
    llm.generate(prompt, params)
    after.append(time.perf_counter() - t)
med = statistics.median(after)
print(json.dumps({"switch": sys.getswitchinterval(), "requests_during": len(during), "all_ready_s": llm.warmup.all_ready_s,
                  "mean_during_over_after": med / statistics.mean(during), "worst": med / max(during),
                  "median_ms_after": med * 1e3}))
