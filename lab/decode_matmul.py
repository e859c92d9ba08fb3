"""Decode matmuls (issue 8, item 2): XLA (unfused / fused) vs the Pallas GEMV (pallas_kernels/gemv.py) per matmul of
Llama-3.2-1B, and the engine's whole decode step with each matmul path and params layout.

    python lab/decode_matmul.py --out /tmp/dm.json                 # kernels: every shape, M = 1 8 32, sweep
    python lab/decode_matmul.py --part e2e --out /tmp/dm-e2e.json  # the engine step, B = 1 32
    python lab/decode_matmul.py --smoke                            # tiny shapes on the CPU (interpret mode)

kernels: for each matmul of one Llama-3.2-1B layer (bf16) and M activation rows:
    qkv      [M, 2048] @ [2048, 3072]    (XLA unfused: three dots 2048x2048, 2048x512, 2048x512)
    o        [M, 2048] @ [2048, 2048]
    gate_up  [M, 2048] @ [2048, 16384]   (XLA unfused: two dots 2048x8192)
    down     [M, 8192] @ [8192, 2048]
    lm_head  [M, 2048] @ embed[128256, 2048]^T -> float32 (tied, as in the 1B model), also + argmax
paths: xla_unfused (where it applies), xla (fused: one dot), pallas (gemv default_config), and with --sweep up to
--max-configs GEMV configs around the default (one knob at a time: mode, BN, BK, split, warps, stages, unroll) at the
M values in --sweep-m. Timing: one jit runs the matmul 16 times back to back over 16 different weight matrices (16
layers' worth, so the weights come from HBM, not L2; the LM head once per jit); µs per call = wall / calls over
repeated jit calls. TB/s = weight bytes / time, beside the read bandwidth of a `jnp.sum` over a big bf16 array measured
in the same run. err = max|out - ref| / max|ref| against `jnp.dot(..., preferred_element_type=f32)` (layer 0).

e2e: random:llama3.2-1b in the engine (unrolled layers, the default attention), variants matmul kind x params
unfused|fused (--variants), `LLM.device_step_ms` (the real step, back to back, no host work between) at
B = --batch. Only the decode-only shapes are compiled (unrolled 1B: ~30-45 s per shape on a cold cache).

After the run: put the sweep's winners into pallas_kernels/gemv.py `default_config`, and set
jphoton/models/matmul.py GPU_DEFAULT to the kind that wins the e2e step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import sys
import time
import traceback
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import device_info, read_bandwidth, write_json  # noqa: E402
from jphoton.models.matmul import swiglu_of, two_row_dot  # noqa: E402
from pallas_kernels import gemv as gv  # noqa: E402

# name: (K, N, unfused N parts, transposed weight)
SHAPES = {
    "qkv": (2048, 3072, (2048, 512, 512), False),
    "o": (2048, 2048, None, False),
    "gate_up": (2048, 16384, (8192, 8192), False),
    "gate_up_glu": (2048, 16384, None, False),  # [gate | up] with SwiGLU: XLA dot + activation vs the GEMV's epilogue
    "down": (8192, 2048, None, False),
    "lm_head": (2048, 128256, None, True),
}
SMOKE_SHAPES = {
    "qkv": (64, 96, (64, 16, 16), False),
    "gate_up_glu": (64, 160, None, False),
    "down": (160, 48, None, False),
    "lm_head": (64, 300, None, True),
}
LAYERS = 16


def sweep_configs(m: int, k: int, n: int, limit: int) -> list[gv.GemvConfig]:
    """The default and its one-knob neighbours, at most `limit`, the likeliest winners first. The split knobs lead:
    on 2026-11-23 the small matrices (QKV, O: 1.1-1.6 TB/s at M=1) were the furthest from the read bandwidth, and a
    split costs a second kernel (the jnp sum of the partials); BN16 without a split gets as many programs with none."""
    base = gv.default_config(m, k, n)
    r = dataclasses.replace
    cands = [base, r(base, split=base.split * 2), r(base, split=max(1, base.split // 2)),
             r(base, block_n=16, split=1), r(base, block_n=max(16, base.block_n // 2)),
             r(base, block_n=base.block_n * 2), r(base, block_k=base.block_k * 2),
             r(base, block_k=max(16, base.block_k // 2)), r(base, num_warps=8), r(base, num_stages=4),
             r(base, num_stages=2), r(base, unroll=True), r(base, block_n=max(16, base.block_n // 2), split=base.split * 2)]
    if m <= 8:
        cands.append(r(base, mode="dot" if base.mode == "fma" else "fma"))
    out = []
    for c in cands:
        if c not in out:
            out.append(c)
    return out[:limit]


def glu_sweep_configs(m: int, k: int, n: int, limit: int) -> list[gv.GemvConfig]:
    """The SwiGLU-epilogue GEMV has no split-K (the activation needs whole sums): its knobs are the tile shape, warps
    and pipeline depth, one at a time around the default, then the tile shapes with 8 warps."""
    base = dataclasses.replace(gv.default_config(m, k, n), split=1)
    r = dataclasses.replace
    cands = [base, r(base, block_n=32), r(base, block_n=128), r(base, block_k=64), r(base, block_k=256),
             r(base, num_warps=8), r(base, num_stages=4), r(base, num_stages=2), r(base, block_n=32, num_stages=4),
             r(base, block_n=32, block_k=256), r(base, block_n=128, num_warps=8), r(base, block_k=256, num_warps=8),
             r(base, block_n=16), r(base, unroll=True)]
    out = []
    for c in cands:
        if c not in out:
            out.append(c)
    return out[:limit]


def _normal(key, shape, dtype=jnp.bfloat16):
    return jax.jit(lambda k: (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))(key)


def _time(f, args, calls: int, budget_s: float, max_reps: int) -> float:
    """µs per matmul call: f(*args) runs `calls` matmuls; jit calls are issued back to back."""
    jax.block_until_ready(f(*args))  # compile + warm
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    one = time.perf_counter() - t0
    reps = max(2, min(max_reps, int(budget_s / max(one, 1e-6))))
    t0 = time.perf_counter()
    out = None
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return 1e6 * (time.perf_counter() - t0) / (reps * calls)


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


def _paths(x, w, ws, wparts, configs, *, transposed, out_dtype, head, interpret, glu=False) -> dict:
    """path name -> (jitted f, args): each f runs the matmul once per weight matrix (16 layers, or the LM head once).
    glu: the weight is [gate | up] and every path ends in SwiGLU (XLA: the dot, then the activation kernel)."""

    def xla_dot(x, wi):
        wi = wi.T if transposed else wi
        out = jnp.dot(x, wi, preferred_element_type=jnp.float32).astype(out_dtype)
        return swiglu_of(out) if glu else out

    paths = {"xla": (jax.jit(lambda x, ws: [xla_dot(x, wi) for wi in ws]), (x, ws))}
    if x.shape[0] == 1 and not head:  # the engine's "xla" kind: a one-token step as two rows (models/matmul.py)
        paths["xla 2-row"] = (jax.jit(lambda x, ws: [two_row_dot(x, wi).astype(out_dtype) for wi in ws]), (x, ws))
    if wparts:
        paths["xla_unfused"] = (jax.jit(lambda x, wp: [[xla_dot(x, p) for p in ps] for ps in wp]), (x, wparts))
    for c in configs:
        def pallas(x, w, c=c):
            return [gv.gemv(x, w, i, transposed=transposed, out_dtype=out_dtype, glu=glu, config=c,
                            interpret=interpret) for i in range(w.shape[0])]
        paths[f"pallas {c.short()}"] = (jax.jit(pallas), (x, w))
    if head:
        c0 = configs[0]
        paths["xla +argmax"] = (jax.jit(lambda x, ws: [jnp.argmax(xla_dot(x, wi), -1) for wi in ws]), (x, ws))
        paths[f"pallas +argmax {c0.short()}"] = (jax.jit(lambda x, w: [jnp.argmax(gv.gemv(
            x, w, 0, transposed=transposed, out_dtype=jnp.float32, config=c0, interpret=interpret), -1)]), (x, w))
    return paths


def run_kernels(args, bw: float) -> list[dict]:
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    interpret = True if args.smoke else None
    rows = []
    key = jax.random.key(0)
    t_start = time.perf_counter()
    for name in args.shapes or list(shapes):
        K, N, parts, transposed = shapes[name]
        head, glu = name == "lm_head", name == "gate_up_glu"
        calls = L = 1 if head else LAYERS
        key, kw, kx = jax.random.split(key, 3)
        w = _normal(kw, (L, N, K) if transposed else (L, K, N))  # stacked: the Pallas path indexes it
        ws = [w[i] for i in range(L)]  # separate matrices: XLA's dots get plain operands
        wparts = None
        if parts:  # the unfused layout: per layer, separate matrices of the part widths
            bounds = np.cumsum(parts)[:-1].tolist()
            wparts = [jnp.split(wi, bounds, axis=-1) for wi in ws]
        weight_bytes = K * N * w.dtype.itemsize
        out_dtype = jnp.float32 if head else jnp.bfloat16
        for m in args.m:
            x = _normal(jax.random.fold_in(kx, m), (m, K), jnp.bfloat16)
            ref = gv.gemv_reference(x, w, 0, transposed=transposed, out_dtype=jnp.float32, glu=glu)
            configs = [gv.default_config(m, K, N // 2 if glu else N)]
            if args.sweep and m in args.sweep_m:
                if time.perf_counter() - t_start < args.budget_s:
                    configs = (glu_sweep_configs(m, K, N // 2, args.max_configs) if glu
                               else sweep_configs(m, K, N, args.max_configs))
                else:
                    print(f"{name} M={m}: past --budget-s, default config only", flush=True)
            paths = _paths(x, w, ws, wparts, configs, transposed=transposed, out_dtype=out_dtype, head=head,
                           interpret=interpret, glu=glu)
            for path, (f, fargs) in paths.items():
                row = {"shape": name, "K": K, "N": N, "M": m, "path": path}
                try:
                    us = _time(f, fargs, calls, args.time_per_config, args.max_reps)
                    out = f(*fargs)[0]
                    err = None
                    if "argmax" not in path:
                        first = jnp.concatenate(out, axis=-1) if isinstance(out, list) else out
                        err = _rel_err(first, ref)
                    row.update(us=us, tb_s=weight_bytes / us / 1e6, frac_read_bw=weight_bytes / (us * 1e-6) / bw,
                               err=err)
                except Exception as e:  # a config the compiler rejects (shared memory, registers): record, go on
                    row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                    if args.smoke:
                        traceback.print_exc()
                rows.append(row)
                _print_row(row)
                gc.collect()
        del w, ws, wparts
        gc.collect()
    return rows


def _print_row(row: dict) -> None:
    head = f"{row['shape']:>8} M={row['M']:<3} {row['path']:<52}"
    if "error" in row:
        print(f"{head} FAILED {row['error']}", flush=True)
        return
    err = "" if row["err"] is None else f"  err {row['err']:.1e}"
    print(f"{head} {row['us']:9.1f} us  {row['tb_s']:5.2f} TB/s ({100 * row['frac_read_bw']:3.0f}% of read){err}",
          flush=True)


def _print_best(rows: list[dict]) -> None:
    print("\nbest per shape and M (us):")
    keys = sorted({(r["shape"], r["M"]) for r in rows}, key=lambda k: (list(SHAPES).index(k[0]) if k[0] in SHAPES
                                                                       else 0, k[1]))
    for shape, m in keys:
        ok = [r for r in rows if r["shape"] == shape and r["M"] == m and "us" in r and "argmax" not in r["path"]]
        xla = [r for r in ok if r["path"] in ("xla", "xla_unfused", "xla 2-row")]
        pal = [r for r in ok if r["path"].startswith("pallas")]
        bx = min(xla, key=lambda r: r["us"], default=None)
        bp = min(pal, key=lambda r: r["us"], default=None)
        if bx and bp:
            print(f"  {shape:>8} M={m:<3} xla {bx['us']:8.1f} ({bx['path']})  pallas {bp['us']:8.1f} "
                  f"({bp['path'][7:]})  x{bx['us'] / bp['us']:.2f}")


def run_e2e(args) -> list[dict]:
    spec = "random:llama3.2-1b:layers=2:vocab=512" if args.smoke else "random:llama3.2-1b"
    rows = []
    runs = [(v, a) for v in args.variants for a in (args.attn_configs or [None])]
    for variant, attn in runs:
        with _attention_config(attn):
            rows += _e2e_variant(args, spec, f"{variant} attn {attn}" if attn else variant)
        gc.collect()
    return rows


@contextlib.contextmanager
def _attention_config(spec: str | None):
    """spec "BLOCKxSPLITS[xSTAGES[xWARPS]]": the Pallas decode attention's config for every call traced inside (replaces its
    default_config; benchmark-only, to compare configs in the real step), None: the default."""
    if spec is None:
        yield
        return
    from pallas_kernels import paged_decode_attention as pda

    block, splits, *rest = (int(v) for v in spec.split("x"))
    stages, warps = (rest + [pda.PagedDecodeConfig.num_stages, pda.PagedDecodeConfig.num_warps][len(rest):])[:2]
    cfg = pda.PagedDecodeConfig(block_tokens=block, splits=splits, num_stages=stages, num_warps=warps)
    with mock.patch.object(pda, "default_config", lambda *a: cfg):
        yield


def _e2e_variant(args, spec: str, variant: str) -> list[dict]:
    from jphoton import LLM
    from jphoton.models.protocol import llama_family
    from jphoton.weights import load_model

    rows = []
    matmul, layout = variant.split(" ")[0].rsplit("-", 1)
    if matmul in ("xla-glu", "xla-residual"):  # "fused" in parts (the residual kernel at any row count)
        from jphoton.models.matmul import XlaMatmul

        matmul = XlaMatmul(glu_gemv=matmul == "xla-glu", residual_gemv=matmul == "xla-residual")
    try:
        loaded = load_model(spec, None)
        model = llama_family(loaded.config, loaded.params, name=spec, unroll_layers=True, matmul=matmul,
                             fuse=layout == "fused")
        del loaded
        B = max(args.batch)
        # the engine's default attention (or an --attn-configs one) over --ctx tokens per row, so that the step
        # differs between variants only in its matmuls (or attention config)
        pages = -(-args.ctx // 16)
        llm = LLM(model, max_model_len=pages * 16, max_num_seqs=B, decode_buckets=tuple(sorted(set(args.batch))),
                  prefill_buckets=((1, 32),), warmup=False,
                  num_kv_pages=B * pages + 8, progress=False)
        for b in args.batch:
            t0 = time.perf_counter()
            ms = llm.device_step_ms(b, context=args.ctx, steps=args.step_reps)
            row = {"variant": variant, "B": b, "step_ms": ms, "first_call_s": time.perf_counter() - t0}
            rows.append(row)
            print(f"e2e {variant:<16} B={b:<3} {ms:7.3f} ms/step", flush=True)
        del llm, model
    except Exception as e:
        rows.append({"variant": variant, "error": f"{type(e).__name__}: {e}"[:300]})
        print(f"e2e {variant} FAILED: {e}", flush=True)
        traceback.print_exc()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpret mode)")
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--part", choices=["kernels", "e2e", "all"], default="kernels")
    ap.add_argument("--shapes", nargs="+", default=None, help=f"subset of {list(SHAPES)}")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32], help="activation rows (kernels)")
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True, help="GEMV config sweep")
    ap.add_argument("--sweep-m", type=int, nargs="+", default=[1, 32], help="M values that get the sweep")
    ap.add_argument("--max-configs", type=int, default=10, help="GEMV configs per shape and M in the sweep")
    ap.add_argument("--time-per-config", type=float, default=0.15, help="seconds of timed calls per path")
    ap.add_argument("--max-reps", type=int, default=200)
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="kernels: after this many seconds, time only the default config (stay inside the time box)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="decode rows (e2e)")
    ap.add_argument("--variants", nargs="+", default=["xla-fused", "fused-fused"],
                    help="e2e: MATMUL-LAYOUT with MATMUL a kind of models/matmul.py (xla|xla-plain|fused), "
                         "xla-glu (XlaMatmul(glu_gemv=True)) or xla-residual (XlaMatmul(residual_gemv=True)), LAYOUT "
                         "unfused|fused")
    ap.add_argument("--attn-configs", nargs="+", default=None, metavar="BxS[xST[xW]]",
                    help="e2e: run each variant with these Pallas decode attention configs (block tokens x splits "
                         "[x stages [x warps]]) instead of the default")
    ap.add_argument("--step-reps", type=int, default=30)
    ap.add_argument("--ctx", type=int, default=512, help="e2e: tokens of context every row attends over")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s:%(message)s")
    if args.smoke:
        args.m = [m for m in args.m if m <= 8] or [1]
        args.sweep_m = args.m[:1]
        args.max_configs = min(args.max_configs, 3)
        args.time_per_config = 0.01
        args.max_reps = 2
        args.batch = [1, 2]
        args.step_reps = 2
    for v in args.variants:
        matmuls = ("xla", "xla-plain", "xla-glu", "xla-residual", "fused")
        if v.rsplit("-", 1)[0] not in matmuls or not v.endswith(("-unfused", "-fused")):
            ap.error(f"unknown variant {v!r}")
    info = device_info()
    print(info, flush=True)
    bw = read_bandwidth(0.01 if args.smoke else 4.0, reps=2 if args.smoke else 10)
    print(f"read bandwidth (jnp.sum, bf16): {bw / 1e12:.2f} TB/s", flush=True)
    result = {"info": info, "read_bw_tb_s": bw / 1e12, "args": vars(args)}
    if args.part in ("kernels", "all"):
        result["kernels"] = run_kernels(args, bw)
        _print_best(result["kernels"])
    if args.part in ("e2e", "all"):
        result["e2e"] = run_e2e(args)
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
