"""Probe: does a lax.cond / while_loop inside a jitted step make dispatch block on this GPU (with the XLA_FLAGS of
the environment)? And what do sort / top_k over a 128k vocabulary cost?"""

import time

import jax
import jax.numpy as jnp


def timeit(f, *a, n=20):
    f(*a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(n):
        out = f(*a)
    t_dispatch = (time.perf_counter() - t0) / n
    out.block_until_ready()
    return t_dispatch * 1e3, (time.perf_counter() - t0) / n * 1e3


x = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.bfloat16)


def work(x):
    for _ in range(8):
        x = jnp.tanh(x @ x)
    return x


plain = jax.jit(work)
cond = jax.jit(lambda x: jax.lax.cond(jnp.sum(x[0]) > 1e9, lambda y: y * 2, lambda y: y, work(x)))
loop = jax.jit(lambda x: jax.lax.while_loop(lambda c: c[0] < jnp.int32(x[0, 0] > -100) + 1,
                                            lambda c: (c[0] + 1, work(c[1])), (jnp.int32(0), x))[1])
for name, f in [("plain", plain), ("cond", cond), ("while", loop)]:
    d, t = timeit(f, x)
    print(f"{name:6s}: dispatch {d:.3f} ms/call, total {t:.3f} ms/call", flush=True)

logits = jax.random.normal(jax.random.key(1), (128, 128256), jnp.float32)
for name, f in [("sort", jax.jit(lambda l: jnp.sort(l, axis=-1))),
                ("top_k 64", jax.jit(lambda l: jax.lax.top_k(l, 64)[0])),
                ("top_k 1024", jax.jit(lambda l: jax.lax.top_k(l, 1024)[0])),
                ("argmax", jax.jit(lambda l: jnp.argmax(l, -1))),
                ("gumbel", jax.jit(lambda l: jnp.argmax(l + jax.random.gumbel(jax.random.key(2), l.shape), -1)))]:
    d, t = timeit(f, logits)
    print(f"{name:10s} [128, 128256]: {t:.3f} ms", flush=True)
