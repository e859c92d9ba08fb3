"""The engine's host work per decode step at B rows, from its telemetry: plan (schedule + pack the step input), launch
(dispatch), commit (append tokens, build deltas, check stops), on a model so small that the device step is short.

Why: in the pipelined loop the host plans, packs, dispatches and commits one step while the device runs the other, so
the device waits whenever that work outlasts a step. At large batches it grows with the rows (Python per row) while a
1B decode step grows slowly (about 2 ms at B=128 on the H100), so this is where large-batch serving turns host-bound.

B closed-loop streams (a finished request is replaced at once), each request 64 prompt tokens and max_tokens uniform in
[50, 150], greedy, pipelined; medians over the decode-only steps of full batches.

    python benchmarks/host_overhead.py --batch 1 32 128 [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import QUICK, closed_loop, device_info, write_json  # noqa: E402
from jphoton import LLM  # noqa: E402

SPEC = "random:smollm2-135m:layers=1:vocab=512"
PROMPT = 64


def run(batch: int, requests_per_stream: int = 3, seed: int = 0, model: str = SPEC, lengths=(50, 150)) -> dict:
    llm = LLM(model, max_model_len=256, max_num_seqs=batch, decode_buckets=(batch,), prefill_buckets=((1, PROMPT),),
              max_num_batched_tokens=batch + PROMPT, num_kv_pages=batch * 16 + 8, pipeline_depth=2, progress=False)
    closed_loop(llm, batch, 1, seed=seed + 1, prompt_len=PROMPT, lengths=(4, 8))  # warm
    r = closed_loop(llm, batch, requests_per_stream, seed=seed, prompt_len=PROMPT, lengths=lengths)
    recs = [x for x in r["timeline"] if x["kind"] == "decode" and x["rows"] == batch]

    def med(a, b):
        return 1e6 * statistics.median(x[b] - x[a] for x in recs) if recs else float("nan")

    plan, launch, commit = med("t_plan", "t_planned"), med("t_launch", "t_launched"), med("t_ready", "t_committed")
    return {"B": batch, "steps": r["steps"], "decode_ticks": len(recs), "period_us": 1e3 * r["period_ms"],
            "plan_us": plan, "launch_us": launch, "commit_us": commit, "host_us": plan + launch + commit,
            "tok_s": r["tok_s"]}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--requests-per-stream", type=int, default=3)
    ap.add_argument("--model", default=SPEC)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="directory for host_overhead.json")
    args = ap.parse_args(argv)
    if QUICK:
        args.requests_per_stream = 1
    rows = []
    for b in args.batch:
        row = run(b, args.requests_per_stream, args.seed, args.model)
        rows.append(row)
        print(f"B={b:<4} period {row['period_us']:7.0f} us  plan+pack {row['plan_us']:6.0f} us  launch "
              f"{row['launch_us']:6.0f} us  commit {row['commit_us']:6.0f} us  ({row['decode_ticks']} full decode steps)",
              flush=True)
    if args.out:
        write_json(f"{args.out}/host_overhead.json", {"info": device_info(), "model": args.model, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
