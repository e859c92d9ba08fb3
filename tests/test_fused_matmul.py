"""The serving layout (fused QKV and gate+up, models/llama.py `fuse_params`) and the matmul hooks (models/matmul.py:
"xla", the GEMV epilogues with the add + RMSNorm kernel; interpret mode on the CPU) give the same model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jphoton import SamplingParams
from jphoton.models import llama
from jphoton.models.config import ModelConfig
from jphoton.models.matmul import XlaMatmul, make, resolve
from jphoton.weights.random_init import random_params

from conftest import FIXTURES, make_llm, tiny_reference

pytestmark = pytest.mark.usefixtures("drop_compiled_programs_after_each_test")

CFG = ModelConfig(architecture="llama", vocab_size=101, hidden_size=48, intermediate_size=80, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=12, qkv_bias=True, o_bias=True, name="tiny-random")


def _random(cfg):
    params = random_params(cfg, jnp.float32, seed=int(np.random.default_rng().integers(1 << 30)))
    # non-zero biases and norms, so that the fused biases are exercised too
    leaves, treedef = jax.tree_util.tree_flatten(params)
    rng = np.random.default_rng(1)  # (numpy: each new jax.random shape is a compile)
    leaves = [a + jnp.asarray(0.05 * rng.standard_normal(a.shape), a.dtype) for a in leaves]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _drop(params, key):
    return {**params, "layers": {k: v for k, v in params["layers"].items() if k != key}}


def _hidden(params, cfg, tokens, matmul=None, unroll=False):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    kv = tuple(llama.init_dense_kv(cfg, tokens.shape[0], tokens.shape[1], jnp.float32))
    hidden, _ = llama.forward(params, cfg, tokens, positions, kv, llama.dense_attention(cfg, positions),
                              unroll=unroll, matmul=matmul)
    return np.asarray(hidden), np.asarray(llama.lm_head(params, hidden.reshape(-1, cfg.hidden_size), matmul))


@pytest.mark.parametrize("tie", [False, True])
def test_fused_params_and_matmul_hooks_match_the_unfused_xla_forward(tie):
    cfg = CFG.replace(tie_embeddings=tie)
    params = _random(cfg)
    tokens = jnp.asarray(np.random.default_rng().integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    ref_h, ref_logits = _hidden(params, cfg, tokens)

    host = jax.tree_util.tree_map(np.asarray, params)  # the host path: numpy leaves fused with numpy
    fused = llama.fuse_params(cfg, host)
    assert {"wqkv", "bqkv", "w_gate_up"} <= set(fused["layers"]) and "wq" not in fused["layers"]
    assert fused["layers"]["wqkv"].shape == (2, 48, cfg.q_size + 2 * cfg.kv_size)
    assert isinstance(fused["layers"]["wqkv"], np.ndarray) and "wq" in host["layers"]  # consume=False keeps the input
    fused = jax.tree_util.tree_map(jnp.asarray, fused)
    for matmul in (None, XlaMatmul(), XlaMatmul(glu_gemv=True, interpret=True)):
        for p in (params, fused):
            h, logits = _hidden(p, cfg, tokens, matmul, unroll=matmul is not None)
            np.testing.assert_allclose(h, ref_h, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-4)
    # "fused" with O's bias (the residual kernel does not take one: O stays in XLA, down takes the kernel), and without
    mm = make("fused", interpret=True)
    for c, p in ((cfg, fused), (cfg.replace(o_bias=False), _drop(fused, "bo"))):
        h, logits = _hidden(p, c, tokens, mm, unroll=True)
        ref_h2, ref_logits2 = (ref_h, ref_logits) if c.o_bias else _hidden(_drop(params, "bo"), c, tokens)
        np.testing.assert_allclose(h, ref_h2, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(logits, ref_logits2, rtol=1e-4, atol=1e-4)

    # the per-layer layout of the unrolled engine (llama.unstack_layers), from numpy and from device leaves, with every
    # hook: the kernels get a stack of one and index 0
    for src in (jax.tree_util.tree_map(np.asarray, fused), fused):
        per_layer = llama.unstack_layers(src)
        assert isinstance(per_layer["layers"], tuple) and len(per_layer["layers"]) == cfg.num_layers
        assert per_layer["layers"][1]["wqkv"].shape == (48, cfg.q_size + 2 * cfg.kv_size)
        assert isinstance(src["layers"], dict)  # consume=False leaves the input as it was
        for matmul in (None, XlaMatmul(glu_gemv=True, interpret=True), mm):
            h, logits = _hidden(per_layer, cfg, tokens, matmul)
            np.testing.assert_allclose(h, ref_h, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-4)
    # the layers' vectors (norms, biases) stay [L, X] stacks: fewer arrays to pass to each step
    vectors = {k for k, a in fused["layers"].items() if a.ndim == 2}
    assert vectors == {"attn_norm", "mlp_norm", "bqkv", "bo"}
    assert per_layer["layer_vectors"].keys() == vectors and per_layer["layer_vectors"]["bo"] is src["layers"]["bo"]
    popped = dict(fused, layers=dict(fused["layers"]))
    assert llama.unstack_layers(popped, consume=True)["layers"][0].keys() == fused["layers"].keys() - vectors
    assert popped["layers"] == {}  # consume=True empties the stacks as it splits them
    assert llama.unstack_layers(per_layer) is not None and llama.unstack_layers(per_layer)["layers"] is per_layer["layers"]
    # per-layer dicts that still hold their vectors (an older layout) get them stacked
    old = dict(per_layer, layers=tuple(llama.layer_params(per_layer, i) for i in range(cfg.num_layers)))
    del old["layer_vectors"]
    again = llama.unstack_layers(old)
    assert again["layers"][1].keys() == per_layer["layers"][1].keys()
    np.testing.assert_array_equal(again["layer_vectors"]["mlp_norm"], fused["layers"]["mlp_norm"])
    np.testing.assert_allclose(_hidden(old, cfg, tokens, mm)[0], ref_h, rtol=1e-4, atol=1e-4)  # forward takes it too

    consumed = dict(params, layers=dict(params["layers"]))
    again = llama.fuse_params(cfg, consumed, consume=True)  # device leaves; the parts leave the caller's dict
    assert "wq" not in consumed["layers"] and "w_up" not in consumed["layers"]
    assert llama.fuse_params(cfg, again)["layers"].keys() == again["layers"].keys()


@pytest.mark.parametrize("lead", [(1,), (1, 1), (3,), (2, 2)])
def test_two_row_dot_matches_plain_dot(lead):
    """The one-token padding of the "xla" kind: same product, same shape, for one row and for several."""
    rng = np.random.default_rng(len(lead) * 10 + lead[-1])
    x = jnp.asarray(rng.standard_normal((*lead, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 48, 40)), jnp.float32)
    out = jax.jit(lambda x, w: XlaMatmul()(x, w[2]))(x, w)
    assert out.shape == (*lead, 40)
    np.testing.assert_allclose(out, x @ w[2], rtol=1e-5, atol=1e-5)


def test_resolve_rejects_unknown_kinds():
    assert resolve("auto") == "xla-plain"  # CPU
    with pytest.raises(ValueError):
        resolve("cublas")


def test_engine_greedy_tokens_with_gemv_matmuls_match_xla_and_hf():
    """A tiny HF checkpoint (Qwen2: QKV biases) through the engine, fused layout, decode steps through the GEMV and
    the add + RMSNorm kernel (interpret mode), prefill steps above the row threshold through XLA."""
    ref = tiny_reference("qwen2")
    n = len(ref[0][1])
    greedy = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p.tolist()} for p, _, _ in ref]
    tokens = {}
    # "fused" below 17 rows + the residual kernel from one row: every GEMV epilogue and the add + RMSNorm kernel
    for kind in ("xla", "fused", XlaMatmul(glu_gemv=True, residual_gemv=True)):
        llm = make_llm(str(FIXTURES / "tiny" / "qwen2"), matmul=kind, warmup=False)
        assert "wqkv" in llm.model.params["layers"]
        # one-row decode steps run as two rows (one padding row per step instead of a pad inside every matmul)
        assert llm.engine.scheduler.config.decode_buckets == (2, 8)
        tokens[str(kind)] = [o.token_ids for o in llm.generate(prompts, greedy)]
    want = [t.tolist() for _, t, _ in ref]
    assert all(t == want for t in tokens.values()) and len(tokens) == 3
