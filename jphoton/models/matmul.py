"""How the dense layers' weight matmuls run: "xla" (plain `@`) or "pallas" (the decode GEMV in pallas_kernels/gemv.py for
steps of at most `max_rows` tokens, XLA above). Chosen once, when the model is built (models/protocol.py llama_family,
`LLM(matmul=...)`).

The hook takes the *stacked* weight [L, K, N] and the layer index: a Pallas call fed a slice of the stack would make XLA
materialise the slice (a copy of every weight, doubling the step's HBM traffic); the kernel indexes the stack itself.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

log = logging.getLogger("jphoton")

KINDS = ("auto", "xla", "pallas")
# "auto" resolves to this on GPU; XLA until benchmarks/decode_matmul.py has measured the GEMV on the H100.
GPU_DEFAULT = "xla"
# Most tokens in a step for which "pallas" uses the GEMV (first guess: the sweep measures M = 1, 8, 32).
PALLAS_MAX_ROWS = 32


def resolve(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"matmul must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    if kind == "auto":
        return GPU_DEFAULT if jax.default_backend() != "cpu" else "xla"
    return kind


class PallasMatmul:
    """Decode-sized steps through the Pallas GEMV, larger ones through XLA. interpret: None = interpret mode off GPU."""

    def __init__(self, max_rows: int = PALLAS_MAX_ROWS, interpret: bool | None = None):
        from pallas_kernels import gemv

        self.max_rows = min(max_rows, gemv.MAX_ROWS)
        self.interpret = interpret
        log.info("dense matmuls: %s for steps of <= %d tokens, XLA above", gemv.path_name(interpret), self.max_rows)

    def _rows(self, x: jax.Array) -> int:
        n = 1
        for d in x.shape[:-1]:
            n *= d
        return n

    def __call__(self, x: jax.Array, w: jax.Array, layer) -> jax.Array:
        """x [..., K] @ w[layer] for a stacked w [L, K, N]."""
        from pallas_kernels.gemv import gemv

        if self._rows(x) > self.max_rows:
            return x @ w[layer]
        out = gemv(x.reshape(-1, x.shape[-1]), w, layer, interpret=self.interpret)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def head(self, hidden: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
        """float32 logits hidden [R, D] @ w ([D, V], or [V, D] with `transposed`: a tied embedding)."""
        from pallas_kernels.gemv import gemv

        if self._rows(hidden) > self.max_rows:
            return jnp.dot(hidden, w.T if transposed else w, preferred_element_type=jnp.float32)
        return gemv(hidden, w, transposed=transposed, out_dtype=jnp.float32, interpret=self.interpret)


def make(kind: str, interpret: bool | None = None) -> PallasMatmul | None:
    """None for XLA (the model's plain `@` code path, unchanged), else the Pallas hook."""
    kind = resolve(kind)
    if kind == "xla":
        log.info("dense matmuls: XLA")
        return None
    return PallasMatmul(interpret=interpret)
