"""Correctness of the kernels finished by their last program (pallas_kernels/common.py `arrive_last`) on a real GPU,
where programs run concurrently and a missing barrier or fence would show: QKV + RoPE and O / down + residual + RMSNorm
(pallas_kernels/gemv_split_finish.py) and the attention kernel's in-kernel split merge, at Llama-3.2-1B's shapes.
Each is called `--reps` times on the same inputs: every call must give the same bits (a race would not) and match the
XLA path (max |diff| / max |ref| reported, bf16). Counters must come back zero. CPU: interpret mode, tiny reps.

    python benchmarks/probes/split_finish_check.py --out results.json
"""

from __future__ import annotations

import argparse
import sys

sys.path.insert(0, __file__.rsplit("/", 3)[0])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import device_info, write_json  # noqa: E402
from pallas_kernels import paged_decode_attention as pda  # noqa: E402
from pallas_kernels.common import Semaphores  # noqa: E402
from pallas_kernels.gemv_split_finish import (  # noqa: E402
    qkv_rope,
    qkv_rope_reference,
    residual_norm,
    residual_norm_reference,
)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _repeat(fn, args, reps):
    """The first call's outputs (leaves, in order) and whether all `reps` calls gave the same bits."""
    first = [np.asarray(o) for o in jax.tree.leaves(fn(*args))]
    same = True
    for _ in range(reps - 1):
        outs = [np.asarray(o) for o in jax.tree.leaves(fn(*args))]
        same &= all(np.array_equal(a, b) for a, b in zip(first, outs, strict=True))
    return first, same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng()
    bf = jnp.bfloat16
    L, D, F, Hq, Hkv, hd = 4, 2048, 8192, 32, 8, 64
    wqkv = jnp.asarray(0.02 * rng.standard_normal((L, D, (Hq + 2 * Hkv) * hd)), bf)
    wo = jnp.asarray(0.02 * rng.standard_normal((L, Hq * hd, D)), bf)
    wd = jnp.asarray(0.02 * rng.standard_normal((L, F, D)), bf)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal((L, D)), bf)
    inv = jnp.asarray(1.0 / 500000 ** (np.arange(0, hd, 2) / hd), jnp.float32)
    rows, ok = [], True
    kw = dict(num_heads=Hq, num_kv_heads=Hkv, head_dim=hd)

    def with_sems(f):
        def g_(*a):
            sems = Semaphores()
            return f(sems, *a), sems.take(1)
        return jax.jit(g_)

    for m in args.rows:
        x = jnp.asarray(rng.standard_normal((m, D)), bf)
        pos = jnp.asarray(rng.integers(0, 8000, m), jnp.int32)
        f = with_sems(lambda s, x, w, p: qkv_rope(x, w, 3, p, inv, semaphores=s, **kw))
        (out, ctr), same = _repeat(f, (x, wqkv, pos), args.reps)
        ref = jax.jit(lambda x, w, p: qkv_rope_reference(x, w, 3, p, inv, **kw))(x, wqkv, pos)
        rows.append({"kernel": "qkv_rope", "M": m, "rel_err": _rel(out, ref), "deterministic": bool(same),
                     "counters_zero": not ctr.any()})
        for name, w, k in (("residual_norm O", wo, Hq * hd), ("residual_norm down", wd, F)):
            h = jnp.asarray(rng.standard_normal((m, D)), bf)
            y = jnp.asarray(rng.standard_normal((m, k)), bf)
            f = with_sems(lambda s, h, y, w: residual_norm(h, y, w, 2, g, eps=1e-5, semaphores=s))
            (h2, normed, ctr), same = _repeat(f, (h, y, w), args.reps)
            rh, rn = jax.jit(lambda h, y, w: residual_norm_reference(h, y, w, 2, g, eps=1e-5))(h, y, w)
            rows.append({"kernel": name, "M": m, "rel_err": max(_rel(h2, rh), _rel(normed, rn)),
                         "deterministic": bool(same), "counters_zero": not ctr.any()})
    # attention: splits merged in the kernel vs by XLA, 512 and 4096 tokens of context
    ps = 16
    for R, ctx_len in ((2, 512), (2, 4096), (16, 512)):
        P = ctx_len // ps
        pool = (L, R * P * ps + ps, Hkv, hd)
        k = jnp.asarray(rng.standard_normal(pool), bf)
        v = jnp.asarray(rng.standard_normal(pool), bf)
        table = jnp.asarray(rng.permutation(R * P).reshape(R, P), jnp.int32)
        lens = jnp.asarray(rng.integers(ctx_len // 2, ctx_len + 1, R), jnp.int32)
        qkv = jnp.asarray(rng.standard_normal((R, Hq + 2 * Hkv, hd)), bf)

        def att(sems, qkv, k, v, table=table, lens=lens):
            return pda.paged_decode_attention(qkv, k, v, 1, table, lens, page_size=ps, new_kv="packed",
                                              semaphores=sems)
        f = with_sems(att)
        (out, _, _, ctr), same = _repeat(f, (qkv, k, v), args.reps)
        base = jax.jit(lambda qkv, k, v: att(None, qkv, k, v)[0])(qkv, k, v)
        splits = pda.default_config(R, Hkv, P * ps).splits
        rows.append({"kernel": f"attention merged (splits {splits})", "M": R, "ctx": ctx_len,
                     "rel_err": _rel(out, base), "deterministic": bool(same), "counters_zero": not ctr.any()})
    for r in rows:
        good = r["deterministic"] and r["counters_zero"] and r["rel_err"] < 2e-2
        ok &= good
        print(("ok  " if good else "BAD ") + "  ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    print("ALL OK" if ok else "FAILURES", flush=True)
    if args.out:
        write_json(args.out, {"info": device_info(), "rows": rows, "ok": ok, "reps": args.reps})


if __name__ == "__main__":
    main()
