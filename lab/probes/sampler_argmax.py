"""The engine's plain sampler with one argmax over each row's selected scores (jphoton/sampling.py, today's form)
against the earlier form (a greedy argmax, a sampled argmax and a select), on [B, V] float32 logits: reduction kernels
in the compiled HLO, device time per call (`--inner` calls inside one jitted loop, each with its own output index, so
dispatch is out of the number and nothing is hoisted), alternated in one process, and the tokens of both compared.

    python lab/probes/sampler_argmax.py --batch 2 32 128 --vocab 128256
"""

import argparse
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import device_info  # noqa: E402
from jphoton import sampling  # noqa: E402


def two_argmaxes(logits, temperature, key_data, index):
    """sample_plain as it was before the one-argmax form."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    sampled = jnp.argmax(scaled + sampling._gumbel(logits, key_data, index), axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[2, 32, 128])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--inner", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(device_info(), flush=True)
    rng = np.random.default_rng(0)
    for B in args.batch:
        logits = jnp.asarray(rng.standard_normal((B, args.vocab)), jnp.float32)
        temperature = jnp.asarray(np.where(np.arange(B) % 2, 0.8, 0.0), jnp.float32)  # greedy and sampled rows
        key_data = jnp.asarray(sampling.seed_key_data(np.arange(B) + 7))
        index = jnp.arange(B, dtype=jnp.int32)
        once = {"one argmax": jax.jit(sampling.sample_plain), "two argmaxes": jax.jit(two_argmaxes)}
        a, b = (np.asarray(f(logits, temperature, key_data, index)) for f in once.values())
        hlo = {name: f.lower(logits, temperature, key_data, index).compile().as_text() for name, f in once.items()}

        def looped(sample):
            def run(lg, temp, kd, idx):
                def body(i, acc):
                    return acc + sample(lg, temp, kd, idx + i)
                return jax.lax.fori_loop(0, args.inner, body, jnp.zeros_like(idx))
            return jax.jit(run)

        fns = {"one argmax": looped(sampling.sample_plain), "two argmaxes": looped(two_argmaxes)}
        reduces = {name: sum(" fusion(" in line and "kind=kInput" in line for line in text.splitlines())
                   for name, text in hlo.items()}
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, f in fns.items():
                jax.block_until_ready(f(logits, temperature, key_data, index))
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    out = f(logits, temperature, key_data, index)
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - t0) / (args.reps * args.inner) * 1e6)
        med = {name: float(np.median(v)) for name, v in times.items()}
        print(f"B={B:4} V={args.vocab}: same tokens {bool((a == b).all())}; input (reduction) fusions "
              f"{reduces['one argmax']} vs {reduces['two argmaxes']}; us per call {med['one argmax']:.1f} vs "
              f"{med['two argmaxes']:.1f} (one/two {med['one argmax'] / med['two argmaxes']:.3f})", flush=True)


if __name__ == "__main__":
    main()
