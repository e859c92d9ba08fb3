"""How the dense layers' weight matmuls run: "xla" (XLA dots, a one-token step computed as two rows), "xla-plain" (the
model's plain `@`), or "pallas" (the decode GEMV in pallas_kernels/gemv.py for steps of at most `max_rows` tokens, XLA
above). Chosen once, when the model is built (models/protocol.py llama_family, `LLM(matmul=...)`).

Why "xla" pads a one-token step: XLA:GPU's algebraic simplifier strength-reduces a vector x matrix dot whose operands
hold fewer than 10M elements into an elementwise multiply (materialising x*W in HBM) plus a reduce. On the H100 that
turned Llama-3.2-1B's QKV and O projections at batch 1 into ~21 us each (~0.4 TB/s) instead of a GEMM; a two-row dot is
not a vector and stays a GEMM (kernel profile in benchmarks/RESULTS.md). The zero row costs one extra row of a
bandwidth-bound product, i.e. nothing measurable. In serving the engine rounds its decode buckets up to `min_rows`
(models/protocol.py `JaxModel.min_decode_rows`), so a lone request runs as a two-row step and no dot is padded: the
pad and slice kernels around every matmul cost 1.330 vs 1.269 ms per 1B step on the H100 (RESULTS.md).

A hook is called with the layer's matrix [K, N] (what an XLA dot reads: the layer scan's slice fuses into the GEMM)
and with the stacked weight [L, K, N] + layer index (what the kernel reads: a Pallas call fed a slice of the stack would
make XLA materialise the slice, a copy of every weight, doubling the step's HBM traffic), and optionally with the
elementwise step that produces its input (`Prologue`: the RMSNorm before QKV and gate/up, the SwiGLU activation
before down). XLA fuses those with its neighbours; the GEMV can run them in its own prologue (`fuse_prologues`), which
was meant to save a kernel launch each at B=1 but measured slower (RESULTS.md, 2026-11-23 17:15: the norm prologue
made the QKV GEMV 6.7 -> 10.9 us, the SwiGLU prologue made down 13 -> 28 us), so it is off by default.

Applying RMSNorm's row scale to the dot's output instead (the GEMM reading x * g) was measured at +0.7% / -1.3% per
step at B = 2 / 32 and removed (RESULTS.md, 2026-11-23 18:56). `XlaMatmul(glu_gemv=True)` runs gate+up through the
Pallas GEMV with SwiGLU in its epilogue (no activation kernel, no [.., 2F] intermediate): tested, not yet measured on
a GPU (`gpu_suite.sh decode-matmul-glu`), so off.

GPU default ("auto"): "xla". In the same H100 run, the engine's 1B decode step took 1.304 / 1.616 ms (B=1 / 32) with
"xla" against 1.336 / 1.722 ms with "pallas" (RESULTS.md): the GEMV wins its matrices alone (QKV 1.85x) but the step
loses, the XLA dots fusing the norms and adds around them.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp

from jphoton.models.layers import dense, rms_norm, silu_mul

log = logging.getLogger("jphoton")

KINDS = ("auto", "xla", "xla-plain", "pallas")
# "auto" resolves to this on GPU: the faster engine step in the same H100 run (module docstring, RESULTS.md).
GPU_DEFAULT = "xla"
# Most tokens in a step for which "pallas" uses the GEMV (the sweep measured M = 1, 8, 32: still ahead at 32).
PALLAS_MAX_ROWS = 32
# Largest weight (K*N elements) that "pallas" puts through the GEMV. Measured on the H100 (Llama-3.2-1B, RESULTS.md):
# the GEMV beats XLA 1.5-1.9x on the QKV (6.3M) and O (4.2M) matrices, which XLA handles worst (the strength-reduction
# range below 10M, see above), and only ties it on gate+up (33.5M), down (16.8M) and the LM head (263M)...
PALLAS_MAX_WEIGHT_ELEMENTS = 10_000_000
# ...except in steps of at most this many tokens (0 = none), where every layer matrix takes the GEMV (with
# fuse_prologues: its norm / activation in the kernel, no two-row padding). Measured slower, see the module docstring.
PALLAS_ANY_WEIGHT_MAX_ROWS = 0


@dataclasses.dataclass(frozen=True)
class Prologue:
    """The elementwise step before a weight matmul: RMSNorm with this layer's weight (`norm`, with the stack and eps
    for kernels), or silu(gate) * up of an input [..., 2F] = [gate | up] (`silu`)."""

    norm: jax.Array | None = None  # [K], this layer's
    norm_stack: jax.Array | None = None  # [L, K]
    eps: float = 1e-6
    silu: bool = False

    def __call__(self, x: jax.Array) -> jax.Array:
        """The prologue in plain jnp (XLA fuses it with its neighbours)."""
        if self.silu:
            x = silu_mul(*jnp.split(x, 2, axis=-1))
        if self.norm is not None:
            x = rms_norm(x, self.norm, self.eps)
        return x


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


def two_row_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N]; a single row goes through the dot as two (a zero row added and dropped). The barrier keeps
    XLA from sinking the slice into the dot, which would make it a vector dot again."""
    if _rows(x) != 1:
        return dense(x, w)
    x2 = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
    out = jax.lax.optimization_barrier(dense(x2, w))
    return out[:1].reshape(*x.shape[:-1], w.shape[-1])


class XlaMatmul:
    """XLA dots with one-token steps padded to two rows (see the module docstring); the LM head is large enough to stay
    a GEMM at any row count, so it is a plain dot. The engine runs its decode steps with at least `min_rows` rows
    (models/protocol.py), so in serving the padding happens once per step, not in every matmul."""

    min_rows = 2

    def __init__(self, glu_gemv: bool = False, interpret: bool | None = None):
        self.glu_gemv = glu_gemv
        self.interpret = interpret
        log.info("dense matmuls: XLA (one-token steps as two rows%s)",
                 ", gate+up with SwiGLU through the Pallas GEMV's epilogue for decode-sized steps" if glu_gemv else "")

    def glu(self, x: jax.Array, w: jax.Array, stacked: jax.Array, layer, prologue: Prologue | None = None
            ) -> jax.Array:
        """silu(gate) * up of prologue(x) @ w, w = [gate | up] [K, 2F]. With glu_gemv, steps of at most
        PALLAS_MAX_ROWS tokens run one Pallas GEMV that applies the activation to its fp32 sums (no SwiGLU kernel,
        no [.., 2F] intermediate in HBM); the prologue stays in XLA."""
        if self.glu_gemv and _rows(x) <= PALLAS_MAX_ROWS:
            from pallas_kernels.gemv import gemv

            x = prologue(x) if prologue else x
            out = gemv(x.reshape(-1, x.shape[-1]), stacked, layer, glu=True, interpret=self.interpret)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return swiglu_of(self(x, w, prologue=prologue))

    def __call__(self, x: jax.Array, w: jax.Array, stacked: jax.Array | None = None, layer=None,
                 prologue: Prologue | None = None) -> jax.Array:
        """prologue(x) [..., K] @ w [K, N] (this layer's matrix; `stacked`/`layer` are for kernels and unused here).
        An earlier version indexed the stack here with the traced layer index; its H100 step was 1.3 ms slower than
        plain `@`, consistent with XLA copying each layer's weights (that run had other faults, see RESULTS.md)."""
        return two_row_dot(prologue(x) if prologue else x, w)

    def head(self, hidden: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
        return xla_head(hidden, w, transposed)


class PallasMatmul:
    """Decode-sized steps through the Pallas GEMV, larger ones through XLA. interpret: None = interpret mode off GPU.
    min_rows as XlaMatmul: the matrices above the GEMV's size limit take two-row XLA dots."""

    min_rows = 2

    def __init__(self, max_rows: int = PALLAS_MAX_ROWS, max_weight_elements: int = PALLAS_MAX_WEIGHT_ELEMENTS,
                 any_weight_max_rows: int = PALLAS_ANY_WEIGHT_MAX_ROWS, fuse_prologues: bool = False,
                 interpret: bool | None = None):
        from pallas_kernels import gemv

        self.max_rows = min(max_rows, gemv.MAX_ROWS)
        self.max_weight_elements = max_weight_elements
        self.any_weight_max_rows = any_weight_max_rows
        self.fuse_prologues = fuse_prologues
        self.interpret = interpret
        log.info("dense matmuls: %s (norm / SwiGLU prologues %s) for steps of <= %d tokens and weights of <= %d "
                 "elements (any weight at <= %d tokens), XLA (one-token steps as two rows) otherwise",
                 gemv.path_name(interpret), "in the kernel" if fuse_prologues else "in XLA", self.max_rows,
                 max_weight_elements, any_weight_max_rows)

    def __call__(self, x: jax.Array, w: jax.Array, stacked: jax.Array, layer,
                 prologue: Prologue | None = None) -> jax.Array:
        """prologue(x) [..., K] @ w [K, N], this layer's matrix; the GEMV reads it from `stacked` [L, K, N] at `layer`
        instead, and runs the prologue itself."""
        from pallas_kernels.gemv import gemv

        rows = _rows(x)
        if rows > self.max_rows or (w.shape[0] * w.shape[1] > self.max_weight_elements
                                    and rows > self.any_weight_max_rows):
            return two_row_dot(prologue(x) if prologue else x, w)
        p = prologue or Prologue()
        if not self.fuse_prologues:
            x, p = p(x), Prologue()
        out = gemv(x.reshape(-1, x.shape[-1]), stacked, layer, norm_weight=p.norm_stack, eps=p.eps, silu=p.silu,
                   interpret=self.interpret)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def glu(self, x: jax.Array, w: jax.Array, stacked: jax.Array, layer, prologue: Prologue | None = None
            ) -> jax.Array:
        """silu(gate) * up of prologue(x) @ w, w = [gate | up] [K, 2F]."""
        return swiglu_of(self(x, w, stacked, layer, prologue=prologue))

    def head(self, hidden: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
        """float32 logits hidden [R, D] @ w ([D, V], or [V, D] with `transposed`: a tied embedding)."""
        from pallas_kernels.gemv import gemv

        if _rows(hidden) > self.max_rows or w.shape[0] * w.shape[1] > self.max_weight_elements:
            return xla_head(hidden, w, transposed)
        return gemv(hidden, w, transposed=transposed, out_dtype=jnp.float32, interpret=self.interpret)


def make(kind, interpret: bool | None = None) -> XlaMatmul | PallasMatmul | None:
    """None for "xla-plain" (the model's plain `@` code path, unchanged), else the hook; a hook object passes through
    (benchmarks build variants)."""
    if not isinstance(kind, str):
        return kind
    kind = resolve(kind)
    if kind == "xla-plain":
        log.info("dense matmuls: XLA (plain)")
        return None
    return XlaMatmul() if kind == "xla" else PallasMatmul(interpret=interpret)
