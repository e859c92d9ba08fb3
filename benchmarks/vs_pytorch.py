"""Same weights, same prompts, same GPU, one run: jphoton against the PyTorch path (HF transformers).

One random weight set is made once, seeded: a `LlamaForCausalLM` built in torch on the device from a config of the
chosen shape (HF's own random init, normal(0, 0.02); then every RMSNorm weight set to 1 + 0.1 * normal, so a loader
that drops or misplaces a norm cannot hide behind all-ones). jphoton gets exactly those tensors through its own HF
loader (`jphoton/weights/hf.py` `load_hf_dir`: config.json parsing, key mapping, transposes, tie check, stacking)
with no safetensors round-trip: config.json is written to a temp dir, and the loader's `safe_open` reads the torch state
dict (copied to host as bf16 numpy, linear weights transposed on the device first so the loader's transpose hands back
contiguous arrays) instead of a safetensors file.

Processes: the HF rows run first, in this process, with the device to themselves. The jphoton rows then run in a child
process (this script with `--jphoton-child`), which gets the same arrays as raw .npy files in /dev/shm, HF's
config.json and the agreement reference, and measures the read bandwidth: a process where HF's compiled generate ran
was measured to slow the same jphoton step by 5-6% even after torch freed its device memory and stopped its compile
workers (RESULTS.md, 2026-11-24), and a user's engine process holds no torch. `--same-process` runs everything in one
process, as before.

Shapes: `1b` = Llama-3.2-1B (16 layers, hidden 2048, 32/8 heads, head_dim 64, ffn 8192, vocab 128256, tied
embeddings, rope theta 500000 with llama3 scaling as in the real config); `8b` = Llama-3-8B (32 layers, hidden 4096,
32/8 heads, ffn 14336, untied, rope theta 500000); `--smoke`: a 2-layer, hidden-64, vocab-512 Llama on CPU in float32.

Cases: B requests of `--prompt-len` random token ids (default 128), `--new-tokens` each (default 128), greedy, for B
in `--batch`; and, when B=1 is asked for, a context case "ctx512": B=1, prompt `--ctx-prompt` (384) + 128 new tokens.

Rows (`--rows`):
  hf-static          `model.generate` with `cache_implementation="static"`, which transformers 5 compiles itself on
                     GPU (`compile_config`: torch.compile, mode reduce-overhead = CUDA graphs; one compile per B),
                     greedy, exactly N new tokens (EOS disabled, min_new_tokens=N). Warm-up runs first. ms/step =
                     (t(N new tokens) - t(1 new token)) / (N - 1); TTFT = t(1 new token) (prefill of the whole batch);
                     tok/s = B * N / t(N). Medians of `--reps` runs.
  hf-batch           `model.generate_batch` (continuous batching) with `--hf-batch-attn` (default "paged|eager", CUDA
                     graphs on, async batching off: the best that image measured without flash-attn; "paged|sdpa" was
                     ~98 ms/step at 1 request). It is slow, so it runs `--hf-batch-new-tokens` (default 64) tokens.
                     One untimed call first (same requests, persistent manager where the version has it); then from
                     per-token timestamps: ms/step = median over requests of (last - first token time) / (n - 1),
                     TTFT = median(first token - request creation), tok/s = tokens / (last token - first creation).
                     generate_batch starts the manager's thread (which builds its batch processor and paged cache)
                     as the requests are queued, so TTFT and tok/s include that start-up (hundreds of ms on CPU);
                     ms/step does not, and `tok_s_from_first_token` leaves it out.
                     Without timestamps (older versions): wall-clock numbers, marked in the row.
  jphoton-blocking   LLM(pipeline_depth=1), the engine's serving path (`benchmarks/common.py` timed_run: all requests
  jphoton-pipelined  added at once, greedy, ignore_eos, `LLM.step()` to the end): ms/step = median time of the step()
                     calls that launched a decode step; TTFT = median time to first token; tok/s = tokens / wall. One
                     engine per row, on the same weights (pipelined first; the second finds its compiled steps in the
                     persistent XLA cache). Buckets are exactly what the cases need: decode buckets = the section's
                     B values, prefill buckets (1, P) and (min(8, max B), P), one context bucket; the shapes are
                     compiled by an untimed warm-up run of each case (so `compiles_during_run` should be 0).
                     Default attention / matmul of the GPU. Pipelined rows also carry `device_step_ms`: the same decode step
                     dispatched back to back with no host work between (`LLM.device_step_ms`; every row of the
                     bucket at the median tick's context), and `tick_over_device_step` (1.0 = device-bound).
Every row also reports decode tok/s = B / ms_step and the floor = (weight bytes + KV bytes at the mean context) / read
bandwidth, the bandwidth measured in the same run (`jnp.sum` over an 8 GiB bf16 array, benchmarks/common.py), and
step / floor.

Agreement (in every run with a jphoton row): for `--agree` prompts of the main prompt length, the log-probabilities of
the first generated token's top 20 (jphoton's `SamplingParams(logprobs=20)`) against HF's log-softmax of the last
prompt position's logits (eager forward) at the same ids, max |d|, and the number of matching leading tokens of the
first 32 greedy tokens per prompt (HF eager `generate` vs the engine). Near-ties in bf16 random weights may diverge:
reported, not asserted.

Output: `--out DIR`: vs_pytorch_TAG.json (rows written as they finish, so a time-boxed run keeps what it measured), a
markdown table on stdout and vs_pytorch_TAG.png (ms/step and decode tok/s vs B per row, one column per shape).
`--merge A.json B.json ... --out DIR --tag all` joins sections into one table and plot.

    python benchmarks/vs_pytorch.py --shape 1b --batch 1 8 32 128 --out /tmp/vs
    python benchmarks/vs_pytorch.py --smoke --out /tmp/vs-smoke          # CPU, float32, needs torch + jax together
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import time
from unittest import mock

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU in this process

import numpy as np  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.vs_pytorch_handoff import handoff_dir, read_handoff, write_handoff  # noqa: E402
from benchmarks.vs_pytorch_hf import (  # noqa: E402
    SHAPES,
    build_hf_model,
    hf_batch_case,
    hf_reference,
    hf_static_case,
    torch_state_to_host,
)
from benchmarks.vs_pytorch_report import ROWS, add_floor, matching_lead, merge, plot, table, write  # noqa: E402

log = logging.getLogger("vs_pytorch")

JPHOTON_PRESET = {"1b": "llama3.2-1b", "8b": "llama3-8b"}  # the random:NAME shapes the other benchmarks use


# ---- the weights handed to jphoton ------------------------------------------------------------------------------------
def jphoton_params_from_host(config_json: str, arrays: dict, dtype):
    """jphoton's HF loader on these arrays: config.json (HF's `to_json_string()`) from a temp dir, tensors from memory
    instead of safetensors."""
    from jphoton.models.llama import check_params
    from jphoton.weights import hf

    class _InMemory:  # the slice of safetensors.safe_open the loader uses
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def keys(self):
            return list(arrays)

        def get_tensor(self, key):
            return arrays[key]

    with tempfile.TemporaryDirectory() as tmp:
        (pathlib.Path(tmp) / "config.json").write_text(config_json)
        with mock.patch.object(hf, "safe_open", _InMemory), \
                mock.patch.object(hf, "safetensors_files", lambda path: [path / "state_dict (in memory)"]):
            cfg, params = hf.load_hf_dir(pathlib.Path(tmp), dtype)
    check_params(cfg, params)
    return cfg, params


def check_against_preset(shape: str, cfg) -> list[str]:
    """Fields where the parsed config differs from jphoton's random:NAME preset of the same shape (should be none)."""
    if shape not in JPHOTON_PRESET:
        return []
    from jphoton.weights.random_init import PRESETS

    ref = PRESETS[JPHOTON_PRESET[shape]]
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "rms_norm_eps", "rope_theta", "rope_scaling", "tie_embeddings")
    return [f"{f}: {getattr(cfg, f)} vs preset {getattr(ref, f)}" for f in fields if getattr(cfg, f) != getattr(ref, f)]


# ---- jphoton rows ---------------------------------------------------------------------------------------------------
def make_model(cfg, params, matmul: str):
    """What LLM(model=DIR) builds from a loaded checkpoint."""
    import jax

    from jphoton.models.protocol import llama_family

    return llama_family(cfg, params, None, f"vs_pytorch:{cfg.name}", unroll_layers=jax.default_backend() != "cpu",
                        matmul=matmul, fuse=True)


def make_llm(model, batches: list[int], prompt_len: int, max_len: int, args, depth: int):
    from jphoton import LLM

    max_b = max(batches)
    rows = min(8, max_b)
    prefill = tuple(sorted({(1, prompt_len), (rows, prompt_len)}))
    page = 16
    return LLM(model, max_model_len=max_len, pipeline_depth=depth, page_size=page,
               num_kv_pages=max(max_b, args.agree) * -(-max_len // page) + 8, max_num_seqs=max_b,
               decode_buckets=tuple(sorted(set(batches))), prefill_buckets=prefill,
               max_num_batched_tokens=rows * prompt_len + max_b, attention=args.attention, warmup=False,
               progress=False)


def jphoton_first_logprobs(llm, prompts: list[list[int]], k: int = 20) -> list[dict[int, float]]:
    """{token id: logprob} of the top k of each prompt's first generated token (greedy)."""
    from jphoton import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=k))
    return [o.logprobs[0][2] for o in outs]


def jphoton_greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from jphoton import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def logprob_errors(ours: list[dict[int, float]], ref_logits: np.ndarray) -> list[float]:
    """max |logprob - HF log-softmax| over each prompt's top ids."""
    out = []
    for lp, logits in zip(ours, ref_logits, strict=True):
        x = logits.astype(np.float64)
        ref = x - x.max() - np.log(np.exp(x - x.max()).sum())
        out.append(float(max(abs(v - ref[i]) for i, v in lp.items())))
    return out


def agreement(ref: dict, llm, prompts: list[list[int]]) -> dict:
    ours = jphoton_first_logprobs(llm, prompts)
    err = logprob_errors(ours, ref["logits"])
    first_same = [max(o, key=o.get) == int(np.argmax(r)) for o, r in zip(ours, ref["logits"], strict=True)]
    toks = jphoton_greedy(llm, prompts, ref["tokens"].shape[1])
    out = dict(prompts=len(prompts), logprob_abs_err=err, logprob_abs_err_max=max(err), first_token_same=first_same,
               greedy_tokens=ref["tokens"].shape[1],
               greedy_matching_lead=[matching_lead(m, r) for m, r in zip(toks, ref["tokens"].tolist(), strict=True)])
    if "logits_fp32" in ref:  # each bf16 implementation against the float32 run of the same weights
        f32, t32 = ref["logits_fp32"], ref["tokens_fp32"].tolist()
        hf_top = [dict.fromkeys(o, 0.0) for o in ours]  # the same ids, HF's values
        for d, logits in zip(hf_top, ref["logits"], strict=True):
            x = logits.astype(np.float64)
            lse = x.max() + np.log(np.exp(x - x.max()).sum())
            for i in d:
                d[i] = float(x[i] - lse)
        out.update(
            jphoton_vs_fp32_logprob_err=logprob_errors(ours, f32), hf_bf16_vs_fp32_logprob_err=logprob_errors(hf_top, f32),
            jphoton_vs_fp32_greedy_lead=[matching_lead(m, r) for m, r in zip(toks, t32, strict=True)],
            hf_bf16_vs_fp32_greedy_lead=[matching_lead(m, r) for m, r in zip(ref["tokens"].tolist(), t32, strict=True)])
    return out


def jphoton_case(llm, prompts: list[list[int]], new_tokens: int, depth: int) -> dict:
    from benchmarks.common import timed_run
    from jphoton import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    timed_run(llm, prompts, params, guard=False)  # untimed twin: compiles exactly the shapes this case steps through
    warm = time.perf_counter() - t0
    r = timed_run(llm, prompts, params)
    out = dict(ms_step=r.decode_ms_median, ms_step_mean=r.decode_ms_mean, ttft_ms=r.ttft_ms_median, tok_s=r.tok_s,
               wall_s=r.wall_s, new_tokens=new_tokens, decode_steps=r.decode_steps,
               compiles_during_run=r.compiles_during_run, warmup_s=warm, slowest_ticks=r.slowest_ticks, gc_ms=r.gc_ms,
               gc_ticks=r.gc_ticks)
    if depth == 2:  # the same decode step back to back, no host work between: how device-bound the pipeline is
        context = len(prompts[0]) + new_tokens // 2  # the median tick's context (every row of the bucket gets it)
        out["device_step_ms"] = llm.device_step_ms(len(prompts), context=context, steps=30)
        out["tick_over_device_step"] = out["ms_step"] / out["device_step_ms"]
        log.info("pipelined tick %.3f ms, the same step back to back %.3f ms (%d rows, context %d): %.3fx",
                 out["ms_step"], out["device_step_ms"], len(prompts), context, out["tick_over_device_step"])
    return out


def _child_processes() -> int:
    """Live child processes of this one (Linux /proc; 0 elsewhere)."""
    me, n = str(os.getpid()), 0
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                n += f.read().rsplit(")", 1)[1].split()[1] == me
        except (OSError, IndexError):
            pass
    return n


# ---- the jphoton rows in a process of their own ------------------------------------------------------------------------
def run_child(d: pathlib.Path, timeout: float) -> dict:
    """This script again, `--jphoton-child d` and the same arguments: the jphoton rows in a fresh process (no torch
    state; RESULTS.md 2026-11-24: the same jphoton step ran 5-6% slower in a process where HF's compiled generate had
    run, with torch's device memory freed and its compile workers stopped). Returns the child's payload."""
    import subprocess

    cmd = [sys.executable, __file__, *sys.argv[1:], "--jphoton-child", str(d)]
    log.info("jphoton rows in a child process: %s", " ".join(cmd))
    subprocess.run(cmd, check=False, timeout=timeout)
    child = d / "child.json"
    if not child.exists():
        raise RuntimeError("the jphoton child process wrote no results (see its log above)")
    return json.loads(child.read_text())


def make_cases(args, shape: str, batches: list[int], P: int, N: int, ctx_prompt: int):
    """(label, B, prompts, new tokens) per case, and the agreement prompts: seeded, so the child draws the same."""
    rng = np.random.default_rng(args.seed)
    vocab = SHAPES[shape]["vocab_size"]
    prompts = rng.integers(0, vocab, (max(batches), P)).tolist()
    cases = [(f"B={b}", b, prompts[:b], N) for b in batches]
    if 1 in batches and ctx_prompt:  # right after B=1, so that a time-boxed run reaches it (the headline case)
        cases.insert(1, (f"ctx{ctx_prompt + N}", 1, rng.integers(0, vocab, (1, ctx_prompt)).tolist(), N))
    agree_prompts = rng.integers(0, vocab, (args.agree, P)).tolist() if args.agree else []
    return cases, agree_prompts


def make_recorder(args, payload: dict, shape: str, T0: float, save):
    """record(row, case, fn): runs fn() for one row of one case into payload["results"] (a failure or the time budget
    leaves the other rows), then save(); and over_budget()."""
    results = payload["results"]

    def over_budget() -> bool:
        return bool(args.time_budget) and time.perf_counter() - T0 > args.time_budget

    def record(row: str, case, fn) -> None:
        label, b, ps, n = case
        base = dict(shape=shape, row=row, case=label, batch=b, prompt_len=len(ps[0]), new_tokens=n)
        if over_budget():
            results.append({**base, "skipped": f"time budget {args.time_budget:.0f}s"})
            log.warning("%s %s: skipped (time budget)", row, label)
            return
        t0 = time.perf_counter()
        try:
            r = {**base, **fn()}
        except Exception as e:  # one row failing (an API the installed version lacks, OOM) leaves the others
            log.exception("%s %s failed", row, label)
            r = {**base, "error": f"{type(e).__name__}: {e}"}
        r["section_s"] = time.perf_counter() - t0
        if "ms_step" in r:
            r["decode_tok_s"] = b / (r["ms_step"] / 1e3)
        results.append(r)
        log.info("%s %s: %s", row, label, {k: v for k, v in r.items() if k not in ("options",)})
        save()

    return record, over_budget


def jphoton_rows(args, payload, record, over_budget, out, tag, shape, cases, batches, P, jdtype, agree_prompts,
                 jp_rows, config_json, arrays, ref, smoke) -> float:
    """Measure the read bandwidth, then the jphoton rows (and the agreement check) into payload via `record`;
    returns the bandwidth."""
    from benchmarks.common import device_info, read_bandwidth

    payload["info"].update(device_info())
    bw = read_bandwidth(gib=1 / 16 if smoke else 8.0, reps=3 if smoke else 10)
    payload["read_bandwidth_Bps"] = bw
    log.info("read bandwidth %.2f TB/s", bw / 1e12)

    if jp_rows:
        t = time.perf_counter()
        cfg, params = jphoton_params_from_host(config_json, arrays, jdtype)
        import jax

        jax.block_until_ready(params)
        arrays.clear()
        gc.collect()
        payload["handoff"]["jphoton_load_s"] = time.perf_counter() - t
        diffs = check_against_preset(shape, cfg)
        payload["config_vs_preset"] = diffs
        payload["jphoton_config"] = json.loads(cfg.to_json())
        if diffs:
            log.warning("parsed config differs from jphoton's preset: %s", diffs)
        log.info("weights handed to jphoton: %s", payload["handoff"])
        max_len = max(len(c[2][0]) + c[3] for c in cases)
        if ref is not None:
            max_len = max(max_len, P + args.greedy_tokens)
        model = make_model(cfg, params, args.matmul)
        del params

        def check_agreement(llm, key: str) -> None:
            if ref is None or over_budget():
                return
            try:
                payload[key] = agreement(ref, llm, agree_prompts)
            except Exception as e:
                log.exception("%s check failed", key)
                payload[key] = {"error": f"{type(e).__name__}: {e}"}
            log.info("%s: %s", key, payload[key])
            write(out, tag, payload)

        for row in sorted(jp_rows, key=lambda r: r != "jphoton-pipelined"):  # pipelined first: the headline row
            depth = 1 if row == "jphoton-blocking" else 2
            t = time.perf_counter()
            llm = make_llm(model, batches, P, max_len, args, depth)
            payload["handoff"][f"llm_build_s_depth{depth}"] = time.perf_counter() - t
            if "agreement" not in payload:
                check_agreement(llm, "agreement")
            for case in cases:
                record(row, case, lambda c=case, llm=llm, depth=depth: jphoton_case(llm, c[2], c[3], depth))
            del llm
            gc.collect()

    return bw


def jphoton_child(args, shape, batches, P, N, ctx_prompt) -> None:
    """`--jphoton-child DIR`: the jphoton rows of the parent's run, from its handoff; the payload to DIR/child.json."""
    d = pathlib.Path(args.jphoton_child)
    from benchmarks.common import write_json

    config_json, arrays, ref, h = read_handoff(d)
    args.time_budget = h["budget_left"]
    T0 = time.perf_counter()
    cases, agree_prompts = make_cases(args, shape, batches, P, N, ctx_prompt)
    payload = dict(info={}, results=[], handoff={})
    record, over_budget = make_recorder(args, payload, shape, T0, lambda: write_json(d / "child.json", payload))
    jp_rows = [r for r in ("jphoton-blocking", "jphoton-pipelined") if r in args.rows]
    if ref is None and agree_prompts:
        payload["agreement"] = {"error": "no HF reference (see the parent's log)"}
    jphoton_rows(args, payload, record, over_budget, d, "child", shape, cases, batches, P, h["dtype"], agree_prompts,
                 jp_rows, config_json, arrays, ref, args.smoke)
    write_json(d / "child.json", payload)


# ---- main -----------------------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("1b", "8b"), default="1b")
    ap.add_argument("--smoke", action="store_true", help="tiny Llama on CPU in float32 (checks the plumbing)")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="default 1 8 32 128 (smoke: 1 4)")
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 (smoke: 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 (smoke: 8)")
    ap.add_argument("--ctx-prompt", type=int, default=None,
                    help="prompt of the B=1 context case (default 384, i.e. context 512 with 128 new tokens; 0: off)")
    ap.add_argument("--hf-batch-new-tokens", type=int, default=64)
    ap.add_argument("--hf-batch-attn", default="paged|eager")
    ap.add_argument("--agree", type=int, default=4, help="prompts in the agreement check (0: off)")
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--attention", default="auto", help="jphoton attention (default: the engine's own choice)")
    ap.add_argument("--matmul", default="auto")
    ap.add_argument("--keep-torch-workers", action="store_true",
                    help="leave torch.compile's worker processes running during the jphoton rows (the old behaviour)")
    ap.add_argument("--same-process", action="store_true",
                    help="run the jphoton rows in this process, after HF's (default: a child process of their own)")
    ap.add_argument("--jphoton-child", default=None, help=argparse.SUPPRESS)  # internal: the child's handoff dir
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="auto: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--time-budget", type=float, default=420.0,
                    help="seconds after which cases not yet started are skipped (0: no limit)")
    ap.add_argument("--out", default=".")
    ap.add_argument("--tag", default=None, help="output file suffix (default: the shape)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="join earlier runs' JSON files")
    args = ap.parse_args(argv)
    from benchmarks.common import QUICK

    if QUICK and not args.merge:  # the same rows, one B, fewer tokens and reps
        args.batch, args.new_tokens, args.reps = (args.batch or [1])[:1], 32, 1
        args.agree, args.greedy_tokens, args.ctx_prompt = min(args.agree, 1), 8, 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        merge(args.merge, out, args.tag or "all")
        return
    T0 = time.perf_counter()
    shape = "smoke" if args.smoke else args.shape
    smoke = args.smoke
    batches = sorted(set(args.batch or ([1, 4] if smoke else [1, 8, 32, 128])))
    P = args.prompt_len or (16 if smoke else 128)
    N = args.new_tokens or (8 if smoke else 128)
    ctx_prompt = args.ctx_prompt if args.ctx_prompt is not None else (24 if smoke else 384)
    hf_batch_n = min(args.hf_batch_new_tokens, N)
    tag = args.tag or shape

    if args.jphoton_child:  # no torch in the child: the dtype the parent chose comes with the handoff
        return jphoton_child(args, shape, batches, P, N, ctx_prompt)
    import torch

    if smoke:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    dtype = args.dtype if args.dtype != "auto" else "float32" if device == "cpu" else "bfloat16"
    tdtype, jdtype = getattr(torch, dtype), dtype
    for knob in ("cache_size_limit", "recompile_limit"):  # one compile per B (and per context) of the static cache
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)

    cases, agree_prompts = make_cases(args, shape, batches, P, N, ctx_prompt)
    itemsize = 4 if dtype == "float32" else 2

    t = time.perf_counter()
    model = build_hf_model(shape, device, tdtype, args.seed)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied embedding counted once
    import transformers

    payload = dict(info=dict(torch=torch.__version__, transformers=transformers.__version__, device=device,
                             gpu=torch.cuda.get_device_name() if device == "cuda" else None),
                   args=vars(args), shape=shape, shape_config=SHAPES[shape], weight_bytes=weight_bytes, itemsize=itemsize,
                   results=[], handoff={"hf_build_s": time.perf_counter() - t})
    log.info("HF %s model built on %s in %.1fs (%.2f GB)", shape, device, payload["handoff"]["hf_build_s"],
             weight_bytes / 1e9)
    results = payload["results"]
    record, over_budget = make_recorder(args, payload, shape, T0, lambda: write(out, tag, payload))

    # 1. HF rows, while torch holds the device alone.
    for case in cases:
        if "hf-static" in args.rows:
            record("hf-static", case, lambda c=case, m=model: hf_static_case(m, c[2], c[3], args.reps))
    for case in cases:
        if "hf-batch" in args.rows:
            record("hf-batch", case,
                   lambda c=case, m=model: hf_batch_case(m, c[2], min(hf_batch_n, c[3]), args.hf_batch_attn))
    if hasattr(model, "set_attn_implementation") and model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")

    jp_rows = [r for r in ("jphoton-blocking", "jphoton-pipelined") if r in args.rows]
    ref = None
    if jp_rows and agree_prompts:
        try:
            ref = hf_reference(model, agree_prompts, args.greedy_tokens)
        except Exception as e:
            log.exception("HF reference for the agreement check failed")
            payload["agreement"] = {"error": f"HF reference: {type(e).__name__}: {e}"}

    # 2. Hand the weights over, free torch's device memory, then JAX.
    arrays = None
    if jp_rows:
        t = time.perf_counter()
        arrays = torch_state_to_host(model)
        payload["handoff"]["torch_to_host_s"] = time.perf_counter() - t
    config_json = model.config.to_json_string()
    del model
    gc.collect()
    if device == "cuda":
        torch._dynamo.reset()  # drops the compiled forwards and their CUDA graph memory pools
        gc.collect()
        torch.cuda.empty_cache()
        payload["info"]["torch_gpu_bytes_after_free"] = torch.cuda.memory_reserved()
        if not args.keep_torch_workers:  # torch.compile's worker processes outlive the compiled forwards
            try:
                from torch._inductor.async_compile import shutdown_compile_workers

                shutdown_compile_workers()
            except Exception as e:  # an API the installed torch lacks: say so, go on
                log.warning("could not shut torch's compile workers down: %s", e)
        payload["info"]["children_before_jphoton"] = _child_processes()
        payload["info"]["loadavg_before_jphoton"] = os.getloadavg()
        log.info("before jphoton: %d child processes, load average %s", payload["info"]["children_before_jphoton"],
                 payload["info"]["loadavg_before_jphoton"])

    if jp_rows and not args.same_process:  # the jphoton rows in a fresh process (run_child)
        t = time.perf_counter()
        d = handoff_dir(weight_bytes)
        try:
            left = args.time_budget - (time.perf_counter() - T0) if args.time_budget else 0.0
            write_handoff(d, config_json, arrays, ref, max(left, 1.0) if args.time_budget else 0.0,
                          dtype=jdtype, weight_bytes=weight_bytes)
            del arrays
            gc.collect()
            payload["handoff"]["handoff_write_s"] = time.perf_counter() - t
            child = run_child(d, timeout=(left + 600) if args.time_budget else None)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        results.extend(child.pop("results"))
        payload["info"].update(child.pop("info"))
        payload["handoff"].update(child.pop("handoff"))
        payload.update(child)
        payload["info"]["jphoton_process"] = "child"
        bw = payload["read_bandwidth_Bps"]
    else:
        bw = jphoton_rows(args, payload, record, over_budget, out, tag, shape, cases, batches, P, jdtype, agree_prompts,
                          jp_rows, config_json, arrays, ref, smoke)
        del arrays

    # 3. Floors (the same bandwidth for every row), table, plot.
    for r in results:
        add_floor(r, weight_bytes, SHAPES[shape], bw, itemsize)
    payload["total_s"] = time.perf_counter() - T0
    path = write(out, tag, payload)
    print(f"\n{shape}: weights {weight_bytes / 1e9:.2f} GB, read bandwidth {bw / 1e12:.2f} TB/s, "
          f"jphoton attention {payload.get('attention')}, weight hand-off {payload['handoff']}")
    for key in (k for k in payload if k.startswith("agreement")):
        print(f"{key}: {payload[key]}")
    print(table(results))
    png = out / f"vs_pytorch_{tag}.png"
    print(f"wrote {path}{f' and {png}' if plot(png, results) else ''} in {payload['total_s']:.0f}s")


if __name__ == "__main__":
    main()
