"""Is the staggered loop's longer tick the device's or the host's? (issue 23: at C=64 the engine alone's staggered decode
ticks are 1.56-1.65 ms against 1.41-1.45 static and a 1.38 ms device step back to back, yet the commit still waits
0.15-0.31 ms a tick for the device.)

The default engine runs a static batch of C and then C staggered closed-loop clients (benchmarks/serving.py
engine_staggered), recording every launched step's shape and packed input. Then, the engine idle, the same steps are
dispatched again back to back through the runner (same programs, same inputs, same slots; no host work between): the
device time of exactly that mix of steps. Printed per scenario: the loop's launch-to-launch mean over the recorded steps
and the replay's time per step, for all steps and for the decode steps alone. replay ~ loop: the device sets the pace
(the steps themselves are longer); replay < loop: the host leaves the device idle.

    python3 lab/probes/replay_ticks.py --default-engine --concurrency 64 --out $OUT/replay.json
    python3 lab/probes/replay_ticks.py --model random:smollm2-135m:layers=2:vocab=4096 --concurrency 4 --new-tokens 16 \
        --prompt-len 32 --requests-per-client 2   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from lab.common import add_staggered_args, staggered_setup  # noqa: E402


def record(llm) -> list:
    """Wrap the runner's launch: every launched step's (kind, shape, packed input copy, filtered, lora) and telemetry."""
    runner, steps = llm.engine.runner, []
    launch = runner.launch

    def spy(step, **kw):
        inp = step.input
        packed = None if inp.packed is None else inp.packed.copy()  # (None: carried by a sampler, not replayed)
        steps.append((step.record, inp.shape, packed))
        return launch(step, **kw)

    runner.launch = spy
    return steps


def replay(runner, steps: list, rounds: int = 3) -> float:
    """Seconds per step of the recorded steps dispatched back to back (best of `rounds`)."""
    import jax

    todo = [(shape, packed) for _, shape, packed in steps if packed is not None]
    best = float("inf")
    for _ in range(rounds):
        jax.block_until_ready(runner.kv)
        t0 = time.perf_counter()
        for shape, packed in todo:
            runner._dispatch_into(runner._take_slot(), shape, packed)
        jax.block_until_ready(runner.kv)
        best = min(best, (time.perf_counter() - t0) / max(1, len(todo)))
    return best


def loop_period(steps: list, kind: str | None = None) -> float:
    """Mean launch-to-launch seconds, over the steps of `kind` (each from the launch before it) or all."""
    return statistics.fmean(b[0].t_launched - a[0].t_launched for a, b in zip(steps, steps[1:], strict=False)
                            if kind is None or b[0].kind == kind)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_staggered_args(ap)
    args = ap.parse_args()
    from benchmarks.common import device_info, timed_run
    from benchmarks.serving import engine_staggered

    c = args.concurrency
    llm, prompts, params, duration = staggered_setup(args)  # (every path run once)
    out = {"device": device_info(), "args": vars(args), "scenarios": {}}
    for scenario in ("static", "staggered"):
        steps = record(llm)
        if scenario == "static":
            timed_run(llm, prompts[:c], params)
        else:
            engine_staggered(llm, prompts, args.new_tokens, c, args.requests_per_client, duration)
        del llm.engine.runner.launch
        decode = [s for s in steps if s[0].kind == "decode"]
        res = {"steps": len(steps), "decode_steps": len(decode),
               "kinds": {k: sum(s[0].kind == k for s in steps) for k in ("decode", "mixed", "prefill")},
               "loop_ms": 1e3 * loop_period(steps), "replay_ms": 1e3 * replay(llm.engine.runner, steps),
               "decode_loop_ms": 1e3 * loop_period(steps, "decode"),
               "decode_replay_ms": 1e3 * replay(llm.engine.runner, decode)}
        out["scenarios"][scenario] = res
        print(scenario, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}),
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
