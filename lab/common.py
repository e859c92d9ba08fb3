"""Helpers of the lab scripts that reach into the engine's internals (the runner's jitted step, its slots and layouts)
as they were when the scripts ran. The product's benchmarks (benchmarks/) use the public API only."""

from __future__ import annotations

import time

import jax
import numpy as np


def decode_step_input(runner, shape, context: int = 0) -> jax.Array:
    """The packed input of a decode-only step (on the device) whose rows each attend over `context` tokens held on
    pages of their own. `context=0`: every row on the trash page at position 0 (the layout's padding)."""
    ps = runner.static.page_size
    views = runner.layout(shape).empty(runner.static.trash_page)
    if context:
        pages = -(-context // ps)
        if pages > runner.static.pages_per_seq:
            raise ValueError(f"context {context} needs {pages} pages; a row holds {runner.static.pages_per_seq}")
        real = runner.static.trash_page  # pages 0 .. trash_page - 1 are the pool's own
        for i in range(shape.decode_rows):
            views["d_table"][i, :pages] = (i * pages + np.arange(pages)) % real
        views["d_pos"][:] = context - 1
    return jax.device_put(views["_buffer"], runner.device)


def steps_back_to_back(runner, shape, packed: jax.Array, n: int, then=None) -> float:
    """Seconds per step of n engine steps of `shape` dispatched back to back on the same packed input (no host work
    between; then(slot) after each if given), through the runner's own jitted step and slots."""
    t0 = time.perf_counter()
    for _ in range(n):
        slot = runner.slots[runner._next_slot]
        slot.tokens, slot.logits, runner.kv = runner._step(shape, runner.params, runner.kv, runner._prev_tokens,
                                                           slot.tokens, slot.logits, packed)
        if then is not None:
            then(slot)
        runner._prev_tokens = slot.tokens
        runner._next_slot ^= 1
    jax.block_until_ready(runner.kv)
    return (time.perf_counter() - t0) / n


def compiled_text(runner, shape) -> str:
    """The optimized HLO of the step that `steps_back_to_back` runs (same arguments, so the same executable)."""
    packed = decode_step_input(runner, shape)
    slot = runner.slots[runner._next_slot]
    return runner._step.lower(shape, runner.params, runner.kv, runner._prev_tokens, slot.tokens, slot.logits,
                              packed).compile().as_text()


def device_us_per_call(fn, logits: jax.Array, iters: int = 50) -> float:
    """Device microseconds per call of fn(logits [R, V], i) -> int32 [R] (a sampler), run `iters` times inside one
    jitted fori_loop: each iteration's logits depend on the last one's tokens (never true, but XLA cannot hoist the
    call), so the figure is the device time, not dispatch. Best of 3."""
    import jax.numpy as jnp

    R = logits.shape[0]

    @jax.jit
    def loop(lg0):
        def body(i, carry):
            lg, acc = carry
            tok = fn(lg, i)
            return lg + (tok[:, None] < -5).astype(jnp.float32), acc + tok
        return jax.lax.fori_loop(0, iters, body, (lg0, jnp.zeros(R, jnp.int32)))[1]

    loop(logits).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        loop(logits).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best / iters * 1e6


def add_staggered_args(ap, concurrency: int = 64) -> None:
    """The load options of the staggered-arrival probes (tick_trace.py, replay_ticks.py)."""
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--concurrency", type=int, default=concurrency)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--default-engine", action="store_true", help="the default engine (all buckets) as serving.py")
    ap.add_argument("--out", default=None)


def staggered_setup(args):
    """(llm, prompts, params, duration): the default engine (or buckets narrowed to the run), C x R random prompts, the
    greedy params, and one request's duration from a static run of C (which also runs every path once), for
    benchmarks/serving.py engine_staggered's starts."""
    import random

    from benchmarks.common import default_llm, timed_run
    from jphoton import LLM, SamplingParams

    c = args.concurrency
    if args.default_engine:
        llm = default_llm(args.model, progress=False)
    else:
        llm = LLM(args.model, max_model_len=1024, max_num_seqs=c, decode_buckets=(c,),
                  prefill_buckets=((1, args.prompt_len), (4, args.prompt_len)),
                  max_num_batched_tokens=c + 4 * args.prompt_len, warmup="full", progress=False)
    rng = random.Random(1)
    vocab = llm.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(c * args.requests_per_client)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    r = timed_run(llm, prompts[:c], params)
    return llm, prompts, params, r.decode_ms_median / 1e3 * args.new_tokens
