"""Time to first token of a fresh process with the default `LLM(...)` (issue 22), cold and warm caches.

    python3 benchmarks/startup.py --models random:smollm2-135m random:llama3.2-1b --out $OUT/startup.json
    python3 benchmarks/startup.py --models random:llama3.2-1b --wait-ready --out $OUT/startup_ready.json

Each model runs in a child process started by this script, twice: "cold" with empty XLA, Triton and converted-weight
caches (a new JPHOTON_CACHE_DIR and TRITON_CACHE_DIR), then "warm" with the caches the cold run left. The child is a
user's script: import jphoton, `LLM(model)` with the defaults, stream one request of a 128-token prompt; the time is
from the child's start (measured by the parent, before the interpreter starts) to its first generated token.

--wait-ready: the child then keeps decoding (B=1, 64-token requests back to back) while the other shapes compile in the
background, until `stats()["all_shapes_ready"]`, and 5 more requests after: decode tok/s during the compile vs after
(`decode_b1.during_over_after`: tokens over time during the compile / the median request after; the mean of the
requests' rates, which counts a stall once per request, is `request_mean_during_over_after`), seconds to all shapes
ready, and compiles after ready (must be 0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, time
t_import = time.time()
from jphoton import LLM, SamplingParams
llm = LLM(sys.argv[1], **json.loads(sys.argv[3]))
t_llm = time.time()
prompt = {"prompt_token_ids": [(7 * i + 3) % min(1000, llm.config.vocab_size - 1) + 1 for i in range(128)]}
first = None
for delta in llm.stream(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)):
    if first is None and delta.token_ids:
        first = time.time()
stats = llm.stats()
out = {"t_import": t_import, "t_llm": t_llm, "t_first_token": first, "stats_at_first_token": stats}
if sys.argv[2] == "1":
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    during, after = [], []
    while not llm.stats()["all_shapes_ready"]:
        t0 = time.perf_counter()
        llm.generate(prompt, params)
        during.append(64 / (time.perf_counter() - t0))
        if time.time() - t_import > 600:
            break
    out["t_all_ready"] = time.time()
    ready_compiles = llm.stats()["num_compiles"]
    for _ in range(5):
        t0 = time.perf_counter()
        llm.generate(prompt, params)
        after.append(64 / (time.perf_counter() - t0))
    out.update(decode_tok_s_during=during, decode_tok_s_after=after,
               compiles_after_ready=llm.stats()["num_compiles"] - ready_compiles, stats_end=llm.stats())
print("STARTUP_RESULT " + json.dumps(out), flush=True)
"""


def time_weighted(rates: list[float]) -> float:
    """tok/s over requests of equal length: their tokens over their total time (the harmonic mean of the rates)."""
    return len(rates) / sum(1 / r for r in rates)


def run_child(model: str, cache: str, wait_ready: bool, timeout: float, llm_args: dict | None = None) -> dict:
    env = {**os.environ, "JPHOTON_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, model, "1" if wait_ready else "0", json.dumps(llm_args or {})],
                          env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("STARTUP_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    r = json.loads(lines[-1].split(" ", 1)[1])
    s = r["stats_at_first_token"]
    out = {"first_token_s": r["t_first_token"] - t0, "import_s": r["t_import"] - t0, "llm_s": r["t_llm"] - t0,
           "shapes_at_first_token": s["shapes_compiled"], "shapes_total": s["shapes_total"],
           "compiles_at_first_token": s["num_compiles"]}
    if wait_ready:
        during, after = r["decode_tok_s_during"], r["decode_tok_s_after"]
        med = sorted(after)[len(after) // 2]
        out.update(all_ready_s=r["t_all_ready"] - t0, compiles_after_ready=r["compiles_after_ready"],
                   decode_b1={"during_tok_s": during, "after_tok_s": after,
                              # tokens / seconds over the compile (equal-length requests: the rates' harmonic mean),
                              # what a user's decode loop gets; a mean of per-request rates counts a stall once
                              "during_over_after": time_weighted(during) / med if during else None,
                              "request_mean_during_over_after": (sum(during) / len(during) / med) if during else None,
                              "worst_during_over_after": (min(during) / med) if during else None},
                   all_shapes_ready=r["stats_end"]["all_shapes_ready"])
    return out


def main(argv=None) -> dict:
    from benchmarks.common import device_info
    from benchmarks.llm_args import add_llm_args, parse_llm_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["random:smollm2-135m", "random:llama3.2-1b"])
    ap.add_argument("--runs", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    ap.add_argument("--wait-ready", action="store_true", help="decode B=1 while the rest compiles (cold run only)")
    ap.add_argument("--timeout", type=float, default=460)
    add_llm_args(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    llm_args = parse_llm_args(args.llm_args)

    result = {**device_info(), "command": "python3 benchmarks/startup.py " + " ".join(argv or sys.argv[1:]),
              "models": {}}
    for model in args.models:
        cache = tempfile.mkdtemp(prefix="jphoton-startup-")
        rows = {}
        for run in args.runs:
            rows[run] = run_child(model, cache, args.wait_ready and run == "cold", args.timeout, llm_args)
            r = rows[run]
            ready = ""
            if "all_ready_s" in r:
                b = r["decode_b1"]
                ready = (f"; all ready {r['all_ready_s']:.1f} s, decode during/after {b['during_over_after']} (mean of "
                         f"requests {b['request_mean_during_over_after']}), compiles after ready "
                         f"{r['compiles_after_ready']}")
            print(f"{model} {run}: first token {r['first_token_s']:.1f} s (import {r['import_s']:.1f} s, LLM() "
                  f"{r['llm_s']:.1f} s; {r['shapes_at_first_token']}/{r['shapes_total']} shapes){ready}", flush=True)
            result["models"][model] = rows
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
