"""Host phases of the blocking loop (pipeline_depth=1) in whatever tree is first on PYTHONPATH (issue 22: the
`vs-pytorch-1b-b1-b32` blocking rows ran 1.11x (B=1) and 1.20x (B=32) slower on main than on 98dc4d0 while the
pipelined rows matched).

B greedy requests decoding together (one decode bucket of B rows), then the medians over full decode steps of the
engine's telemetry: plan, pack, host->device put, jitted-call dispatch, the wait for the tokens, the commit work.
Works with both trees' LLM(...) signatures (the keywords used exist in both).

    PYTHONPATH=.ab/base python3 lab/probes/blocking_host.py --model random:llama3.2-1b --batch 1 32
    PYTHONPATH=. python3 lab/probes/blocking_host.py --model random:llama3.2-1b --batch 1 32
    python3 lab/probes/blocking_host.py --model random:smollm2-135m:layers=2:vocab=512 --batch 4 --new-tokens 8  # CPU
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import jax

    import jphoton
    from jphoton import LLM, SamplingParams

    out = {"tree": jphoton.__file__, "jax": jax.__version__, "device": str(jax.devices()[0]), "rows": {}}
    for b in args.batch:
        llm = LLM(args.model, pipeline_depth=args.depth, max_model_len=512, max_num_seqs=b, decode_buckets=(b,),
                  prefill_buckets=((b, args.prompt_len),), max_num_batched_tokens=b * args.prompt_len,
                  progress=False)
        vocab = llm.config.vocab_size
        prompts = [{"prompt_token_ids": [(7 * i + j) % vocab for j in range(args.prompt_len)]} for i in range(b)]
        greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm
        telemetry = getattr(llm, "telemetry", None) or llm.engine.telemetry  # 98dc4d0: on the engine only
        telemetry.clear()
        llm.generate(prompts, greedy)
        recs = [r for r in telemetry.records if r.kind == "decode" and r.rows == b]
        recs = sorted(recs, key=lambda r: r.t_launch)

        def med(a, z, recs=recs):
            vals = [getattr(r, z) - getattr(r, a) for r in recs if getattr(r, z) and getattr(r, a)]
            return 1e3 * statistics.median(vals) if vals else None

        periods = [y.t_launched - x.t_launched for x, y in zip(recs, recs[1:], strict=False)]
        row = {"steps": len(recs), "period_ms": 1e3 * statistics.median(periods), "plan_ms": med("t_plan", "t_planned"),
               "launch_ms": med("t_launch", "t_launched"), "pack_ms": med("t_launch", "t_packed"),
               "put_ms": med("t_packed", "t_put"), "dispatch_ms": med("t_put", "t_dispatched"),
               "wait_ms": med("t_commit", "t_ready"), "commit_ms": med("t_ready", "t_committed")}
        out["rows"][b] = row
        print(f"B={b}: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)
        del llm
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
