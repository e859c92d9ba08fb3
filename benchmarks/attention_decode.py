"""Paged decode attention (issue 8): the Pallas kernel vs the plain-JAX static gather path vs the jnp reference.

    python benchmarks/attention_decode.py --out /tmp/attention.json        # Llama-3.2-1B attention shape, on the GPU
    python benchmarks/attention_decode.py --smoke                          # tiny shapes on the CPU (interpret mode)

Shape: Hq 32, Hkv 8, hd 64, page 16, bf16, a 16-layer KV pool [L, slots, Hkv, hd] indexed by layer (never sliced).
For B rows of `ctx` tokens each (every row the same real length; its pages at random places in the pool):

  pallas     pallas_kernels/paged_decode_attention.py with its default config (what the engine runs for decode rows)
  static     jphoton/engine/attention.paged_attention_static over exactly ctx / 16 pages: the engine's GPU path before
             the kernel, here at its *best* (in the engine the context bucket is up to 4x the real length)
  reference  paged_decode_attention_reference (float32 gather + softmax), under jit

Timing: one jit runs 16 chained calls (call i on layer i, its query depending on call i-1's output, as the layers of a
model run), and successive jit calls rotate through enough disjoint block tables (page sets) that the data a call reads
was last touched > 200 MB earlier, so it comes from HBM, not L2. µs per call = wall time / calls. Bandwidth = KV bytes
of the real context (B * ctx * Hkv * hd * 2 bytes * (K and V)) / time, beside the read bandwidth (`jnp.sum` over
8 GiB) measured in the same run. Error: max |out - reference| (and that over max |reference|) at layer 3.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from benchmarks.common import QUICK, device_info, read_bandwidth, write_json  # noqa: E402
from jphoton.engine.attention import paged_attention_static  # noqa: E402
from pallas_kernels import paged_decode_attention as pda  # noqa: E402

SHAPE = dict(Hq=32, Hkv=8, hd=64, page_size=16, layers=16, dtype=jnp.bfloat16)
SMOKE_SHAPE = dict(Hq=8, Hkv=2, hd=16, page_size=4, layers=2, dtype=jnp.float32)
BATCHES = (1, 8, 32, 128)
CONTEXTS = (512, 2048, 8192)
L2_BYTES = 50 * 2**20  # H100
ERR_LAYER = 3


def make_case(B: int, ctx: int, s: dict, n_tables: int, seed: int = 0):
    """A pool holding n_tables disjoint page sets of B rows x ctx tokens (+ the trash page), random contents."""
    ps, L, Hkv, hd = s["page_size"], s["layers"], s["Hkv"], s["hd"]
    P = -(-ctx // ps)
    num_pages = n_tables * B * P
    slots = (num_pages + 1) * ps
    key = jax.random.PRNGKey(seed)
    kk, kv, kq = jax.random.split(key, 3)

    @functools.partial(jax.jit, static_argnums=(1,))
    def normal(k, shape):  # drawn in the pool's dtype: no float32 copy of a pool at peak memory
        return jax.random.normal(k, shape, s["dtype"])

    k_pool = normal(kk, (L, slots, Hkv, hd))
    v_pool = normal(kv, (L, slots, Hkv, hd))
    q = normal(kq, (B, s["Hq"], hd))
    perm = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    tables = [jnp.asarray(perm[i * B * P:(i + 1) * B * P].reshape(B, P)) for i in range(n_tables)]
    ctx_len = jnp.full((B,), ctx, jnp.int32)
    return q, k_pool, v_pool, tables, ctx_len


def path_fns(s: dict, ctx: int, config=None) -> dict:
    ps = s["page_size"]
    P = -(-ctx // ps)

    def pallas(q, k, v, layer, t, c):
        return pda.paged_decode_attention(q, k, v, layer, t, c, page_size=ps, config=config)

    def static(q, k, v, layer, t, c):
        return paged_attention_static(q[:, None], k, v, layer, t, (c - 1)[:, None], c, page_size=ps, num_pages=P)[:, 0]

    def reference(q, k, v, layer, t, c):
        return pda.paged_decode_attention_reference(q, k, v, layer, t, c, page_size=ps).astype(q.dtype)

    return {"pallas": pallas, "static": static, "reference": reference}


def time_path(fn, q, k_pool, v_pool, tables, ctx_len, layers: int, budget_s: float, max_reps: int):
    """(seconds per call, output of the last call on tables[0]): `layers` chained calls per jit, one per layer, the
    last on ERR_LAYER (so the first, compiling, jit call also gives the output the error is measured on); jit calls
    rotate through the tables."""
    last = min(ERR_LAYER, layers - 1)
    order = [(last + 1 + i) % layers for i in range(layers)]

    def chain(q, k, v, t, c):
        y = None
        for layer in order:
            qi = q if y is None else q + (0 * y[0, 0, 0]).astype(q.dtype)
            y = fn(qi, k, v, layer, t, c)
        return y

    f = jax.jit(chain)
    first = np.asarray(f(q, k_pool, v_pool, tables[0], ctx_len), np.float32)  # compile
    t0 = time.perf_counter()
    jax.block_until_ready(f(q, k_pool, v_pool, tables[-1], ctx_len))
    one = time.perf_counter() - t0
    reps = int(max(2, min(max_reps, budget_s / max(one, 1e-6))))
    t0 = time.perf_counter()
    for r in range(reps):
        out = f(q, k_pool, v_pool, tables[r % len(tables)], ctx_len)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / (reps * layers), first


def run(args) -> dict:
    s = SMOKE_SHAPE if args.smoke else SHAPE
    if args.heads:
        s = {**s, "Hq": args.heads[0], "Hkv": args.heads[1]}
    configs = {f"pallas {c}": pda.PagedDecodeConfig(*map(int, c.split(":"))) for c in args.configs}
    timed = [*args.paths, *configs]
    batches = args.batch or ((1, 2) if args.smoke else BATCHES)
    contexts = args.ctx or ((16, 40) if args.smoke else CONTEXTS)
    layers = s["layers"]
    info = device_info()
    bw = read_bandwidth(gib=0.05 if args.smoke else 8.0, reps=2 if args.smoke else 10)
    print(f"{info}\nread bandwidth: {bw / 1e12:.3f} TB/s; shape {({k: str(v) for k, v in s.items()})}", flush=True)
    itemsize = jnp.dtype(s["dtype"]).itemsize
    token_bytes = 2 * s["Hkv"] * s["hd"] * itemsize  # K and V of one token in one layer
    rows = []
    budget = 0.05 if args.smoke else args.time_per_path
    for ctx in contexts:
        for B in batches:
            call_bytes = B * ctx * token_bytes
            touched = layers * call_bytes  # per jit call
            n_tables = 1 if args.smoke or touched >= 4 * L2_BYTES else -(-4 * L2_BYTES // touched) + 1
            pool_gib = layers * n_tables * B * ctx * token_bytes / 2**30
            row = {"B": B, "ctx": ctx, "kv_bytes_per_call": call_bytes, "tables": n_tables, "pool_gib": pool_gib,
                   "config": str(pda.default_config(B, s["Hkv"], ctx)), "paths": {}}
            if pool_gib > args.max_pool_gib:
                row["skipped"] = f"pool {pool_gib:.1f} GiB > --max-pool-gib {args.max_pool_gib}"
                print(f"B={B} ctx={ctx}: skipped ({row['skipped']})", flush=True)
                rows.append(row)
                continue
            try:
                q, k_pool, v_pool, tables, ctx_len = make_case(B, ctx, s, n_tables)
            except Exception as e:  # noqa: BLE001 (out of memory: report and go on)
                row["skipped"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"B={B} ctx={ctx}: skipped ({row['skipped']})", flush=True)
                rows.append(row)
                continue
            fns = path_fns(s, ctx)
            fns.update({name: path_fns(s, ctx, cfg)["pallas"] for name, cfg in configs.items()})
            outs = {}
            for name in ["reference", *[p for p in timed if p != "reference"]]:  # the reference first
                try:
                    if name not in timed:  # not timed: its output only
                        outs[name] = np.asarray(jax.jit(fns[name], static_argnums=3)(
                            q, k_pool, v_pool, min(ERR_LAYER, layers - 1), tables[0], ctx_len), np.float32)
                        continue
                    sec, outs[name] = time_path(fns[name], q, k_pool, v_pool, tables, ctx_len, layers, budget,
                                                args.max_reps)
                    row["paths"][name] = {"us": sec * 1e6, "gb_s": call_bytes / sec / 1e9,
                                          "fraction_of_read_bw": call_bytes / sec / bw}
                except Exception as e:  # noqa: BLE001 (a path that fails to compile or run: report it)
                    traceback.print_exc()
                    row["paths"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            ref = outs.get("reference")
            ref_max = (float(np.abs(ref).max()) or 1.0) if ref is not None else 1.0
            for name, v in row["paths"].items():
                if name in outs and ref is not None:
                    v["max_abs_err"] = float(np.abs(outs[name] - ref).max())
                    v["max_rel_err"] = v["max_abs_err"] / ref_max
            p = row["paths"]
            if "us" in p.get("pallas", {}) and "us" in p.get("static", {}):
                row["speedup_vs_static"] = p["static"]["us"] / p["pallas"]["us"]
            _print_row(row)
            rows.append(row)
            del q, k_pool, v_pool, tables, outs, ref
            gc.collect()
    _print_table(rows, bw)
    return {"info": info, "read_bw_bytes_s": bw, "shape": {k: str(v) for k, v in s.items()}, "rows": rows}


def _print_row(row: dict) -> None:
    parts = [f"B={row['B']:4d} ctx={row['ctx']:5d}"]
    for k, v in row["paths"].items():
        parts.append(f"{k} {v['us']:9.1f}us {v['gb_s']:7.1f}GB/s err {v.get('max_abs_err', float('nan')):.1e}"
                     if "us" in v else f"{k} FAILED")
    print(" | ".join(parts), flush=True)


def _print_table(rows: list[dict], bw: float) -> None:
    order = ["pallas", "static", "reference"]
    paths = sorted({k for r in rows for k in r["paths"]}, key=lambda p: (order.index(p) if p in order else 3, p))
    head = f"{'B':>4} {'ctx':>5} " + " ".join(f"{p + ' us':>13} {'GB/s':>7} {'%bw':>5} {'err':>8}" for p in paths)
    print("\n" + head + f" {'pallas vs static':>16}")
    for r in rows:
        line = f"{r['B']:>4} {r['ctx']:>5} "
        if "skipped" in r:
            print(line + "skipped: " + r["skipped"])
            continue
        for p in paths:
            v = r["paths"].get(p, {})
            line += (f"{v['us']:>13.1f} {v['gb_s']:>7.1f} {v['gb_s'] * 1e9 / bw:>5.0%} "
                     f"{v.get('max_abs_err', float('nan')):>8.1e} "
                     if "us" in v else f"{'failed':>13} {'':>7} {'':>5} {'':>8} ")
        sp = r.get("speedup_vs_static")
        print(line + (f"{sp:>15.2f}x" if sp else ""))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes that run on the CPU (interpret mode)")
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--batch", type=int, nargs="+", default=None)
    ap.add_argument("--ctx", type=int, nargs="+", default=None)
    ap.add_argument("--paths", nargs="+", default=["pallas", "static", "reference"],
                    choices=["pallas", "static", "reference"])
    ap.add_argument("--time-per-path", type=float, default=0.3, help="seconds of timed calls per path and case")
    ap.add_argument("--max-reps", type=int, default=200)
    ap.add_argument("--max-pool-gib", type=float, default=40.0, help="skip cases whose KV pool is larger")
    ap.add_argument("--heads", type=int, nargs=2, metavar=("HQ", "HKV"), default=None,
                    help="query and KV heads (default 32 8, Llama-3.2-1B; Moondream 2: 32 32)")
    ap.add_argument("--configs", nargs="+", default=[], metavar="B:W:S:X",
                    help="the kernel also with these configs (block_tokens:num_warps:num_stages:splits), timed beside"
                         " its default")
    args = ap.parse_args(argv)
    if QUICK:
        args.batch, args.ctx, args.time_per_path = args.batch or [1, 32], args.ctx or [512, 8192], 0.1
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("jphoton").setLevel(logging.INFO)
    t0 = time.perf_counter()
    result = run(args)
    result["wall_s"] = time.perf_counter() - t0
    print(f"done in {result['wall_s']:.0f}s", flush=True)
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
