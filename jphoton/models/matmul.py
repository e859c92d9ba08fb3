"""How the dense layers' weight matmuls run, chosen once when the model is built (models/protocol.py llama_family,
`LLM(matmul=...)`). The model calls a hook for a product (`__call__`), gate+up with SwiGLU (`glu`), a sublayer's output
projection plus the residual add plus the RMSNorm that feeds the next matmul (`residual`), and the LM head (`head`).
Kinds: "xla-plain" (XLA dots as written, `PlainMatmul`, the CPU default); "xla" (XLA dots, a one-token step computed
as two rows, `XlaMatmul`); "fused" (the GPU default: "xla", with gate+up through the SwiGLU GEMV for steps of <= 32
tokens, and O and down through split-K GEMV partials into pallas_kernels/add_rms_norm.py at 17-32 tokens; for a model
of plain products only, Moondream, each product of <= 32 tokens through the GEMV: `dense_gemv`). A hook gets
the layer's matrix [K, N] (for an XLA dot) and the stacked weight [L, K, N] + layer index (for a kernel: a Pallas call
fed a slice of the stack would copy the weights).
Why each kind: docs/models.md, "Matmul kinds"; numbers: docs/decisions.md, "Decode step on the device".
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp

from jphoton.models.layers import dense, rms_norm, silu_mul

log = logging.getLogger("jphoton")

KINDS = ("auto", "xla", "xla-plain", "fused")
# "auto" resolves to this on GPU: the faster engine step (docs/decisions.md, "Decode step on the device").
GPU_DEFAULT = "fused"
# Most tokens in a step for which "fused" uses the GEMV (the sweep measured M = 1, 8, 32: still ahead at 32).
PALLAS_MAX_ROWS = 32
# Fewest tokens in a step for which "fused" runs O and down through the add + RMSNorm kernel. Same H100 run, 1B step
# (RESULTS.md, 2026-11-23 20:54-21:31): the kernel path against XLA's sum, add and norm kernels, both with the SwiGLU GEMV,
# +1.1 / +0.6 / +0.5% per step at 2 / 8 / 16 rows and -2.1% at 32 (the kernel costs 2.3-3.2 us per call whatever the
# row count, ~1 us more than expected; XLA's kernels grow with the rows).
FUSED_RESIDUAL_MIN_ROWS = 17


def resolve(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"matmul must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    if kind == "auto":  # the CPU backend never strength-reduces dots: nothing to pad there
        return GPU_DEFAULT if jax.default_backend() != "cpu" else "xla-plain"
    return kind


def _rows(x: jax.Array) -> int:
    return math.prod(x.shape[:-1])


def xla_head(hidden: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    """float32 logits through XLA: hidden [R, D] @ w ([D, V], or [V, D] with `transposed`: a tied embedding)."""
    return jnp.dot(hidden, w.T if transposed else w, preferred_element_type=jnp.float32)


def swiglu_of(gate_up: jax.Array) -> jax.Array:
    """silu(gate) * up of a [..., 2F] = [gate | up] product."""
    return silu_mul(*jnp.split(gate_up, 2, axis=-1))


def _gemv_rows(x: jax.Array, stacked: jax.Array, layer, **kwargs) -> jax.Array:
    """The Pallas GEMV (pallas_kernels/gemv.py) on x [..., K]: its rows flattened in, the leading dims restored."""
    from pallas_kernels.gemv import gemv

    out = gemv(x.reshape(-1, x.shape[-1]), stacked, layer, **kwargs)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def two_row_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N]; a single row goes through the dot as two (a zero row added and dropped). The barrier keeps
    XLA from sinking the slice into the dot, which would make it a vector dot again."""
    if _rows(x) != 1:
        return dense(x, w)
    x2 = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
    out = jax.lax.optimization_barrier(dense(x2, w))
    return out[:1].reshape(*x.shape[:-1], w.shape[-1])


class PlainMatmul:
    """XLA dots as the model writes them; the base of the other hooks, whose methods fall back to these."""

    min_rows = 1
    # Tensor parallelism (models/tensor_parallel.py): the all-reduce of a row-parallel product (O, down), run by
    # `residual` on the product in the activation dtype (float32 products were 7% slower per step at B=32 on two
    # H100s, docs/decisions.md). None: one device.
    reduce = None

    def __call__(self, x: jax.Array, w: jax.Array, stacked: jax.Array | None = None, layer=None) -> jax.Array:
        """x [..., K] @ w [K, N] (this layer's matrix; `stacked` [L, K, N] and `layer` are for kernels)."""
        return dense(x, w)

    def glu(self, x: jax.Array, w: jax.Array, stacked: jax.Array, layer, n: int | None = None) -> jax.Array:
        """silu(gate) * up of x @ w, w = [gate | up] [K, 2F] (n = F: w may have more columns after, unused)."""
        out = self(x, w, stacked, layer)
        return swiglu_of(out if n is None else out[..., :2 * n])

    def residual(self, h: jax.Array, y: jax.Array, w: jax.Array, stacked: jax.Array, layer, norm: jax.Array,
                 norm_stack: jax.Array, eps: float, bias: jax.Array | None = None, lora=None, norm_layer=None
                 ) -> tuple[jax.Array, jax.Array]:
        """h' = h + y @ w (+ bias), and RMSNorm(h') * norm: the residual stream and the next matmul's input.
        `norm` is the norm weight [D], row `norm_layer` (default: `layer`) of `norm_stack` [L, D] (for kernels). w
        may have more columns than h (a LoRA shrink's, models/lora.py INLINE): lora(h, those columns of the product)
        adds the rows' LoRA updates to h first; without `lora` they are dropped."""
        if self.reduce is not None:  # each shard's product in the activation dtype, summed in it (as vLLM does)
            out = self.reduce(dense(y, w))
        else:
            out = self(y, w, stacked, layer)
        D = h.shape[-1]
        if out.shape[-1] > D:
            out, shrunk = out[..., :D], out[..., D:]
            if lora is not None:
                h = lora(h, shrunk)
        h = h + (out if bias is None else out + bias)
        return h, rms_norm(h, norm, eps)

    def head(self, hidden: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
        return xla_head(hidden, w, transposed)

    def lora_expand(self, y: jax.Array, shrunk: jax.Array, b: jax.Array, token_slots: jax.Array,
                    width: int) -> jax.Array:
        """y + ((shrunk where onehot) @ b): the update of a group whose shrink the base product computed (models/lora.py
        INLINE)."""
        from jphoton.models import lora

        mask = lora.slot_mask(token_slots, b.shape[0], width, jnp.float32)
        return y + lora.expand(shrunk, b, mask, y.dtype).reshape(y.shape)


class XlaMatmul(PlainMatmul):
    """XLA dots with one-token steps padded to two rows (docs/models.md, "Matmul kinds"); the LM head is large enough to stay
    a GEMM at any row count, so it is a plain dot. The engine runs its decode steps with at least `min_rows` rows
    (models/protocol.py), so in serving the padding happens once per step, not in every matmul.

    For steps of at most PALLAS_MAX_ROWS tokens: `glu_gemv` runs gate+up as one Pallas GEMV that applies SwiGLU to its
    fp32 sums (no activation kernel, no [.., 2F] intermediate in HBM); `residual_gemv` runs the output projections
    (O, down) of steps of at least `residual_min_rows` tokens as GEMVs whose split-K partials go straight into the
    add + RMSNorm kernel (no sum, add or norm kernels). QKV through the GEMV as well was measured and gained nothing
    (1.220 / 1.534 against 1.211 / 1.537 ms at B = 2 / 32, RESULTS.md)."""

    min_rows = 2

    def __init__(self, glu_gemv: bool = False, residual_gemv: bool = False, residual_min_rows: int = 1,
                 interpret: bool | None = None, dense_gemv: bool = False):
        self.dense_gemv = dense_gemv
        self.glu_gemv = glu_gemv
        self.residual_gemv = residual_gemv
        self.residual_min_rows = residual_min_rows
        self.interpret = interpret
        gemvs = [what for what, on in (
            ("gate+up with SwiGLU", glu_gemv),
            (f"O and down into the add + RMSNorm kernel (from {residual_min_rows} tokens)", residual_gemv),
            ("every other product", dense_gemv)) if on]
        log.info("dense matmuls: XLA (one-token steps as two rows)%s",
                 f"; Pallas GEMVs for {', '.join(gemvs)} at <= {PALLAS_MAX_ROWS} tokens" if gemvs else "")

    def __call__(self, x: jax.Array, w: jax.Array, stacked: jax.Array | None = None, layer=None) -> jax.Array:
        """x [..., K] @ w [K, N]: the layer's matrix, never the stack indexed by the traced layer (XLA would copy each
        layer's weights: docs/models.md, "Matmul kinds"). With `dense_gemv` (models whose layers are only plain
        products: Moondream's), steps of <= PALLAS_MAX_ROWS tokens run it as the Pallas GEMV."""
        if self.dense_gemv and stacked is not None and _rows(x) <= PALLAS_MAX_ROWS:
            return _gemv_rows(x, stacked, layer, interpret=self.interpret)
        return two_row_dot(x, w)

    def glu(self, x: jax.Array, w: jax.Array, stacked: jax.Array, layer, n: int | None = None) -> jax.Array:
        if self.glu_gemv and _rows(x) <= PALLAS_MAX_ROWS:
            return _gemv_rows(x, stacked, layer, glu=True, glu_n=n, interpret=self.interpret)
        return super().glu(x, w, stacked, layer, n)

    def residual(self, h, y, w, stacked, layer, norm, norm_stack, eps, bias=None, lora=None, norm_layer=None):
        gemv_rows = self.residual_min_rows <= _rows(y) <= PALLAS_MAX_ROWS
        if self.residual_gemv and self.reduce is None and bias is None and gemv_rows:
            from pallas_kernels.add_rms_norm import add_rms_norm
            from pallas_kernels.gemv import gemv

            D = h.shape[-1]
            # with LoRA rows the GEMV also writes the shrink columns (the kernel reads the first D); else D only
            parts = gemv(y.reshape(-1, y.shape[-1]), stacked, layer, partials=True, n=None if lora else D,
                         interpret=self.interpret)
            h2 = h.reshape(-1, D)
            if lora is not None and parts.shape[-1] > D:
                h2 = lora(h2, jnp.sum(parts[..., D:], axis=0))
            h2, normed = add_rms_norm(h2, parts, norm_stack, layer if norm_layer is None else norm_layer, eps=eps,
                                      interpret=self.interpret)
            return h2.reshape(h.shape), normed.reshape(h.shape)
        return super().residual(h, y, w, stacked, layer, norm, norm_stack, eps, bias, lora, norm_layer)


def make(kind, interpret: bool | None = None, reduce=None, dense_gemv: bool = False) -> PlainMatmul:
    """The hook for a kind (module docstring); a hook object passes through (benchmarks build variants). reduce: the
    tensor-parallel all-reduce (`PlainMatmul.reduce`); O and down then run as XLA dots (the GEMV + add-RMSNorm path
    has no all-reduce between its two kernels). dense_gemv: "fused" runs the plain products (`__call__`) of steps of
    <= PALLAS_MAX_ROWS tokens through the GEMV too (a model without SwiGLU or RMSNorm layers: Moondream)."""
    if not isinstance(kind, str):
        hook = kind
    elif (kind := resolve(kind)) == "xla-plain":
        log.info("dense matmuls: XLA (plain)")
        hook = PlainMatmul()
    else:
        fused = kind == "fused"
        hook = XlaMatmul(glu_gemv=fused, residual_gemv=fused, residual_min_rows=FUSED_RESIDUAL_MIN_ROWS,
                         interpret=interpret, dense_gemv=fused and dense_gemv)
    if reduce is not None:
        if not isinstance(kind, str):
            import copy

            hook = copy.copy(hook)
        hook.reduce = reduce
        log.info("tensor parallel: O and down products all-reduced after an XLA dot")
    return hook
