"""The fused sampler alone, by noise source: the counter-based hash that `jphoton.sampling` draws its Gumbel noise from,
against threefry (`jax.random.gumbel` under a per-row key folded with the output index, the sampler before c9f4606).

Each variant is `sample_plain`'s work on [B, V] float32 logits (temperature, noise, one argmax over the rows' scores) jitted
alone and dispatched back to back; rows alternate greedy and sampled, as a mixed batch would. Both variants run in one
process, so their ratio is the claim; the absolute microseconds sit outside the engine step (where XLA may fuse the
sampler into the LM head's neighbours).

    python3 lab/sampler_noise.py --batch 2 32 128 --vocab 128256 --out sampler_noise.json
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from jphoton import sampling
from jphoton.sampling import _gumbel, seed_key_data


def threefry_gumbel(logits: jax.Array, key_data: jax.Array, index: jax.Array) -> jax.Array:
    def row(kd, i):
        key = jax.random.fold_in(jax.random.wrap_key_data(kd, impl="threefry2x32"), i)
        return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

    return jax.vmap(row)(key_data, index)


NOISE = {"hash": _gumbel, "threefry": threefry_gumbel}


def sampler(noise, args):
    """`sample_plain` itself, jitted and traced on `args` with `noise` in place of the module's `_gumbel`; the returned
    function then runs that executable with no patching on the timed path (the same shapes and dtypes never retrace)."""
    # a fresh function per variant: jit caches traces by function, so jitting sample_plain itself twice would trace once
    fn = jax.jit(lambda *a: sampling.sample_plain(*a))
    with mock.patch.object(sampling, "_gumbel", noise):
        fn(*args).block_until_ready()
    return fn


def time_variant(fn, args, reps: int) -> float:
    out = fn(*args)
    out.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - t0) / reps


def run(batch: list[int], vocab: int, reps: int, rounds: int, seed: int = 0) -> list[dict]:
    """Per B, each variant timed `rounds` times in alternation (median kept), so a drift of the device hits both."""
    rng = np.random.default_rng(seed)
    rows = []
    for B in batch:
        logits = jnp.asarray(rng.normal(size=(B, vocab)).astype(np.float32) * 3)
        temperature = jnp.asarray(np.where(np.arange(B) % 2, 0.8, 0.0).astype(np.float32))
        key_data = jnp.asarray(seed_key_data(np.arange(B) + 1))
        index = jnp.asarray(rng.integers(0, 512, B).astype(np.int32))
        args = (logits, temperature, key_data, index)
        fns = {name: sampler(noise, args) for name, noise in NOISE.items()}
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name].append(time_variant(fn, args, reps))
        row = {"batch": B, "vocab": vocab, **{f"{name}_us": float(np.median(t)) * 1e6 for name, t in times.items()}}
        row["hash_over_threefry"] = row["hash_us"] / row["threefry_us"]
        rows.append(row)
        print(f"B={B:4d} V={vocab}: hash {row['hash_us']:.1f} us, threefry {row['threefry_us']:.1f} us "
              f"(hash/threefry {row['hash_over_threefry']:.3f})", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[2, 32, 128])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    from benchmarks.common import device_info, write_json

    rows = run(args.batch, args.vocab, args.reps, args.rounds)
    if args.out:
        write_json(args.out, {**device_info(), "command": "lab/sampler_noise.py", "args": vars(args),
                              "rows": rows})


if __name__ == "__main__":
    main()
