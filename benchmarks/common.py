"""Helpers shared by the benchmark scripts: device facts, read bandwidth, a timed engine run, result files."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import gc
import json
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def device_info() -> dict:
    d = jax.devices()[0]
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "device": d.device_kind,
            "backend": jax.default_backend(), "jax": jax.__version__, "python": platform.python_version()}


def read_bandwidth(gib: float = 8.0, reps: int = 10) -> float:
    """Bytes/s of a large `jnp.sum` (a pure read), measured now, on this device."""
    n = int(gib * 2**30) // 2
    x = jax.jit(lambda: jnp.ones((n,), jnp.bfloat16))()
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    f(x).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(x)
    out.block_until_ready()
    bw = n * 2 * reps / (time.perf_counter() - t0)
    del x
    return bw


def decode_step_input(runner, shape, context: int = 0) -> jax.Array:
    """The packed input of a decode-only step (on the device) whose rows each attend over `context` tokens held on
    pages of their own, as in serving. `context=0`: every row on the trash page at position 0 (the layout's padding),
    which makes attention nearly free and, through the static gather, keeps every KV read in L2. Page tables cycle
    through the pool, so size it (num_kv_pages >= rows x pages) for the reads to be distinct."""
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
    between; then(slot) after each if given, e.g. a second sampler), through the runner's own jitted step and slots."""
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


def param_bytes(params) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(params))


@dataclasses.dataclass
class RunStats:
    batch: int
    depth: int
    wall_s: float
    new_tokens: int
    decode_steps: int
    decode_ms_median: float  # ms per tick in which only decode rows ran
    decode_ms_mean: float
    ttft_ms_median: float
    compiles_during_run: int
    slowest_ticks: list = dataclasses.field(default_factory=list)  # (tick index, kind, ms) of the 5 longest ticks
    gc_ms: dict = dataclasses.field(default_factory=dict)  # generation -> ms the cyclic GC ran during the run
    gc_ticks: list = dataclasses.field(default_factory=list)  # indices of the ticks a full (gen 2) collection hit

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.wall_s


def timed_run(llm, prompts: list[list[int]], params, guard: bool = True) -> RunStats:
    """Submit every prompt at once, tick the engine to the end, and time each tick by the kind of step it launched."""
    from jphoton.engine import compiles

    seqs = llm._make_sequences(prompts, params)
    for s in seqs:
        llm._submit(s)
    kinds = []
    plan = llm.engine.scheduler.plan

    def spy():
        p = plan()
        kinds.append(None if p is None else ("decode" if not p.prefill else "prefill"))
        return p

    llm.engine.scheduler.plan = spy
    c0 = compiles.num_compiles()
    ticks, first_token = [], {}
    gc_ms, gc_ticks, gc_t0 = collections.defaultdict(float), [], [0.0]

    def on_gc(phase, info):  # the time each collection takes, and which tick a full one lands in
        if phase == "start":
            gc_t0[0] = time.perf_counter()
            return
        gc_ms[info["generation"]] += 1e3 * (time.perf_counter() - gc_t0[0])
        if info["generation"] == 2:
            gc_ticks.append(len(ticks))

    gc.callbacks.append(on_gc)
    t_start = time.perf_counter()
    ctx = jax.transfer_guard("disallow") if guard else _null()
    try:
        with ctx:
            while llm.engine.has_work():
                t0 = time.perf_counter()
                llm._tick()
                ticks.append(time.perf_counter() - t0)
                for s in seqs:
                    if s.output_ids and s.request_id not in first_token:
                        first_token[s.request_id] = time.perf_counter() - t_start
    finally:
        del llm.engine.scheduler.plan
        gc.callbacks.remove(on_gc)
    wall = time.perf_counter() - t_start
    for s in seqs:
        llm._outputs.pop(s.request_id, None)
    decode = [t for t, k in zip(ticks, kinds, strict=True) if k == "decode"]
    decode = decode[2:] or decode  # the first ticks after the last prefill still carry its commit
    return RunStats(batch=len(prompts), depth=llm.engine.depth, wall_s=wall,
                    new_tokens=sum(len(s.output_ids) for s in seqs), decode_steps=len(decode),
                    decode_ms_median=1e3 * statistics.median(decode), decode_ms_mean=1e3 * statistics.fmean(decode),
                    ttft_ms_median=1e3 * statistics.median(first_token.values()),
                    compiles_during_run=compiles.num_compiles() - c0,
                    slowest_ticks=sorted(((i, k, round(1e3 * t, 3)) for i, (t, k) in enumerate(zip(ticks, kinds,
                                                                                                  strict=True))),
                                         key=lambda x: -x[2])[:5],
                    gc_ms={g: round(ms, 3) for g, ms in sorted(gc_ms.items())}, gc_ticks=gc_ticks)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def write_json(path: str | os.PathLike, payload: dict) -> None:
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=1, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o)
                            else str(o)))
