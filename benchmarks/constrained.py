"""Constrained vs free decoding throughput, pipelined (depth 2), closed loop of N streams, for two constraints: a
JSON schema and a regex shaped like spatial output (a list of x,y coordinates, as Moondream's point skill emits).

Each constrained run goes first; the free run then replays the same prompts with max_tokens set to the lengths the
constrained run produced, so both decode the same number of tokens per request and the ratio isolates the cost of the
grammar: mask building on the host, the deferred (masked) sampler, and any GPU idle they cause. Outputs cut by
max_tokens before the constraint closed are counted apart (`truncated`); `valid` counts complete, valid outputs.

  tok/s            generated tokens over the whole run, and its ratio schema / free (target >= 0.9 at 32 streams)
  period           median launch-to-launch interval of decode-only steps
  device           the decode step's forward + sampler dispatched back to back with no host work (free: fused
                   sampler; schema: fused + the masked sampler)
  idle             period - device: what the GPU waits per step
  mask             median time to fill the step's bitmasks (llguidance, parallel over rows)
  paths            device: each constraint's automaton in the device tables, sampled inside the step (the default
                   engine); host: llguidance's masks built on the host, sampled after the previous commit
  host             median host time per step: plan + launch + commit + finalize

    python benchmarks/constrained.py --model random:llama3.2-1b:vocab=49152 \
        --tokenizer benchmarks/assets/smollm2-tokenizer --streams 1 8 32 --out DIR
The tokenizer directory (git-ignored) is written from the embedded model when it is missing and the embedded model is
installed; on a machine without it, write it first and carry it:
    python benchmarks/constrained.py --export-tokenizer benchmarks/assets/smollm2-tokenizer
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import re
import statistics
import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import (  # noqa: E402
    QUICK,
    closed_loop,
    default_llm,
    device_info,
    write_json,
)
from benchmarks.llm_args import add_llm_args, parse_llm_args  # noqa: E402
from jphoton import SamplingParams  # noqa: E402

PROMPT = 64

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma", "delta"]}, "maxItems": 6},
        "active": {"type": "boolean"},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["id", "name", "tags", "active", "address"], "additionalProperties": False,
}
MAX_TOKENS = 160
# up to 16 points, e.g. [12,407;88,5]; [0-9], not \d: \d is any Unicode digit to llguidance (and to Python's re, by
# an older Unicode table), and a random model picks NKo and fullwidth digits
COORDS = r"\[[0-9]{1,3},[0-9]{1,3}(;[0-9]{1,3},[0-9]{1,3}){0,15}\]"


PHASES = {  # host phases of a step: (start, end) telemetry fields
    "plan": ("t_plan", "t_planned"), "launch": ("t_launch", "t_launched"), "wait": ("t_commit", "t_ready"),
    "commit": ("t_ready", "t_committed"),
    "mask_fill": ("t_finalize", "t_masked"), "sampler_dispatch": ("t_masked", "t_finalized"),
}


def summarize(run: dict, timeline: list[dict]) -> dict:
    decode = [r for r in timeline if r["kind"] == "decode"]
    guided = [r for r in timeline if r["constrained_rows"]]
    on_device = [r for r in timeline if r.get("automaton_rows") and not r["constrained_rows"]]

    def span(r, phase):
        a, b = PHASES[phase]
        return r[b] - r[a] if r.get(a) and r.get(b) else 0.0

    host = [sum(span(r, p) for p in PHASES if p != "wait") for r in decode]
    phases = {p: 1e3 * statistics.median([span(r, p) for r in decode]) for p in PHASES} if decode else {}
    return dict(tok_s=run["tok_s"], tokens=run["tokens"], period_ms=run["period_ms"],
                host_ms=1e3 * statistics.median(host), phases_ms=phases,
                mask_ms=1e3 * statistics.median([span(r, "mask_fill") for r in guided]) if guided else 0.0,
                finalize_ms=1e3 * statistics.median([r["t_finalized"] - r["t_finalize"] for r in guided])
                if guided else 0.0, steps=run["steps"], constrained_steps=len(guided), automaton_steps=len(on_device),
                mean_period_ms=run["mean_period_ms"], wall_s=run["wall_s"],
                kind_periods_ms={k: (n, round(1e3 * p, 3)) for k, (n, p) in run["kind_periods"].items()})


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b:vocab=49152")
    ap.add_argument("--tokenizer", default="benchmarks/assets/smollm2-tokenizer")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-stream", type=int, default=3)
    ap.add_argument("--out", default=".")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="engine option (default: LLM's, or the streams)")
    ap.add_argument("--export-tokenizer", metavar="DIR", help="write the embedded model's tokenizer to DIR and exit")
    ap.add_argument("--constraints", nargs="+", default=["schema", "coords"], choices=["schema", "coords"])
    ap.add_argument("--timelines", action="store_true", help="write each run's step timeline to --out")
    ap.add_argument("--paths", nargs="+", default=["device", "host"], choices=["device", "host"],  # (may repeat)
                    help="device: automata sampled in the step (the default engine; the first is the row's 'schema'); "
                         "host: llguidance's masks on the host")
    add_llm_args(ap)
    args = ap.parse_args(argv)
    if args.export_tokenizer:
        return export_tokenizer(args.export_tokenizer)
    if QUICK:
        args.streams, args.requests_per_stream = [max(args.streams)], 1
    if not (pathlib.Path(args.tokenizer) / "tokenizer.json").exists():
        export_tokenizer(args.tokenizer)
    info = device_info()
    print(info, flush=True)
    n_max = max(args.streams)
    extra = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}  # fewer step shapes (the CPU smoke test)
    extra.update(parse_llm_args(args.llm_args))
    if "device" in args.paths:
        extra.setdefault("automaton_states", 1024)  # device automata (the default; docs/constrained.md)
    llm = default_llm(args.model, n_max, dtype=args.dtype, tokenizer=args.tokenizer, **extra)
    constraint = {"schema": dict(json_schema=json.dumps(SCHEMA)), "coords": dict(regex=COORDS)}
    rows, samples = [], []
    for kind in args.constraints:
        for n in args.streams:
            def guided(i, kind=kind):
                return SamplingParams(max_tokens=args.max_tokens, temperature=0, **constraint[kind])

            runs = {}
            for k, path in enumerate(args.paths):  # device automata (the default engine) / llguidance's host masks
                label = path if path not in args.paths[:k] else f"{path}{args.paths[:k].count(path) + 1}"
                with _masks(llm, path, guided(0)):
                    # warm both paths: a step program's first runs in a process cost more than later ones (the first
                    # free closed loop ran at 0.2-0.4x of the same loop later, 2026-11-27)
                    closed_loop(llm, n, 1, seed=99, prompt_len=PROMPT, make_params=guided)
                    closed_loop(llm, n, 1, seed=98, prompt_len=PROMPT, lengths=(40, 60))
                    runs[label] = closed_loop(llm, n, args.requests_per_stream, seed=n, prompt_len=PROMPT,
                                              make_params=guided)
            g = runs[args.paths[0]]
            lengths = g["lengths"]
            done = [o for o in g["outputs"] if o["finish_reason"] == "stop"]
            valid = sum(_is_valid(kind, o["text"]) for o in done)
            samples += [o["text"] for o in g["outputs"][:2]]
            # requests whose tokens differ from the first path's (bf16 on a GPU: a closed loop's batches differ from
            # run to run, and a near tie can flip; repeat a path, e.g. --paths device host device, to see that noise)
            differ = {label: sum(a["token_ids"] != b["token_ids"] for a, b in zip(g["outputs"], r["outputs"],
                                                                                  strict=True))
                      for label, r in runs.items()}

            def free(i, lengths=lengths):
                return SamplingParams(max_tokens=max(1, lengths[i]), temperature=0, ignore_eos=True)

            f = closed_loop(llm, n, args.requests_per_stream, seed=n, prompt_len=PROMPT, make_params=free)
            fs = summarize(f, f["timeline"])
            by_path = {path: summarize(r, r["timeline"]) for path, r in runs.items()}
            gs = by_path[args.paths[0]]
            dev_free, dev_guided = llm.device_step_ms(n), llm.device_step_ms(n, sampler="masked")
            dev_filtered = llm.device_step_ms(n, sampler="filtered")
            row = dict(constraint=kind, streams=n, paths=list(args.paths), schema=gs, free=fs,
                       ratio=gs["tok_s"] / fs["tok_s"], requests_differing=differ,
                       device_free_ms=dev_free, device_schema_ms=dev_guided, device_filtered_ms=dev_filtered,
                       idle_free_ms=max(0.0, fs["period_ms"] - dev_free),
                       idle_schema_ms=max(0.0, gs["period_ms"] - dev_guided), mean_len=float(np.mean(lengths)),
                       valid=valid, truncated=len(g["outputs"]) - len(done), requests=len(g["outputs"]))
            for path, ps in by_path.items():
                row[path] = ps
                row[f"ratio_{path}"] = ps["tok_s"] / fs["tok_s"]
            rows.append(row)
            if args.timelines:  # every step's host timestamps (engine/telemetry.py), for benchmarks/plot_timeline.py
                for label, r in [*runs.items(), ("free", f)]:
                    write_json(f"{args.out}/timeline_{kind}_{n}_{label}.json", r["timeline"])
            for path, ps in by_path.items():
                print(f"{kind} {n:2d} streams, {path} masks: {ps['tok_s']:.0f} tok/s vs free {fs['tok_s']:.0f} tok/s "
                      f"= {ps['tok_s'] / fs['tok_s']:.1%}; period {ps['period_ms']:.3f} vs {fs['period_ms']:.3f} ms; "
                      f"device steps: free {dev_free:.3f}, filtered variant {dev_filtered:.3f}, + masked sampler "
                      f"{dev_guided:.3f} ms; steps sampled on the device {ps['automaton_steps']}/{ps['steps']}, at "
                      f"finalize {ps['constrained_steps']}; mean period {ps['mean_period_ms']:.3f} vs "
                      f"{fs['mean_period_ms']:.3f} ms, by kind {ps['kind_periods_ms']} vs {fs['kind_periods_ms']}; "
                      f"mask {ps['mask_ms']:.3f} ms, host {ps['host_ms']:.3f} vs "
                      f"{fs['host_ms']:.3f} ms; phases (ms) { {k: round(v, 3) for k, v in ps['phases_ms'].items()} }",
                      flush=True)
            print(f"{kind} {n:2d} streams: mean len {row['mean_len']:.0f}; valid {valid}/{len(done)} complete, "
                  f"{row['truncated']} truncated; requests whose tokens differ from the first path's: {differ}",
                  flush=True)
    print("sample outputs:", *samples[:3], sep="\n  ")
    write_json(f"{args.out}/constrained.json", {"info": info, "model": args.model, "schema": SCHEMA, "coords": COORDS,
                                                "rows": rows,
                                                "samples": samples[:4]})
    return rows


@contextlib.contextmanager
def _masks(llm, path: str, params: SamplingParams):
    """Serve the constraint from its device automaton (built first) or from llguidance's host masks."""
    states = llm.engine.runner.automaton_states
    if path == "device":
        llm.grammar.compile(params, wait_automaton=True)
    else:
        llm.grammar.use_automata(0)
    try:
        yield
    finally:
        llm.grammar.use_automata(states)


def export_tokenizer(path: str) -> None:
    """Write the embedded model's tokenizer (SmolLM2's) to `path` (needs the embedded model installed)."""
    from jphoton.weights import load_tokenizer

    load_tokenizer(None).save(pathlib.Path(path))
    print(f"wrote the embedded model's tokenizer to {path}", flush=True)


def _is_valid(kind: str, text: str) -> bool:
    if kind == "coords":
        return re.fullmatch(COORDS, text) is not None
    try:
        import jsonschema
    except ImportError:  # the GPU image may lack it: at least parse
        jsonschema = None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if jsonschema is not None:
        try:
            jsonschema.validate(value, SCHEMA)
        except jsonschema.ValidationError:
            return False
    return True


if __name__ == "__main__":
    main()
