"""Tensor parallelism (models/tensor_parallel.py, docs/tensor-parallel.md) on CPU devices: conftest.py makes the host
platform show 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jphoton import SamplingParams
from jphoton.engine.sampling import sample_plain
from jphoton.models import tensor_parallel as tp
from jphoton.models.llama import fuse_params, unstack_layers
from jphoton.weights.load import load_model
from jphoton.weights.random_init import parse_random_spec, random_params

from conftest import FIXTURES, make_llm, shared_llm, tiny_reference

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (conftest.py sets XLA_FLAGS)")

PROMPTS = [{"prompt_token_ids": p} for p in ([1, 5, 9, 23, 77], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [200, 100, 50])]
# greedy, sampled with top-k (the filtered sampler over gathered logits), sampled with logprobs (the second sampler)
PARAMS = [SamplingParams(max_tokens=10, temperature=0.0),
          SamplingParams(max_tokens=10, temperature=0.9, top_k=5, seed=2),
          SamplingParams(max_tokens=10, temperature=0.8, seed=3, logprobs=2)]
SMALL = dict(decode_buckets=(4,), prefill_buckets=((2, 32),), max_num_batched_tokens=64)
# MoE layers through the plain-JAX grouped GEMM: the warp-decode kernels would run in Pallas interpret mode here (their
# shards are tested on the GPU: benchmarks/tensor_parallel.py)
MOE = dict(moe_backend="expert_centric")


def _greedy_equals_hf(llm, family):
    """Greedy tokens of the family's committed HF transformers reference (tests/fixtures/tiny/*/reference.npz)."""
    ref = tiny_reference(family)
    out = llm.generate([{"prompt_token_ids": p.tolist()} for p, _, _ in ref],
                       SamplingParams(max_tokens=len(ref[0][1]), temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in out] == [t.tolist() for _, t, _ in ref]


@pytest.fixture(scope="module")
def llama3_tp4():
    """llama3 at TP=4 (2 KV heads: each replicated on two shards), every step shape compiled up front: one engine for
    the HF match, the TP=1 comparison and the no-compile check."""
    with shared_llm(FIXTURES / "tiny" / "llama3", tensor_parallel_size=4, **SMALL) as llm:
        yield llm


def _check_kv_sharding(llm, size):
    runner = llm.engine.runner
    assert runner.kv[0].sharding.spec == P(None, None, "tp", None)
    assert runner.kv[0].shape[2] == max(llm.config.num_kv_heads, size)


@pytest.mark.parametrize("family,size", [("qwen2", 2), ("qwen3_moe", 4)])
def test_greedy_tokens_equal_hf(family, size):
    """Dense (qwen2: tied embeddings and q/k/v biases) and MoE (its expert stacks split 4 ways, KV heads replicated),
    float32, against HF's greedy tokens (what TP=1 produces: tests/test_families.py)."""
    llm = make_llm(FIXTURES / "tiny" / family, tensor_parallel_size=size, warmup="off", **SMALL,
                   **(MOE if family == "qwen3_moe" else {}))
    _check_kv_sharding(llm, size)
    _greedy_equals_hf(llm, family)


def test_greedy_tokens_equal_hf_at_tp4(llama3_tp4):
    """TP=4 with 2 KV heads replicates each KV head on two shards."""
    _check_kv_sharding(llama3_tp4, 4)
    _greedy_equals_hf(llama3_tp4, "llama3")


def test_sampled_rows_and_logprobs_equal_tp1(llama3_tp4):
    """Plain sampled rows (the sharded sampler), top-k rows (logits gathered for the filtered sampler) and logprobs (the
    second sampler) draw what one device draws."""
    one = make_llm(FIXTURES / "tiny" / "llama3", warmup="off", **SMALL).generate(PROMPTS, PARAMS)
    four = llama3_tp4.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in four] == [o.token_ids for o in one]
    for got, want in zip(four[2].logprobs, one[2].logprobs, strict=True):
        assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-4)


def test_no_compile_after_warmup(llama3_tp4):
    llm = llama3_tp4
    before = llm.stats()["num_compiles"]
    llm.generate(PROMPTS, PARAMS)
    _greedy_equals_hf(llm, "llama3")
    assert llm.stats()["num_compiles"] == before


def test_sharded_sampler_matches_unsharded():
    """Each shard draws the unsharded noise of its vocabulary slice; the winner across shards is the unsharded argmax
    (ties: the first index), for greedy and sampled rows."""
    rng = np.random.default_rng(0)
    R, V, n = 6, 64, 4
    logits = rng.standard_normal((R, V)).astype(np.float32)
    logits[0, [5, 40]] = 9.0  # a tie across shards: the first index wins
    temperature = np.array([0, 0.7, 1.0, 0, 1.5, 0.3], np.float32)
    key = rng.integers(0, 2**32, (R, 2), dtype=np.uint64).astype(np.uint32)
    index = np.arange(R, dtype=np.int32)
    want = sample_plain(jnp.asarray(logits), temperature, key, index)
    mesh = tp.make_mesh(n)
    shard = tp.TensorParallel(n)
    fn = jax.shard_map(lambda lg, t, k, i: sample_plain(lg, t, k, i, tp=shard), mesh=mesh,
                       in_specs=(P(None, "tp"), P(), P(), P()), out_specs=P(), check_vma=False)
    got = jax.jit(fn)(logits, temperature, key, index)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(got[0]) == 5


def test_random_weights_are_one_model_in_every_layout():
    """random_params' values depend only on (seed, leaf, layer): the checkpoint layout fused and unstacked equals the
    serving layout made directly, and a sharded build holds the same values (KV heads replicated at TP=4)."""
    cfg = parse_random_spec("random:llama3.2-1b:layers=2:vocab=256").replace(hidden_size=64, intermediate_size=128,
                                                                            num_heads=4, num_kv_heads=2, head_dim=16)
    plain = unstack_layers(fuse_params(cfg, random_params(cfg, jnp.float32)))
    direct = random_params(cfg, jnp.float32, fused=True, per_layer=True)
    jax.tree.map(np.testing.assert_array_equal, plain, direct)
    sharded = random_params(cfg, jnp.float32, fused=True, per_layer=True, mesh=tp.make_mesh(2))
    assert sharded["layers"][0]["wqkv"].sharding.spec == P(None, "tp")
    order = tp.column_order(cfg, 2, "qkv")  # shard order of the fused columns
    np.testing.assert_array_equal(np.asarray(sharded["layers"][1]["wqkv"]),
                                  np.asarray(direct["layers"][1]["wqkv"])[:, order])
    np.testing.assert_array_equal(np.asarray(sharded["embed"]), np.asarray(direct["embed"]))
    wide = random_params(cfg, jnp.float32, mesh=tp.make_mesh(4))  # 2 KV heads on 4 shards: each held twice
    want = np.asarray(random_params(cfg, jnp.float32)["layers"]["wk"])[:, :, tp.column_order(cfg, 4, "kv")]
    np.testing.assert_array_equal(np.asarray(wide["layers"]["wk"]), want)


def test_checkpoint_loads_onto_shards():
    """A HF checkpoint is placed tensor by tensor on its shards (never whole on one device)."""
    mesh = tp.make_mesh(2)
    loaded = load_model(FIXTURES / "tiny" / "llama3", "float32", mesh=mesh)
    wq = loaded.params["layers"]["wq"]
    assert wq.sharding.spec == P(None, None, "tp") and len(wq.sharding.device_set) == 2
    whole = load_model(FIXTURES / "tiny" / "llama3", "float32").params["layers"]["wq"]
    np.testing.assert_array_equal(np.asarray(wq), np.asarray(whole))


@pytest.mark.parametrize("options,message", [
    (dict(tensor_parallel_size=8), "only 4 cpu device"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
    (dict(tensor_parallel_size=2, max_loras=1), "not supported yet"),
])
def test_refused_configs(options, message):
    with pytest.raises(ValueError, match=message):
        make_llm(FIXTURES / "tiny" / "llama3", warmup="off", **SMALL, **options)


def test_model_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide this model's num_heads 3"):
        make_llm(FIXTURES / "tiny" / "smollm2", tensor_parallel_size=2, warmup="off", **SMALL)


def test_two_processes_with_jax_distributed():
    """Tensor parallel over two processes (one CPU device each, `jax.distributed`, gloo collectives): both give HF's
    greedy tokens. The multi-host layout of docs/tensor-parallel.md, on one machine."""
    from tests.multihost_cpu import main

    assert not main()


def test_import_turns_off_xla_one_shot_all_reduce():
    """The one-shot all-reduce kernel's per-program scratch ran two GPUs out of memory (docs/tensor-parallel.md):
    `import jphoton` turns it off through XLA_FLAGS, keeping the user's other flags and the user's own setting."""
    import os
    import subprocess
    import sys
    code = "import os, jphoton; print(os.environ['XLA_FLAGS'])"

    def run(flags):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "XLA_FLAGS": flags}).stdout.strip()

    off = "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false"
    assert run("--xla_dump_to=/tmp/x") == f"--xla_dump_to=/tmp/x {off}"
    assert run("") == off
    mine = off.replace("false", "true")
    assert run(mine) == mine
    # JAX's backend started before the import: too late for the flag, which the package records (the runner warns)
    code = "import jax; jax.devices(); import jphoton; print(jphoton.ONE_SHOT_FLAG_LATE)"
    assert run("") == "True"
    code = "import jax, jphoton; jax.devices(); print(jphoton.ONE_SHOT_FLAG_LATE)"
    assert run("") == "False"


def test_pallas_attention_kernels_on_shards():
    """attention="pallas" (the GPU default: paged decode and prefill kernels, here in interpret mode) inside the
    sharded step: each shard's kernels see its own KV heads; greedy tokens still HF's."""
    llm = make_llm(FIXTURES / "tiny" / "llama3", tensor_parallel_size=2, warmup="off", attention="pallas", **SMALL)
    assert llm.engine.runner.static.pallas_attention
    _greedy_equals_hf(llm, "llama3")
