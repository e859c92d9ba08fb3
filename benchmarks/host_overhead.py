"""The engine's host work per decode tick, without a device: the scheduler's plan, the packing of the step input and
the commit of its tokens, at B rows.

Why: in the pipelined loop the host plans, packs, dispatches and commits one step while the device runs the other, so
the device waits whenever that work outlasts a step. At large batches it grows with the rows (Python per row) while a
1B decode step grows slowly (2.1 ms at B=128 on the H100), so this is where B=128 serving turns host-bound.

The runner's device calls are replaced by stand-ins (launch keeps the plan, fetch returns random tokens), so the loop
runs the real scheduler, `Runner.pack` and `Engine._commit` and nothing else; jit dispatch of the step (0.4-0.6 ms
on the H100 host, RESULTS.md "What a dispatch costs the host") is not in these numbers. B closed-loop streams, each
request 64 prompt tokens and max_tokens uniform in [50, 150], greedy; ticks of decode-only steps are reported.

    python benchmarks/host_overhead.py --batch 1 32 128 [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import device_info, write_json  # noqa: E402
from jphoton import LLM, SamplingParams  # noqa: E402
from jphoton.engine.runner import StepResult  # noqa: E402
from jphoton.models.protocol import llama_family  # noqa: E402
from jphoton.weights import load_model  # noqa: E402

SPEC = "random:smollm2-135m:layers=1:vocab=512"
PROMPT = 64


class _Slot:
    def __init__(self, plan):
        self.plan, self.awaiting_mask = plan, False


def hostless(llm: LLM, seed: int = 0) -> None:
    """Replace the runner's device calls by stand-ins; `pack` stays real (the engine calls it while planning)."""
    runner, rng = llm.engine.runner, np.random.default_rng(seed)
    vocab = llm.config.vocab_size

    def launch(plan, record=None, defer_sampling=False, packed=None):
        if packed is None:
            runner.pack(plan)
        if record is not None:
            record.t_packed = record.t_put = record.t_dispatched = time.perf_counter()
        return _Slot(plan)

    def fetch(slot):
        return StepResult(rng.integers(0, vocab, runner.static.max_rows).astype(np.int32), None, None)

    runner.launch, runner.fetch = launch, fetch


def run(batch: int, ticks: int, seed: int) -> dict:
    loaded = load_model(SPEC, None)
    model = llama_family(loaded.config, loaded.params, name=SPEC)
    llm = LLM(model, max_model_len=512, max_num_seqs=batch, decode_buckets=(batch,), prefill_buckets=((batch, PROMPT),),
              num_kv_pages=batch * 32 + 8, pipeline_depth=2, warmup=False, progress=False)
    hostless(llm, seed)
    rng = np.random.default_rng(seed)

    def submit():
        params = SamplingParams(max_tokens=int(rng.integers(50, 151)), temperature=0, ignore_eos=True)
        [s] = llm._make_sequences([rng.integers(0, llm.config.vocab_size, PROMPT).tolist()], params)
        llm._submit(s)
        return s

    live = [submit() for _ in range(batch)]
    for _ in range(5):  # admit and prefill
        llm._tick()
    eng = llm.engine
    eng.telemetry.clear()
    t0 = time.perf_counter()
    for _ in range(ticks):
        llm._tick()
        for s in [s for s in live if s.finalized]:
            live.remove(s)
            llm._outputs.pop(s.request_id, None)
            live.append(submit())
    wall = time.perf_counter() - t0
    recs = [r for r in eng.telemetry.records if r.kind == "decode" and r.rows == batch]
    med = lambda f: 1e6 * statistics.median(f(r) for r in recs)  # noqa: E731
    return {"B": batch, "ticks": ticks, "decode_ticks": len(recs), "tick_us": 1e6 * wall / ticks,
            "plan_us": med(lambda r: r.t_planned - r.t_plan), "commit_us": med(lambda r: r.t_committed - r.t_ready)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--ticks", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="directory for host_overhead.json")
    args = ap.parse_args()
    rows = []
    for b in args.batch:
        row = run(b, args.ticks, args.seed)
        rows.append(row)
        print(f"B={b:<4} tick {row['tick_us']:7.0f} us  plan+pack {row['plan_us']:6.0f} us  commit {row['commit_us']:6.0f} us"
              f"  ({row['decode_ticks']} full decode ticks)", flush=True)
    if args.out:
        write_json(f"{args.out}/host_overhead.json", {"device": device_info(), "spec": SPEC, "rows": rows})


if __name__ == "__main__":
    main()
