"""A/B two source trees of jphoton on one GPU, alternated: the 1B decode step at B=1 (context 512) and B=32.

    mkdir -p .ab/base && git archive 98dc4d0 jphoton pallas_kernels server benchmarks/__init__.py \
        benchmarks/common.py benchmarks/pipeline.py | tar -x -C .ab/base      # .ab/ is git-ignored; carry it
    taskset -c 0-7 python lab/ab_trees.py --trees base=.ab/base new=. --rounds 5 --out $OUT/ab.json

Each (tree, round) runs in a fresh child process with PYTHONPATH=tree and measures, through APIs that every tree since
wave 1 has (`LLM(...)`, `generate`, the engine's step telemetry), the pipelined engine's decode period (launch to
launch, median over decode-only steps) and, where the tree offers it, the device step back to back. The children share
JAX's persistent compile cache, so only the first child of an HLO compiles. Issue 21's gate: every row within 3% of the
base tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = {"b1-ctx512": (1, 512), "b32": (32, 128)}  # name -> (requests, prompt tokens)
# Opt-in (--cases), on an engine of their own with the 8k context: B=64 decode, and one 6,000-token prompt's prefill
# (ms_step = the prefill's wall ms, median of 3; "device" = the same).
LONG_CASES = {"b64": (64, 128), "prefill6k": (1, 6000)}
NEW_TOKENS = 256  # --new-tokens' default


def child(model: str, case_names: list[str], new_tokens: int = NEW_TOKENS, options: dict | None = None) -> dict:
    """Runs inside the tree under test; options: LLM keywords over the cases' own (JSON lists become tuples)."""
    from jphoton import LLM

    def tup(v):
        return tuple(tup(x) for x in v) if isinstance(v, list) else v

    extra = {k: tup(v) for k, v in (options or {}).items()}

    out = {}
    short = [c for c in case_names if c in CASES]
    if short:
        llm = LLM(model, **{**dict(pipeline_depth=2, max_model_len=1024, max_num_seqs=32, decode_buckets=(1, 32),
                                   prefill_buckets=((1, 512), (32, 128)), max_num_batched_tokens=32 * 128 + 32,
                                   num_kv_pages=33 * 64 + 8, warmup=False, progress=False), **extra})
        out.update(_decode_cases(llm, short, CASES, new_tokens))
        del llm
    long = [c for c in case_names if c in LONG_CASES]
    if long:
        llm = LLM(model, **{**dict(pipeline_depth=2, max_model_len=8192, max_num_seqs=64, decode_buckets=(1, 64),
                                   prefill_buckets=((1, 512), (32, 128)), max_num_batched_tokens=32 * 128 + 64,
                                   num_kv_pages=64 * 24 + 400, warmup=False, progress=False), **extra})
        out.update(_decode_cases(llm, [c for c in long if c != "prefill6k"], LONG_CASES, new_tokens))
        if "prefill6k" in long:
            out["prefill6k"] = _prefill_case(llm, LONG_CASES["prefill6k"][1])
    return out


def _prefill_case(llm, prompt_len: int) -> dict:
    import numpy as np

    from jphoton import SamplingParams

    prompt = {"prompt_token_ids": np.random.default_rng(1).integers(0, llm.config.vocab_size, prompt_len).tolist()}
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate([prompt], params)  # compiles the chunks' shapes
    walls = []
    for _ in range(3):
        if hasattr(llm, "reset_prefix_cache"):  # a full prefill each time (98dc4d0 has no prefix cache)
            llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate([prompt], params)
        walls.append(1e3 * (time.perf_counter() - t0))
    ms = float(np.median(walls))
    return {"ms_step": ms, "ms_step_p10": min(walls), "ms_step_p90": max(walls), "decode_steps": 0,
            "device_step_ms": ms, "tick_over_device_step": 1.0}


def _decode_cases(llm, case_names: list[str], cases: dict, new_tokens: int = NEW_TOKENS) -> dict:
    import numpy as np

    from jphoton import SamplingParams

    telemetry = getattr(llm, "telemetry", None) or llm.engine.telemetry  # public since wave 2
    rng = np.random.default_rng(0)
    out = {}
    for name in case_names:
        rows, prompt = cases[name]
        prompts = [{"prompt_token_ids": rng.integers(0, llm.config.vocab_size, prompt).tolist()} for _ in range(rows)]
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts, params)  # compiles (or loads) the shapes this case steps through
        periods, decode_recs = [], []
        for _ in range(2):
            telemetry.clear()
            llm.generate(prompts, params)
            recs = sorted(telemetry.records, key=lambda r: r.step_id)
            periods += [b.t_launch - a.t_launch for a, b in zip(recs, recs[1:], strict=False)
                        if a.kind == b.kind == "decode"]
            decode_recs += [r for r in recs if r.kind == "decode"]
        q = np.percentile(periods, [10, 50, 90]) * 1e3
        row = {"ms_step": float(q[1]), "ms_step_p10": float(q[0]), "ms_step_p90": float(q[2]),
               "decode_steps": len(periods)}
        # Host phases of a decode step (median ms): where a slower tick's time goes.
        phases = {"plan": ("t_plan", "t_planned"), "dispatch": ("t_put", "t_dispatched"),
                  "launch": ("t_launch", "t_launched"), "commit_wait": ("t_commit", "t_ready"),
                  "commit": ("t_ready", "t_committed")}
        row["host_ms"] = {k: float(np.median([getattr(r, b) - getattr(r, a) for r in decode_recs])) * 1e3
                          for k, (a, b) in phases.items()}
        context = prompt + new_tokens // 2
        if hasattr(llm, "device_step_ms"):
            row["device_step_ms"] = llm.device_step_ms(rows, context=context, steps=50)
        else:  # the wave-1 tree: its benchmark helper
            from benchmarks.pipeline import device_step_ms

            bucket = min(b for b in llm.engine.scheduler.config.decode_buckets if b >= rows)
            row["device_step_ms"] = device_step_ms(llm, bucket, reps=50, context=context)
        row["tick_over_device_step"] = row["ms_step"] / row["device_step_ms"]
        out[name] = row
    return out


def _write(args, trees: dict, runs: list) -> None:
    names = [n for n in trees if any(x["tree"] == n for x in runs)]
    summary = {}
    for c in args.cases:
        med = {n: statistics.median(x[c]["ms_step"] for x in runs if x["tree"] == n) for n in names}
        dev = {n: statistics.median(x[c]["device_step_ms"] for x in runs if x["tree"] == n) for n in names}
        best = {n: min(x[c]["ms_step"] for x in runs if x["tree"] == n) for n in names}
        summary[c] = {"ms_step_median": med, "ms_step_best_round": best, "device_step_ms_median": dev,
                      "ratio_vs_first": {n: med[n] / med[names[0]] for n in names},
                      "best_round_ratio_vs_first": {n: best[n] / best[names[0]] for n in names}}
    if len(runs) == args.rounds * len(trees):
        for c, row in summary.items():
            med = row["ms_step_median"]
            best = row["ms_step_best_round"]
            print(f"{c}: median of rounds " + ", ".join(f"{n} {med[n]:.3f} ms ({med[n] / med[names[0]]:.3f}x)"
                                                       for n in names)
                  + "; best round " + ", ".join(f"{n} {best[n]:.3f} ms ({best[n] / best[names[0]]:.3f}x)" for n in names))
    if args.out:
        import jax

        payload = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "trees": trees, "runs": runs,
                   "summary": summary}
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=[], help="NAME=PATH ...")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=[*CASES, *LONG_CASES])
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--options", default="{}", help="LLM keywords as JSON over the cases' own (an image model needs a "
                    "prefill bucket that holds its image prefix: '{\"prefill_buckets\": [[1, 768], [32, 128]]}')")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.model, args.cases, args.new_tokens, json.loads(args.options))), flush=True)
        return 0
    trees = dict(t.split("=", 1) for t in args.trees)
    runs = []
    for r in range(args.rounds):
        for name, path in trees.items():
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.abspath(path), os.environ.get("PYTHONPATH", "")])}
            t0 = time.perf_counter()
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--cases", *args.cases,
                   "--new-tokens", str(args.new_tokens), "--options", args.options]
            proc = subprocess.run(cmd, cwd=os.path.abspath(path), env=env, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
                raise SystemExit(f"{name} round {r}: child failed with {proc.returncode}")
            res = json.loads(line[7:])
            runs.append({"tree": name, "round": r, "wall_s": time.perf_counter() - t0, **res})
            print(f"round {r} {name:>6} ({time.perf_counter() - t0:5.1f} s): " + "  ".join(
                f"{c} {v['ms_step']:.3f} ms/step (p10-p90 {v['ms_step_p10']:.3f}-{v['ms_step_p90']:.3f}, "
                f"device {v['device_step_ms']:.3f}, x{v['tick_over_device_step']:.3f})"
                for c, v in res.items()), flush=True)
            _write(args, trees, runs)  # after every child: a run cut short keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
