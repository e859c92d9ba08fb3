"""The engine step and the second sampler as programs over a tensor-parallel mesh (models/tensor_parallel.py): the
KV pool [L, slots, Hkv, hd] is sharded by KV head, the logits buffers [R, V] by vocabulary, every other buffer is
replicated, and `engine_step` runs per shard under `shard_map`. The runner (engine/runner.py) jits what these return
with the shardings from `step_jit`."""

from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jphoton.engine.step import resample
from jphoton.models import tensor_parallel

KV_SPEC = P(None, None, tensor_parallel.AXIS, None)
LOGITS_SPEC = P(None, tensor_parallel.AXIS)


def check_placement(params, mesh, param_specs) -> None:
    """The step's shard_map reads each leaf by its name's spec: a leaf placed otherwise would be resharded in every
    step, silently."""
    specs = jax.tree_util.tree_leaves(param_specs, is_leaf=lambda x: isinstance(x, P))
    misplaced = [jax.tree_util.keystr(path) for (path, a), spec in
                 zip(jax.tree_util.tree_leaves_with_path(params), specs, strict=True)
                 if not a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim)]
    if misplaced:
        raise ValueError(f"tensor parallel: params not placed by their layout: {misplaced[:4]}")


def step_jit(params, kv_sharding, logits_sharding, replicated):
    """`jax.jit` with the step's shardings pinned (the step's shape static; the KV pool and the slot's two output
    buffers donated, as on one device)."""
    kv_shardings = (kv_sharding, kv_sharding)
    return functools.partial(
        jax.jit, static_argnums=(0,), donate_argnums=(2, 4, 5),
        in_shardings=(jax.tree.map(lambda a: a.sharding, params), kv_shardings, replicated, replicated,
                      logits_sharding, replicated, None, None, None),
        out_shardings=(replicated, logits_sharding, kv_shardings))


def sharded_step(step, tp, mesh, param_specs):
    """The engine step as one program over the mesh. One shard-mapped function per (shape, variant), kept: a new one
    per trace would miss JAX's tracing and lowering caches, and a step compiled at warm-up would compile again when
    first called."""
    kv_specs = (KV_SPEC, KV_SPEC)

    @functools.cache
    def program(shape, filtered, lora):
        return jax.shard_map(functools.partial(step, shape, filtered=filtered, lora=lora, tp=tp), mesh=mesh,
                             in_specs=(param_specs, kv_specs, P(), P(), LOGITS_SPEC, P()),
                             out_specs=(P(), LOGITS_SPEC, kv_specs), check_vma=False)

    def sharded(shape, params, kv, prev_tokens, out_tokens, out_logits, packed, lora_weights=None, automaton=None,
                out_states=None, *, filtered=False, lora=False):  # (no device automata under tensor parallelism)
        return program(shape, filtered, lora)(params, kv, prev_tokens, out_tokens, out_logits, packed)

    return sharded


def sharded_resample(tp, mesh):
    """The second sampler over vocabulary-sharded logits: gathered first (grammar masks, filters and logprobs read
    whole rows; only steps that need this sampler pay the gather)."""

    @functools.cache
    def program(filtered, num_logprobs, masked, count):
        def body(logits, *rest):
            return resample(filtered, num_logprobs, masked, tp.gather_vocab(logits), *rest)

        return jax.shard_map(body, mesh=mesh, in_specs=(LOGITS_SPEC, *[P()] * count),
                             out_specs=(P(), P(), P(), P()), check_vma=False)

    def sharded(filtered, num_logprobs, masked, logits, *rest):
        return program(filtered, num_logprobs, masked, len(rest))(logits, *rest)

    return sharded
