"""Qwen3-MoE against HF transformers (float32) with both MoE backends, and the warp-decode kernels against a float32
reference on random inputs (Pallas interpret mode on the CPU: the same kernel code the GPU compiles)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jphoton import SamplingParams
from jphoton.models import llama, moe
from jphoton.models.config import ModelConfig
from jphoton.weights import load_model
from jphoton.weights.random_init import parse_random_spec, random_params
from pallas_kernels.moe_warp_decode import default_config, moe_reference, moe_warp_decode

from conftest import FIXTURES, make_llm, tiny_reference

pytestmark = pytest.mark.usefixtures("drop_compiled_programs_after_each_test")

MOE_DIR = FIXTURES / "tiny" / "qwen3_moe"
BACKENDS = ("warp_decode", "expert_centric")
TOL = 1e-4  # max|Δ| / max|ref|, as for the dense families


def rel_err(ours, ref) -> float:
    return float(np.abs(np.asarray(ours, np.float32) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def tiny_moe():
    return load_model(MOE_DIR, "float32")


def _sequences():
    return [np.concatenate([p, t[:-1]]) for p, t, _ in tiny_reference("qwen3_moe")]


# ---- the family ------------------------------------------------------------------------------------------------------


def test_config_and_layer_pattern(tiny_moe):
    cfg = tiny_moe.config
    assert cfg.architecture == "qwen3_moe" and cfg.qk_norm and cfg.norm_topk_prob
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 36)
    assert cfg.moe_layers == (0, 2) and cfg.dense_layers == (1,)
    p = tiny_moe.params
    assert p["moe"]["w_gate"].shape == (2, 8, 36, 64) and p["moe"]["w_down"].shape == (2, 8, 64, 36)
    assert p["moe"]["router"].shape == (2, 64, 8) and p["dense_mlp"]["w_gate"].shape == (1, 64, 80)
    assert "w_gate" not in p["layers"]
    # HF's rule: MoE iff not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    sparse = cfg.replace(num_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert sparse.moe_layers == (1, 5) and sparse.dense_layers == (0, 2, 3, 4)
    assert ModelConfig.from_json(sparse.to_json()) == sparse
    big = parse_random_spec("random:qwen3-30b-a3b:layers=3")
    assert big.num_layers == 3 and big.moe_layers == (0, 1, 2) and big.num_experts == 128
    assert llama.param_shapes(big)["moe"]["w_gate"] == (3, 128, 768, 2048)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_hf_at_every_position(tiny_moe, backend):
    ours = llama.reference_logits(tiny_moe.params, tiny_moe.config, _sequences(), moe_backend=backend)
    for o, (_, _, ref) in zip(ours, tiny_reference("qwen3_moe"), strict=True):
        assert rel_err(o, ref) <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_match_hf_through_the_engine(backend):
    llm = make_llm(str(MOE_DIR), warmup=False, moe_backend=backend)
    ref = tiny_reference("qwen3_moe")
    params = SamplingParams(max_tokens=len(ref[0][1]), temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p, _, _ in ref], params)
    for out, (_, tokens, _) in zip(outs, ref, strict=True):
        assert out.token_ids == tokens.tolist()


def test_dropping_norm_topk_prob_breaks_the_match(tiny_moe):
    cfg = tiny_moe.config.replace(norm_topk_prob=False)
    ours = llama.reference_logits(tiny_moe.params, cfg, _sequences()[:1], moe_backend="expert_centric")
    assert rel_err(ours[0], tiny_reference("qwen3_moe")[0][2]) > 100 * TOL


def test_fused_expert_tensors_load_the_same(tmp_path, tiny_moe):
    """transformers 5 keeps experts fused ([E, 2F, D] gate_up, [E, D, F] down); such a checkpoint loads the same."""
    tensors = load_file(str(MOE_DIR / "model.safetensors"))
    fused = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in tiny_moe.config.moe_layers:
        pre = f"model.layers.{layer}.mlp.experts"
        stack = {kind: np.stack([tensors[f"{pre}.{e}.{kind}_proj.weight"] for e in range(8)])
                 for kind in ("gate", "up", "down")}
        fused[f"{pre}.gate_up_proj"] = np.concatenate([stack["gate"], stack["up"]], axis=1)
        fused[f"{pre}.down_proj"] = stack["down"]
    save_file(fused, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((MOE_DIR / "config.json").read_text())
    m = load_model(tmp_path, "float32")
    for a, b in zip(jax.tree_util.tree_leaves(m.params), jax.tree_util.tree_leaves(tiny_moe.params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_convert_to_a_store_round_trips(tmp_path, tiny_moe):
    from jphoton.cli import main

    assert main(["convert", str(MOE_DIR), str(tmp_path / "store")]) == 0
    m = load_model(tmp_path / "store", "float32")
    assert m.config == tiny_moe.config.replace(name=m.config.name)
    for a, b in zip(jax.tree_util.tree_leaves(m.params), jax.tree_util.tree_leaves(tiny_moe.params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_scanned_and_unrolled_layers_agree():
    """With every layer MoE the layer loop is a lax.scan indexing the expert stacks with a traced layer number."""
    cfg = parse_random_spec("random:qwen3-30b-a3b:layers=2:vocab=128").replace(
        hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24)
    params = random_params(cfg, "float32", seed=3)
    seqs = [np.arange(1, 12), np.arange(5, 9)]
    scanned = llama.reference_logits(params, cfg, seqs, unroll=False, moe_backend="warp_decode")
    unrolled = llama.reference_logits(params, cfg, seqs, unroll=True, moe_backend="expert_centric")
    for a, b in zip(scanned, unrolled, strict=True):
        assert rel_err(a, b) < 1e-5
    # the engine's unrolled layout: one dict per layer, experts as a stack of one (llama.unstack_layers)
    per_layer = llama.unstack_layers(params)
    assert len(per_layer["layers"]) == 2 and per_layer["moe"][1]["w_gate"].shape == params["moe"]["w_gate"].shape[1:]
    for backend in BACKENDS:
        for a, b in zip(scanned, llama.reference_logits(per_layer, cfg, seqs, unroll=True, moe_backend=backend),
                        strict=True):
            assert rel_err(a, b) < 1e-5, backend


def test_auto_runs_warp_decode_up_to_the_threshold(monkeypatch):
    """The choice is made at trace time from the step's token count (a static shape: one choice per bucket)."""
    calls = []
    for name in ("warp_decode", "expert_centric"):
        monkeypatch.setitem(moe._EXPERTS, name, lambda x, *a, name=name: calls.append(name) or x)
    E, D = 4, 8
    mp = {"router": jnp.zeros((1, D, E)), "w_gate": None, "w_up": None, "w_down": None}
    for n in (1, moe.WARP_DECODE_MAX_TOKENS, moe.WARP_DECODE_MAX_TOKENS + 1):
        jax.eval_shape(lambda x: moe.moe_ffn(x, mp, 0, 2, True, "auto"), jax.ShapeDtypeStruct((n, D), jnp.float32))
    assert calls == ["warp_decode", "warp_decode", "expert_centric"]


def test_bad_moe_backend_is_a_value_error():
    with pytest.raises(ValueError, match="moe_backend"):
        make_llm(str(MOE_DIR), warmup=False, moe_backend="fastest")
    assert moe.resolve_backend("auto", moe.WARP_DECODE_MAX_TOKENS) == "warp_decode"
    assert moe.resolve_backend("auto", moe.WARP_DECODE_MAX_TOKENS + 1) == "expert_centric"


# ---- the kernels -----------------------------------------------------------------------------------------------------


def make_problem(T, E, K, D, F, dtype=jnp.bfloat16, layers=1, pool=None, seed=0):
    """Random weights scaled to unit-ish outputs; top-k ids drawn from a pool of `pool` experts so rows repeat them.
    (Drawn with numpy: each jax.random draw of a new shape is a compile, ~0.3 s on the CI box.)"""
    rng = np.random.default_rng(seed)

    def normal(shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * np.float32(scale)).astype(dtype)

    x = normal((T, D))
    wg, wu = normal((layers, E, F, D), D ** -0.5), normal((layers, E, F, D), D ** -0.5)
    wd = normal((layers, E, D, F), F ** -0.5)
    choice = np.argsort(rng.random((T, pool or E)), axis=1)[:, :K]
    ids = jnp.asarray(rng.permutation(E)[:pool or E][choice], jnp.int32)
    logits = rng.standard_normal((T, K))
    w = jnp.asarray(np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True), jnp.float32)
    return x, ids, w, wg, wu, wd


# (T, E, K, D, F, pool, slots): B from 1 to 64, odd hidden/intermediate sizes, experts repeated across rows
KERNEL_CASES = [
    (1, 8, 2, 72, 40, None, "auto"),
    (2, 16, 4, 64, 48, 5, "pairs"),
    (3, 8, 2, 40, 24, None, "experts"),
    (7, 16, 4, 96, 80, 6, "auto"),
    (16, 32, 8, 128, 72, 12, "auto"),
    (33, 8, 3, 48, 100, None, "auto"),
    (64, 16, 8, 64, 48, 10, "auto"),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"T{c[0]}_E{c[1]}_K{c[2]}_D{c[3]}_F{c[4]}_{c[6]}")
def test_warp_decode_matches_the_float32_reference(case):
    T, E, K, D, F, pool, slots = case
    layers, layer = 3, 1
    x, ids, w, wg, wu, wd = make_problem(T, E, K, D, F, layers=layers, pool=pool, seed=T)
    ref = np.asarray(moe_reference(x, ids, w, wg, wu, wd, layer))
    # the per-size default tiles, some loops unrolled in Python, others fori loops
    cfg = default_config(T, E, K, D, F)
    cfg = dataclasses.replace(cfg, slots=slots, unroll_gate_up=cfg.unroll_gate_up or T in (7, 64),
                              unroll_down=cfg.unroll_down or T in (16, 33))
    # the layer index traced (as in a scanned layer loop), and bf16 in and out
    run = jax.jit(lambda *a: moe_warp_decode(*a, config=cfg))
    out = run(x, ids, w, wg, wu, wd, jnp.int32(layer))
    assert out.dtype == jnp.bfloat16 and out.shape == (T, D)
    assert rel_err(out, ref) < 1e-2  # the bf16 output rounding is ~4e-3 of the largest value
    if T in (1, 7, 33):  # float32 everything: only summation order differs
        f32 = [a if a is ids else a.astype(jnp.float32) for a in (x, ids, w, wg, wu, wd)]
        out32 = moe_warp_decode(*f32, layer=layer, config=cfg)
        assert rel_err(out32, np.asarray(moe_reference(*f32, layer))) < 2e-6


@pytest.mark.parametrize("T", [1, 5])
def test_gelu_plus1_experts_match_the_float32_reference(T):
    """Moondream 3's experts, exact GELU(gate) * (up + 1): the kernel (its erf from exp), the expert-centric path and
    the reference (jax.nn.gelu, erf) agree in float32; SiLU's answer is far from them (the option is used)."""
    E, K, D, F = 8, 3, 40, 24
    x, ids, w, wg, wu, wd = make_problem(T, E, K, D, F, layers=2, pool=None, seed=40 + T)
    f32 = [a if a is ids else a.astype(jnp.float32) for a in (x, ids, w, wg, wu, wd)]
    ref = np.asarray(moe_reference(*f32, 1, activation="gelu_plus1"))
    assert rel_err(moe_warp_decode(*f32, layer=1, activation="gelu_plus1"), ref) < 2e-6
    assert rel_err(moe.expert_centric(*f32, layer=1, activation="gelu_plus1"), ref) < 2e-6
    assert rel_err(np.asarray(moe_reference(*f32, 1)), ref) > 0.1
    with pytest.raises(ValueError, match="activation"):
        moe_warp_decode(*f32, layer=1, activation="relu")


@pytest.mark.parametrize("T", [1, 8, 64])
@pytest.mark.parametrize("shape", [(128, 8, 2048, 768), (16, 4, 72, 40), (64, 8, 2048, 1024)],
                         ids=["qwen3-30b-a3b", "odd", "moondream3"])
def test_kernels_lower_to_triton_for_the_gpu(T, shape, monkeypatch):
    """Cross-lower for CUDA (no GPU needed): every op in both kernels has a Pallas Triton lowering rule and the Triton
    IR is built. (Triton's own compile to PTX happens on the GPU.)"""
    from jax import export

    try:  # jax >= 0.11 asks which GPU it lowers for; say an H100 (0.10 assumes sm_90 when it finds no GPU)
        from jax._src.pallas.triton import gpu_info

        monkeypatch.setitem(gpu_info.registry, "cpu", lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100))
    except (ImportError, AttributeError):
        pass

    E, K, D, F = shape
    L = 2
    args = [jax.ShapeDtypeStruct(s, d) for s, d in (
        ((T, D), jnp.bfloat16), ((T, K), jnp.int32), ((T, K), jnp.float32), ((L, E, F, D), jnp.bfloat16),
        ((L, E, F, D), jnp.bfloat16), ((L, E, D, F), jnp.bfloat16), ((), jnp.int32))]
    act = "gelu_plus1" if E == 64 else "silu"
    fn = jax.jit(lambda x, i, w, g, u, d, layer: moe_warp_decode(x, i, w, g, u, d, layer, interpret=False,
                                                                 activation=act))
    exported = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 2


def test_warp_decode_is_closer_to_float32_than_bf16_expert_centric(record_property):
    """bf16 weights and activations; warp decode keeps SiLU(gate)*up and the combine in fp32, the expert-centric path
    rounds its intermediates to bf16 like a bf16 grouped-GEMM pipeline. Errors are RMS over the output, relative."""
    T, E, K, D, F = 16, 16, 4, 256, 192
    x, ids, w, wg, wu, wd = make_problem(T, E, K, D, F, pool=8, seed=11)
    ref = np.asarray(moe_reference(x, ids, w, wg, wu, wd, 0))

    def rms(a):
        return float(np.sqrt(np.mean((np.asarray(a, np.float32) - ref) ** 2) / np.mean(ref ** 2)))

    errors = {
        "warp_decode_bf16_out": rms(moe_warp_decode(x, ids, w, wg, wu, wd, 0)),
        "warp_decode_f32_out": rms(moe_warp_decode(x, ids, w, wg, wu, wd, 0, out_dtype=jnp.float32)),
        "expert_centric_bf16": rms(moe.expert_centric(x, ids, w, wg, wu, wd, 0)),
    }
    print("relative RMS error vs float32:", json.dumps(errors))
    record_property("moe_bf16_errors", json.dumps(errors))
    assert errors["warp_decode_f32_out"] < errors["warp_decode_bf16_out"] < errors["expert_centric_bf16"]
