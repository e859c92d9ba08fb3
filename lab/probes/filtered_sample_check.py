"""GPU check of pallas_kernels/filtered_sample.py: the kernel (several programs a row, spin barrier) against the XLA
loops on the same rows, for each filter setting and row count. `python3 lab/probes/filtered_sample_check.py [UNROLL...]`"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from jphoton.sampling import _gumbel, seed_key_data  # noqa: E402
from pallas_kernels.filtered_sample import filtered_sample, filtered_sample_xla, programs_per_row  # noqa: E402

bad = 0
for R in (1, 4, 32):
    for V, scale in ((128256, 1.0), (49152, 3.0), (5000, 0.3)):
        rng = np.random.default_rng(R + V)
        x = jnp.asarray((rng.normal(size=(R, V)) * scale).astype(np.float32))
        kd = jnp.asarray(np.stack([seed_key_data(i) for i in range(R)]))
        y = x + _gumbel(x, kd, jnp.zeros(R, jnp.int32))
        for k, p in ((0, 0.9), (50, 1.0), (50, 0.9), (0, 0.3), (1000, 0.5), (0, 1.0)):
            kk, pp = jnp.full(R, k, jnp.int32), jnp.full(R, p, jnp.float32)
            want = np.asarray(jax.jit(filtered_sample_xla)(x, y, kk, pp))
            for unroll in [int(u) for u in sys.argv[1:]] or [1]:
                got = np.asarray(jax.jit(lambda *a, u=unroll: filtered_sample(*a, unroll=u))(x, y, kk, pp))
                ok = (got == want).all()
                bad += not ok
                print(f"R={R:2d} V={V:6d} k={k:4d} p={p} unroll {unroll}: programs/row {programs_per_row(R, V)} "
                      f"{'ok' if ok else 'MISMATCH ' + str(np.flatnonzero(got != want)[:8])}", flush=True)
print("mismatches:", bad)
