"""Tensor parallelism (issue 29, docs/tensor-parallel.md) on one host's devices, in one process.

    python benchmarks/tensor_parallel.py check --model random:llama3.2-1b:layers=4 --tp 2 --out tp_check.json
    python benchmarks/tensor_parallel.py steps --model random:llama3-8b --tp 2 --out tp_steps.json
    python benchmarks/tensor_parallel.py big --model random:llama3-70b --tp 2 --out tp_big.json

check: greedy tokens of TP=N against TP=1 on the engine's default paths (on a GPU: Pallas attention and GEMVs, run per
  shard under shard_map), per dtype. Random weights are the same model at any TP (weights/random_init.py: values depend
  only on seed, leaf and layer), so the tokens must match; where they do not, the first divergence is reported.
steps: device step time of B-row decode steps over C-token contexts, TP=1 against TP=N (ratios), and served tok/s
  (B requests queued at once, greedy, untimed first run so nothing compiles while timed).
big: a model too large for one device loads on N and serves: load time, step times, served tok/s at each batch.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import logging
import shutil
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import QUICK, device_info, timed_run, write_json  # noqa: E402
from jphoton import LLM, SamplingParams  # noqa: E402


def _prompts(vocab: int, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab, length).tolist() for _ in range(batch)]


def check(args) -> dict:
    results = {}
    for dtype in args.dtypes:
        # float32 is compared at full matmul precision: XLA:GPU's default runs float32 dots in TF32, whose rounding
        # depends on how K is split (TP splits it), which alone flips near-tied argmaxes of random weights
        precision = "highest" if dtype == "float32" else None
        tokens = {}
        for tp in (1, args.tp):
            with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
                llm = LLM(args.model, tensor_parallel_size=tp, dtype=dtype, warmup="off", max_num_seqs=args.batch,
                          max_model_len=args.prompt_len + args.new_tokens, kv_memory_fraction=0.3, freeze_gc=False)
                prompts = _prompts(llm.config.vocab_size, args.batch, args.prompt_len)
                out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True))
            tokens[tp] = [o.token_ids for o in out]
            del llm
            gc.collect()  # its weights and KV pool go before the next engine's
        first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                 for x, y in zip(tokens[1], tokens[args.tp], strict=True)]
        results[dtype] = {"equal": tokens[1] == tokens[args.tp], "first_divergence": first, "precision": precision,
                          "tokens_compared": sum(map(len, tokens[1]))}
        print(dtype, results[dtype], flush=True)
    return results


def memory(llm, label: str) -> dict:
    """GPU memory by source: JAX's pool (in use, reserved from the device) and the whole device (nvidia-smi): what
    lies outside the pool is CUDA's, NCCL's, XLA's collective scratch and the loaded programs'."""
    stats = [d.memory_stats() or {} for d in llm.engine.runner.mesh.devices.flat] if llm.engine.runner.mesh else []
    q = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    out = {"label": label, "gib_in_use": [round(m.get("bytes_in_use", 0) / 2**30, 2) for m in stats],
           "gib_pool": [round(m.get("pool_bytes", m.get("bytes_reserved", 0)) / 2**30, 2) for m in stats],
           "gib_peak": [round(m.get("peak_bytes_in_use", 0) / 2**30, 2) for m in stats],
           "gib_device_used": [round(int(x) / 1024, 2) for x in q.stdout.split()] if q and q.returncode == 0 else []}
    print("memory", out, flush=True)
    return out


def _served(llm, batches, prompt_len, new_tokens, mem=None) -> list[dict]:
    runs = []
    for b in batches:
        prompts = _prompts(llm.config.vocab_size, b, prompt_len, seed=b)
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        timed_run(llm, prompts, params)  # compiles the shapes this batch uses (untimed)
        r = timed_run(llm, prompts, params)
        runs.append({"batch": b, "tok_s": r.tok_s, "decode_ms": r.decode_ms_median, "ttft_ms": r.ttft_ms_median,
                     "compiles": r.compiles_during_run})
        print(runs[-1], flush=True)
        if mem is not None:
            mem.append(memory(llm, f"served B={b}"))
    return runs


def steps(args) -> dict:
    out = {}
    for tp in (1, args.tp):
        llm = LLM(args.model, tensor_parallel_size=tp, warmup="off", max_num_seqs=max(args.batches),
                  max_model_len=max(2 * args.context, args.prompt_len + args.new_tokens), kv_memory_fraction=0.3,
                  freeze_gc=False)
        arm = {"step_ms": {}, "served": []}
        for b in args.batches:
            llm.device_step_ms(b, context=args.context, steps=3)  # compile
            arm["step_ms"][b] = statistics.median(llm.device_step_ms(b, context=args.context, steps=args.steps)
                                                  for _ in range(3))
            print(f"tp={tp} B={b} step {arm['step_ms'][b]:.3f} ms", flush=True)
        arm["served"] = _served(llm, args.batches, args.prompt_len, args.new_tokens)
        out[tp] = arm
        del llm
        gc.collect()
    ratios = {b: out[args.tp]["step_ms"][b] / out[1]["step_ms"][b] for b in args.batches}
    print("step TP/TP1:", ratios, flush=True)
    return {"arms": out, f"step_tp{args.tp}_over_tp1": ratios}


def big(args) -> dict:
    t0 = time.perf_counter()
    llm = LLM(args.model, tensor_parallel_size=args.tp, warmup="off", max_num_seqs=max(args.batches),
              max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
              **({"unroll_layers": False} if args.scan else {}))
    load_s = time.perf_counter() - t0
    mem = [d.memory_stats() or {} for d in llm.engine.runner.mesh.devices.flat] if args.tp > 1 else []
    arrays = collections.Counter()  # what the live arrays account for, per device (vs the allocator's count)
    for a in jax.live_arrays():
        for s in a.addressable_shards:
            arrays[s.device.id] += s.data.nbytes
    print(f"loaded in {load_s:.1f} s; per device bytes in use:", [m.get("bytes_in_use") for m in mem],
          "in live arrays:", dict(arrays), flush=True)
    res = {"load_s": load_s, "bytes_in_use": [m.get("bytes_in_use") for m in mem], "array_bytes": dict(arrays),
           "bytes_limit": [m.get("bytes_limit") for m in mem], "kv_pages": llm.engine_config.num_kv_pages,
           "step_ms": {}, "memory": [memory(llm, "loaded")]}
    for b in args.batches:
        llm.device_step_ms(b, context=args.context, steps=3)
        res["step_ms"][b] = llm.device_step_ms(b, context=args.context, steps=args.steps)
        print(f"B={b} step {res['step_ms'][b]:.3f} ms", flush=True)
        res["memory"].append(memory(llm, f"steps B={b}"))
    res["served"] = _served(llm, args.served_batches or args.batches, args.prompt_len, args.new_tokens, res["memory"])
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("check", "steps", "big"))
    ap.add_argument("--model", default="random:llama3.2-1b:layers=4")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="check: dtypes compared")
    ap.add_argument("--batch", type=int, default=8, help="check: prompts")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="steps, big: batch sizes")
    ap.add_argument("--context", type=int, default=512, help="tokens each row of the timed steps attends over")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024, help="big: context length")
    ap.add_argument("--scan", action="store_true", help="big: scanned layers (shorter compiles)")
    ap.add_argument("--served-batches", type=int, nargs="*", default=None, help="big: served runs (default: --batches)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="big: tokens per step (prefill chunks)")
    ap.add_argument("--out", default="tensor_parallel.json")
    args = ap.parse_args(argv)
    if QUICK:
        args.steps, args.new_tokens = min(args.steps, 5), min(args.new_tokens, 16)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("jphoton").setLevel(logging.INFO)
    info = device_info()
    info["devices"] = len(jax.devices())
    print(info, flush=True)
    result = {"check": check, "steps": steps, "big": big}[args.what](args)
    write_json(args.out, {"device": info, "args": vars(args), "result": result})
    return result


if __name__ == "__main__":
    main()
