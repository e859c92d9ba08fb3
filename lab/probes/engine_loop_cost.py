"""What the engine process's loop adds to a tick beyond `LLM.step` (issue 23: SmolLM2-135M served at 0.75x of the
engine alone, a host-bound engine). The loop (server/engine_loop.py `EngineLoop`) runs in this process with one pipe
pair; a client process sends C greedy requests at once (the static batch of benchmarks/serving.py), reads every event
list, then sends shutdown. The same requests through `LLM.generate` first (the engine alone). Prints the median
decode tick of both and, with --profile, the loop's own functions per tick (cProfile, a second loop run).

    python lab/probes/engine_loop_cost.py --model random:smollm2-135m --concurrency 32 [--profile]
    python lab/probes/engine_loop_cost.py --model random:smollm2-135m:layers=2:vocab=4096 --concurrency 8 \
        --new-tokens 32 --profile   # CPU
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import pickle
import pstats
import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 3)[0])


def client(commands, events, prompts, new_tokens) -> None:
    from jphoton import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        commands.send_bytes(pickle.dumps(("add", i, {"prompt_token_ids": p}, params, None)))
    done = 0
    while done < len(prompts):
        for e in pickle.loads(events.recv_bytes()):
            done += e[0] == "out" and e[4] is not None
    commands.send_bytes(pickle.dumps(("shutdown",)))


def decode_tick_ms(llm) -> float:
    recs = sorted(llm.telemetry.records, key=lambda r: r.step_id)
    ticks = [c.t_launch - b.t_launch for a, b, c in zip(recs, recs[1:], recs[2:], strict=False)
             if a.kind == b.kind == c.kind == "decode"]
    return 1e3 * statistics.median(ticks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    from benchmarks.common import default_llm, device_info
    from jphoton import SamplingParams
    from server.engine_loop import EngineLoop

    print(device_info(), flush=True)
    llm = default_llm(a.model, a.concurrency)
    rng = __import__("numpy").random.default_rng(0)
    prompts = [rng.integers(0, llm.config.vocab_size, a.prompt_len).tolist() for _ in range(a.concurrency)]
    params = SamplingParams(max_tokens=a.new_tokens, temperature=0, ignore_eos=True)
    ctx = mp.get_context("spawn")
    for attempt in ("warm", "timed"):
        llm.telemetry.clear()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        alone = decode_tick_ms(llm)
        runs = (("loop", False), ("loop, profiled", True)) if a.profile and attempt == "timed" else (("loop", False),)
        for name, profiled in runs:
            cmd_recv, cmd_send = ctx.Pipe(duplex=False)
            ev_recv, ev_send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=client, args=(cmd_send, ev_recv, prompts, a.new_tokens))
            proc.start()
            llm.telemetry.clear()
            loop = EngineLoop(llm, [(cmd_recv, ev_send)])
            prof = cProfile.Profile() if profiled else None
            if prof:
                prof.enable()
            loop.run()
            if prof:
                prof.disable()
            proc.join()
            ticks = len([r for r in llm.telemetry.records if r.kind == "decode"])
            print(f"{attempt}: engine alone {alone:.3f} ms a decode tick; {name} {decode_tick_ms(llm):.3f} ms "
                  f"({ticks} decode ticks)", flush=True)
            if prof:
                stats = pstats.Stats(prof)
                stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
