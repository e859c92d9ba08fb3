"""Blocking (depth 1) vs pipelined (depth 2) decoding, with Photon's cost model checked against the measurement.

N closed-loop streams (a finished request is replaced at once by a new one), per-request max_tokens drawn uniformly in
[50, 150] (mean 100: random weights never stop on their own), prompt 64 tokens. For each model and stream count:

  period     median launch-to-launch interval of decode steps whose predecessor and successor are decode steps too
             (telemetry), blocking and pipelined
  fwd+samp   the same decode step dispatched back to back with no host work (`LLM.device_step_ms`: device time)
  host       median host time per step (plan + pack + dispatch + commit)
  idle       period - fwd+samp: what the device waits per step
  predicted  T_block / T_pipe x (1 - z) - 1 with z = 1 / (L * streams) (one wasted row-step per finished request),
             from the median decode-step periods (Photon's form), and from the mean period over *all* steps
             (decode, prefill, mixed: what the workload's steps cost on average, so the prefill share counts)
  observed   tokens/s pipelined over tokens/s blocking - 1 over the whole run

Prefill runs one request per step (bucket 1 x 64 tokens beside the decode rows), as a replacement request arrives in a
closed loop: a wider prefill bucket would pad every mixed step to its full size and make mixed steps several decode
steps long, and the run would measure prefill padding rather than the decode loop.

    python benchmarks/pipeline.py --models random:smollm2-135m random:llama3.2-1b --streams 1 8 32 --out DIR
"""

from __future__ import annotations

import argparse
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import (  # noqa: E402
    QUICK,
    closed_loop,
    default_llm,
    device_info,
    write_json,
)
from benchmarks.llm_args import add_llm_args, parse_llm_args  # noqa: E402

PROMPT = 64


def plot_timelines(path: str, runs: dict[str, list[dict]], window: int = 12) -> None:
    """Host activity (plan+launch, commit) and the device's busy span per step, blocking vs pipelined."""
    try:
        import matplotlib
    except ImportError:  # the CPU smoke run's environment; the GPU image has it
        print(f"matplotlib is not installed: no plot written ({path})")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2.6 * len(runs)), squeeze=False)
    for ax, (title, tl) in zip(axes[:, 0], runs.items(), strict=True):
        steps = [r for r in tl if r["kind"] == "decode"][20:20 + window]
        if not steps:
            continue
        t0 = steps[0]["t_plan"]
        dev_end = 0.0
        def ms(t, t0=t0):
            return 1e3 * (t - t0)

        for r in steps:
            ax.broken_barh([(ms(r["t_plan"]), ms(r["t_launched"]) - ms(r["t_plan"]))], (20, 8), color="tab:blue")
            ax.broken_barh([(ms(r["t_ready"]), ms(r["t_committed"]) - ms(r["t_ready"]))], (20, 8), color="tab:orange")
            start = max(ms(r["t_launched"]), dev_end)  # the device starts once dispatched and free
            dev_end = ms(r["t_ready"])
            ax.broken_barh([(start, dev_end - start)], (5, 8), color="tab:green", edgecolor="white", linewidth=0.6)
        ax.set_yticks([9, 24], ["device (busy, upper bound)", "host"])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("ms")
    axes[0, 0].legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:orange", "tab:green")],
                      labels=["plan + launch", "commit", "device step"], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["random:smollm2-135m", "random:llama3.2-1b"])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-stream", type=int, default=6)
    ap.add_argument("--out", default=".")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--dtype", default=None)
    add_llm_args(ap)
    args = ap.parse_args(argv)
    if QUICK:
        args.streams, args.requests_per_stream = [1, max(args.streams)], 2
    info = device_info()
    print(info, flush=True)
    rows, timelines = [], {}
    for model in args.models:
        results = {}
        for depth in (1, 2):
            llm = default_llm(model, max(args.streams), dtype=args.dtype, pipeline_depth=depth,
                              **parse_llm_args(args.llm_args))
            for n in args.streams:
                closed_loop(llm, n, 1, seed=99, lengths=(8, 12))  # compiles every shape the runs step through
                results[depth, n] = closed_loop(llm, n, args.requests_per_stream, seed=n)
                if depth == 2:
                    results["dev", n] = llm.device_step_ms(n)
            del llm
        for n in args.streams:
            b, p = results[1, n], results[2, n]
            fwd = results["dev", n]
            L = (b["mean_len"] + p["mean_len"]) / 2
            z = 1 / (L * n)
            # Photon's model uses the decode step alone; runs of ~100 tokens per request also spend steps on prefill
            # and mixed prefill+decode, which the all-steps form charges through the mean period of each run.
            kinds = p["kind_periods"]
            row = dict(model=model, streams=n, blocking_ms=b["period_ms"], pipelined_ms=p["period_ms"],
                       mean_period_blocking_ms=b["mean_period_ms"], mean_period_pipelined_ms=p["mean_period_ms"],
                       steps_blocking=b["steps"], steps_pipelined=p["steps"],
                       predicted_all_steps=b["mean_period_ms"] / p["mean_period_ms"] * (1 - z) - 1,
                       step_kinds={k: dict(steps=cnt, blocking_ms=1e3 * b["kind_periods"].get(k, (0, 0))[1],
                                           pipelined_ms=1e3 * med) for k, (cnt, med) in kinds.items()},
                       fwd_plus_sampling_ms=fwd, host_ms=p["host_ms"],
                       idle_blocking_ms=max(0.0, b["period_ms"] - fwd), idle_pipelined_ms=max(0.0, p["period_ms"] - fwd),
                       period_over_device=p["period_ms"] / fwd, L=L,
                       predicted=b["period_ms"] / p["period_ms"] * (1 - z) - 1, observed=p["tok_s"] / b["tok_s"] - 1,
                       tok_s_blocking=b["tok_s"], tok_s_pipelined=p["tok_s"])
            rows.append(row)
            print(f"{model} {n:2d} streams: blocking {row['blocking_ms']:.3f} ms, pipelined {row['pipelined_ms']:.3f} ms,"
                  f" fwd+samp {fwd:.3f} ms, host {row['host_ms']:.3f} ms, idle "
                  f"{row['idle_blocking_ms']:.3f}/{row['idle_pipelined_ms']:.3f} ms, period/device "
                  f"{row['period_over_device']:.3f}, L {L:.0f}, predicted {row['predicted']:+.1%} (all steps "
                  f"{row['predicted_all_steps']:+.1%}), observed "
                  f"{row['observed']:+.1%} ({b['tok_s']:.0f} -> {p['tok_s']:.0f} tok/s)", flush=True)
        for n in args.streams:  # every run's timeline is kept (the raw data behind each row), the middle one plotted
            timelines[f"{model}, {n} streams, blocking"] = results[1, n]["timeline"]
            timelines[f"{model}, {n} streams, pipelined"] = results[2, n]["timeline"]
    tag = f"_{args.tag}" if args.tag else ""
    mid = sorted(args.streams)[len(args.streams) // 2]
    shown = [f"{args.models[-1]}, {mid} streams, {mode}" for mode in ("blocking", "pipelined")]
    plot_timelines(f"{args.out}/pipeline_timeline{tag}.png", {name: timelines[name] for name in shown})
    write_json(f"{args.out}/pipeline{tag}.json", {"info": info, "rows": rows})
    write_json(f"{args.out}/pipeline_timelines{tag}.json", timelines)
    return rows


if __name__ == "__main__":
    main()
