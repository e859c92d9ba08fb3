"""Blocking (depth 1) vs pipelined (depth 2) decoding, with Photon's cost model checked against the measurement.

N closed-loop streams (a finished request is replaced at once by a new one), per-request max_tokens drawn uniformly in
[50, 150] (mean 100: random weights never stop on their own), prompt 64 tokens. For each model and stream count:

  period     median launch-to-launch interval of decode steps whose predecessor and successor are decode steps too
             (telemetry), blocking and pipelined
  fwd+samp   the same decode step dispatched back to back with no host work (device time), and the plain sampler alone
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
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import decode_step_input, device_info, steps_back_to_back, write_json  # noqa: E402
from jphoton import LLM, SamplingParams  # noqa: E402
from jphoton.sampling import sample_plain  # noqa: E402

PROMPT = 64


def closed_loop(llm, streams: int, requests_per_stream: int, seed: int, make_params=None) -> dict:
    """`streams` requests in flight at all times until streams x requests_per_stream are done. make_params(i) gives
    request i's SamplingParams (default: greedy, ignore_eos, max_tokens uniform in [50, 150])."""
    rng = np.random.default_rng(seed)
    total = streams * requests_per_stream
    lengths = rng.integers(50, 151, size=total).tolist()
    prompts = [rng.integers(0, llm.config.vocab_size, PROMPT).tolist() for _ in range(total)]
    if make_params is None:
        def make_params(i):
            return SamplingParams(max_tokens=lengths[i], temperature=0, ignore_eos=True)
    submitted, live, done = 0, [], []

    def submit():
        nonlocal submitted
        [s] = llm._make_sequences([prompts[submitted]], make_params(submitted))
        llm._submit(s)
        live.append(s)
        submitted += 1

    for _ in range(streams):
        submit()
    llm.engine.telemetry.clear()
    t0 = time.perf_counter()
    with jax.transfer_guard("disallow"):
        while llm.engine.has_work():
            llm._tick()
            for s in [s for s in live if s.finalized]:
                live.remove(s)
                done.append(s)
                llm._outputs.pop(s.request_id, None)
                if submitted < total:
                    submit()
    wall = time.perf_counter() - t0
    recs = sorted(llm.engine.telemetry.records, key=lambda r: r.step_id)
    decode = [r for r in recs if r.kind == "decode"]
    # A pipelined launch waits for the commit of the step two back, so a period reflects the device time of the step
    # before it: count decode periods only where that step was a decode step too (a mixed step's longer forward
    # would otherwise be charged to the decode step after it).
    periods = [c.t_launch - b.t_launch for a, b, c in zip(recs, recs[1:], recs[2:], strict=False)
               if a.kind == b.kind == c.kind == "decode"]
    host = [(r.t_planned - r.t_plan) + (r.t_launched - r.t_launch) + (r.t_committed - r.t_ready) for r in decode]
    by_kind: dict[str, list[float]] = {}  # launch-to-launch period of every step, by the step's kind
    for a, b in zip(recs, recs[1:], strict=False):
        by_kind.setdefault(a.kind, []).append(b.t_launch - a.t_launch)
    kind_periods = {k: (len(v), statistics.median(v)) for k, v in by_kind.items()}
    # Mean launch-to-launch period over every step: in a pipelined run a long step's device time shows up in the
    # periods after it, so only the mean (not a per-kind median) charges each step kind what it really costs.
    mean_period = (recs[-1].t_launch - recs[0].t_launch) / (len(recs) - 1)
    tokens = sum(len(s.output_ids) for s in done)
    return dict(wall_s=wall, tokens=tokens, tok_s=tokens / wall, mean_len=tokens / len(done),
                lengths=[len(s.output_ids) for s in sorted(done, key=lambda s: s.request_id)], done=done,
                period_ms=1e3 * statistics.median(periods), host_ms=1e3 * statistics.median(host),
                steps=len(recs), kind_periods=kind_periods, mean_period_ms=1e3 * mean_period,
                timeline=llm.engine.telemetry.timeline())


def device_step_ms(llm, rows: int, reps: int = 30, then=None, context: int = 0) -> float:
    """The decode step of `rows` rows dispatched back to back (no host work between): forward + fused sampling, and
    then(slot) after each step if given (e.g. a second sampler). context: tokens each row attends over (on pages of
    its own, benchmarks/common.py decode_step_input); 0 = padding rows, attention nearly free."""
    runner = llm.engine.runner
    shape = next(s for s in sorted(runner._layouts, key=lambda s: s.ctx_pages)
                 if s.decode_rows == rows and s.prefill_rows == 0)
    packed = decode_step_input(runner, shape, context)
    steps_back_to_back(runner, shape, packed, 3, then)  # compile + warm
    return 1e3 * steps_back_to_back(runner, shape, packed, reps, then)


def sampler_ms(rows: int, vocab: int, reps: int = 50) -> float:
    f = jax.jit(sample_plain)
    args = (jnp.zeros((rows, vocab), jnp.float32), jnp.ones(rows), jnp.zeros((rows, 2), jnp.uint32),
            jnp.zeros(rows, jnp.int32))
    f(*args).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    out.block_until_ready()
    return 1e3 * (time.perf_counter() - t0) / reps


def plot_timelines(path: str, runs: dict[str, list[dict]], window: int = 12) -> None:
    """Host activity (plan+launch, commit) and the device's busy span per step, blocking vs pipelined."""
    import matplotlib

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
            start = max(ms(r["t_dispatched"]), dev_end)  # the device starts once dispatched and free
            dev_end = ms(r["t_ready"])
            ax.broken_barh([(start, dev_end - start)], (5, 8), color="tab:green", edgecolor="white", linewidth=0.6)
        ax.set_yticks([9, 24], ["device (busy, upper bound)", "host"])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("ms")
    axes[0, 0].legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:orange", "tab:green")],
                      labels=["plan + launch", "commit", "device step"], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["random:smollm2-135m", "random:llama3.2-1b"])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-stream", type=int, default=6)
    ap.add_argument("--out", default=".")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    args = ap.parse_args()
    info = device_info()
    print(info, flush=True)
    rows, timelines = [], {}
    for model in args.models:
        results = {}
        for depth in (1, 2):
            llm = LLM(model, max_model_len=256, pipeline_depth=depth, max_num_seqs=max(args.streams),
                      decode_buckets=tuple(sorted(args.streams)), max_num_batched_tokens=max(args.streams) + PROMPT,
                      prefill_buckets=((1, PROMPT),), num_kv_pages=max(args.streams) * 16 + 8)
            for n in args.streams:
                closed_loop(llm, n, 1, seed=99)  # warm every path once
                results[depth, n] = closed_loop(llm, n, args.requests_per_stream, seed=n)
                if depth == 2:
                    results["dev", n] = device_step_ms(llm, n)
            vocab = llm.config.vocab_size
            del llm
        for n in args.streams:
            b, p = results[1, n], results[2, n]
            fwd = results["dev", n]
            samp = sampler_ms(n, vocab)
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
                       fwd_plus_sampling_ms=fwd, sampling_ms=samp, host_ms=p["host_ms"],
                       idle_blocking_ms=max(0.0, b["period_ms"] - fwd), idle_pipelined_ms=max(0.0, p["period_ms"] - fwd),
                       period_over_device=p["period_ms"] / fwd, L=L,
                       predicted=b["period_ms"] / p["period_ms"] * (1 - z) - 1, observed=p["tok_s"] / b["tok_s"] - 1,
                       tok_s_blocking=b["tok_s"], tok_s_pipelined=p["tok_s"])
            rows.append(row)
            print(f"{model} {n:2d} streams: blocking {row['blocking_ms']:.3f} ms, pipelined {row['pipelined_ms']:.3f} ms,"
                  f" fwd+samp {fwd:.3f} ms (sampler alone {samp:.3f}), host {row['host_ms']:.3f} ms, idle "
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


if __name__ == "__main__":
    main()
