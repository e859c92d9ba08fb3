"""GPU check of the LoRA decode path (pallas_kernels/lora_expand.py after the GEMV partials) against the XLA path, at
the 1B shapes with 4 slots of rank 16, bf16, 32 rows (24 on slots): max |difference| relative to the update's scale."""
import jax
import jax.numpy as jnp
import numpy as np

from jphoton.models import lora
from jphoton.models.matmul import PlainMatmul, XlaMatmul

rng = np.random.default_rng(0)
S, R = 4, 16
for group, K, O in (("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 16384), ("down", 8192, 2048)):
    C = S * len(lora.GROUPS[group]) * R
    a = jnp.asarray(rng.standard_normal((K, C)) * 0.02, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((C, O)) * 0.02, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((32, K)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((32, O)), jnp.bfloat16)
    slots = jnp.asarray(np.where(np.arange(32) < 24, np.arange(32) % S, -1), jnp.int32)
    w = lora.group_width(group, R)
    fused = jax.jit(lambda *args, w=w: XlaMatmul(glu_gemv=True).lora_add(*args, w))(y, x, a, b, slots)
    plain = jax.jit(lambda *args, w=w: PlainMatmul().lora_add(*args, w))(y, x, a, b, slots)
    diff = np.abs(np.asarray(fused, np.float32) - np.asarray(plain, np.float32))
    upd = np.abs(np.asarray(plain, np.float32) - np.asarray(y, np.float32))
    print(group, "max diff", diff.max(), "update scale", upd.max(), "base rows untouched",
          bool((np.asarray(fused)[24:] == np.asarray(y)[24:]).all()), flush=True)
