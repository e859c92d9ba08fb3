"""Multi-LoRA (issue 28): what serving adapters costs, against an engine without LoRA, in one process.

Two engines of one model: LoRA off (`LLM(model)`) and LoRA on (`max_loras=N`, N random rank-R PEFT adapters on every
projection loaded). Measured, rounds alternating:
1. device step time of a B-row decode step over C-token contexts: the LoRA-off engine; the LoRA engine with L rows on
   the N adapters (in turn) and B-L base rows (its LoRA variant); the LoRA engine with base rows only (its base variant);
2. served: B requests (prompt P, T new tokens, greedy) queued at once: L of them on the adapters, the rest base, on the
   LoRA engine, vs all base on the LoRA-off engine (tok/s, median decode tick).
Both engines compile only the shapes the runs use (warmup="off", an untimed first run); nothing compiles while timed.

    python benchmarks/lora.py --model random:llama3.2-1b --adapters 4 --rank 16 --batch 32 --out lora.json
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import statistics
import sys
import tempfile

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import QUICK, device_info, timed_run, write_json  # noqa: E402
from jphoton import LLM, SamplingParams  # noqa: E402
from jphoton.models.lora import TARGETS, target_dims  # noqa: E402


def write_random_adapter(path: pathlib.Path, cfg, rank: int, seed: int, std: float = 0.02) -> None:
    """A PEFT LoRA adapter directory with seeded normal A and B on every projection of every layer."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(cfg.num_layers):
        for t, (d_in, d_out) in target_dims(cfg).items():
            kind = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{t}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, d_in)) * std).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((d_out, rank)) * std).astype(np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lora-rows", type=int, default=None, help="rows on adapters (default: 3/4 of the batch)")
    ap.add_argument("--context", type=int, default=512, help="tokens each row of the timed device steps attends over")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", default="lora.json")
    args = ap.parse_args(argv)
    if QUICK:
        args.rounds, args.new_tokens = 1, min(args.new_tokens, 32)
    lora_rows = args.batch * 3 // 4 if args.lora_rows is None else args.lora_rows
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("jphoton").setLevel(logging.INFO)
    info = device_info()
    print(info, flush=True)
    common = dict(max_num_seqs=args.batch, max_model_len=max(2 * args.context, args.prompt_len + args.new_tokens),
                  warmup="off", kv_memory_fraction=0.4, **({"dtype": args.dtype} if args.dtype else {}))
    off = LLM(args.model, **common)
    on = LLM(args.model, max_loras=args.adapters, max_lora_rank=args.rank, **common)
    names = [f"lora{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            write_random_adapter(pathlib.Path(tmp) / name, on.config, args.rank, seed=i)
            on.load_lora(name, pathlib.Path(tmp) / name)

    steps = []
    for rnd in range(args.rounds):
        arms = [("off", off, 0), ("lora_mixed", on, lora_rows), ("lora_base_rows", on, 0)]
        for arm, llm, rows in (arms if rnd % 2 == 0 else arms[::-1]):
            ms = llm.device_step_ms(args.batch, context=args.context, steps=args.steps, lora_rows=rows)
            steps.append({"arm": arm, "round": rnd, "step_ms": ms})
            print(steps[-1], flush=True)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, off.config.vocab_size, args.prompt_len).tolist() for _ in range(args.batch)]
    greedy = dict(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    mixed = [SamplingParams(**greedy, lora=names[i % len(names)] if i < lora_rows else None)
             for i in range(args.batch)]
    base = [SamplingParams(**greedy)] * args.batch
    runs = []
    for rnd in range(args.rounds + 1):  # round 0 compiles (untimed)
        arms = [("off", off, base), ("lora_mixed", on, mixed), ("lora_base_rows", on, base)]
        for arm, llm, params in (arms if rnd % 2 == 0 else arms[::-1]):
            r = timed_run(llm, prompts, params)
            if rnd:
                runs.append({"arm": arm, "round": rnd, "tok_s": r.tok_s, "decode_ms": r.decode_ms_median,
                             "compiles": r.compiles_during_run})
                print(runs[-1], flush=True)

    def med(rows, arm, key):
        return statistics.median(r[key] for r in rows if r["arm"] == arm)

    summary = {f"step_ms_{a}": med(steps, a, "step_ms") for a in ("off", "lora_mixed", "lora_base_rows")}
    summary |= {f"tok_s_{a}": med(runs, a, "tok_s") for a in ("off", "lora_mixed", "lora_base_rows")}
    summary |= {f"decode_ms_{a}": med(runs, a, "decode_ms") for a in ("off", "lora_mixed", "lora_base_rows")}
    summary["step_mixed_over_off"] = summary["step_ms_lora_mixed"] / summary["step_ms_off"]
    summary["step_base_rows_over_off"] = summary["step_ms_lora_base_rows"] / summary["step_ms_off"]
    summary["served_decode_mixed_over_off"] = summary["decode_ms_lora_mixed"] / summary["decode_ms_off"]
    summary["served_decode_base_rows_over_off"] = summary["decode_ms_lora_base_rows"] / summary["decode_ms_off"]
    summary["compiles_while_timed"] = sum(r["compiles"] for r in runs)
    summary["lora_rows"] = lora_rows
    print(summary, flush=True)
    write_json(args.out, {"device": info, "args": vars(args), "summary": summary, "device_steps": steps,
                          "served": runs})
    return summary


if __name__ == "__main__":
    main()
