"""Helpers shared by the benchmark scripts (public jphoton API only): device facts, read bandwidth, a timed engine run,
a closed loop of requests, result files, and the QUICK switch of benchmarks/gpu_suite.sh."""

from __future__ import annotations

import bisect
import collections
import contextlib
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

QUICK = os.environ.get("QUICK", "0") not in ("", "0")  # gpu_suite.sh QUICK=1: fewer shapes / tokens / reps


def device_info() -> dict:
    d = jax.devices()[0]
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "device": d.device_kind,
            "backend": jax.default_backend(), "jax": jax.__version__, "python": platform.python_version(),
            "quick": QUICK}


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


def default_llm(model, max_rows: int = 0, **options):
    """`LLM(model)` as a user builds it: the default step shapes, KV pool and context (`max_num_seqs` raised only when a
    run needs more than the default 64 rows at once), then every shape compiled before anything is timed
    (`wait_until_ready`): no hand-picked buckets (issue 22)."""
    from jphoton import LLM

    if max_rows > 64:
        options["max_num_seqs"] = max_rows
    t0 = time.perf_counter()
    llm = LLM(model, **options)
    first = time.perf_counter() - t0
    llm.wait_until_ready()
    s = llm.stats()
    print(f"LLM({model!r}): serving after {first:.1f} s, all {s['shapes_total']} step shapes ready after "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return llm


def weight_bytes(cfg, itemsize: int = 2) -> int:
    """Bytes of a dense Llama-family model's weights (what one decode step reads), from its ModelConfig."""
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    layer = h * (cfg.num_heads * cfg.head_dim + 2 * kv) + cfg.num_heads * cfg.head_dim * h + 3 * h * cfg.intermediate_size
    embed = cfg.vocab_size * h * (1 if cfg.tie_embeddings else 2)
    return itemsize * (cfg.num_layers * (layer + 2 * h) + embed + h)


def kv_bytes_read(cfg, batch: int, ctx: float, itemsize: int = 2) -> float:
    return batch * ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


@dataclasses.dataclass
class RunStats:
    batch: int
    wall_s: float
    new_tokens: int
    decode_steps: int
    decode_ms_median: float  # ms per tick that launched a decode-only step
    decode_ms_mean: float
    ttft_ms_median: float
    compiles_during_run: int
    slowest_ticks: list = dataclasses.field(default_factory=list)  # (tick index, kind, ms) of the 5 longest ticks
    gc_ms: dict = dataclasses.field(default_factory=dict)  # generation -> ms the cyclic GC ran during the run
    gc_ticks: list = dataclasses.field(default_factory=list)  # indices of the ticks a full (gen 2) collection hit
    token_ids: dict = dataclasses.field(default_factory=dict)  # request id -> generated token ids

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.wall_s


def _prompt(p):
    return {"prompt_token_ids": list(p)} if not isinstance(p, (str, dict)) else p


@contextlib.contextmanager
def gc_watch(ticks: list):
    """Yields {generation: ms} of cyclic GC time during the block, and the tick indices (len(ticks) at the time) that
    a full collection hit (as a second value)."""
    ms, full, t0 = collections.defaultdict(float), [], [0.0]

    def on_gc(phase, info):
        if phase == "start":
            t0[0] = time.perf_counter()
            return
        ms[info["generation"]] += 1e3 * (time.perf_counter() - t0[0])
        if info["generation"] == 2:
            full.append(len(ticks))

    gc.callbacks.append(on_gc)
    try:
        yield ms, full
    finally:
        gc.callbacks.remove(on_gc)


def timed_run(llm, prompts: list, params, guard: bool = True, ttft: dict | None = None) -> RunStats:
    """Queue every prompt at once (token id lists or strings), step the engine to the end, and time each step() call
    by the kind of engine step it launched (telemetry). params: one SamplingParams for all, or one per prompt.
    ttft: filled with {request id: seconds from the start to its first token}. The prefix cache is emptied first: a
    benchmark that runs its prompts again (an untimed twin, another depth) times full prefills, as a reference
    engine without the cache would do them."""
    llm.reset_prefix_cache()
    per = params if isinstance(params, list) else [params] * len(prompts)
    rids = [llm.add_request(_prompt(p), sp) for p, sp in zip(prompts, per, strict=True)]
    tokens = {r: [] for r in rids}
    c0 = llm.stats()["num_compiles"]
    llm.telemetry.clear()
    ticks, first_token = [], {}
    t_start = time.perf_counter()
    with gc_watch(ticks) as (gc_ms, gc_ticks), (jax.transfer_guard("disallow") if guard else contextlib.nullcontext()):
        while llm.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = llm.step()
            t1 = time.perf_counter()
            ticks.append((t0, t1))
            for o in outs:
                if o.delta.token_ids:
                    first_token.setdefault(o.request_id, t1 - t_start)
                    tokens[o.request_id] += o.delta.token_ids
    wall = time.perf_counter() - t_start
    if ttft is not None:
        ttft.update(first_token)
    recs = tick_records(ticks, llm.telemetry.records)
    kinds = [r.kind if r is not None else None for r in recs]
    dur = [t1 - t0 for t0, t1 in ticks]
    # (a tick that launched K decode steps at once counts as K steps of 1/K its time: ms per decode step)
    decode = [t / r.steps for t, r in zip(dur, recs, strict=True) if r is not None and r.kind == "decode"]
    decode = decode[2:] or decode or [float("nan")]  # the first ticks after the last prefill still carry its commit
    return RunStats(batch=len(prompts), wall_s=wall, new_tokens=sum(map(len, tokens.values())),
                    decode_steps=len(decode), decode_ms_median=1e3 * statistics.median(decode),
                    decode_ms_mean=1e3 * statistics.fmean(decode),
                    ttft_ms_median=1e3 * statistics.median(first_token.values()) if first_token else float("nan"),
                    compiles_during_run=llm.stats()["num_compiles"] - c0,
                    slowest_ticks=sorted(((i, k, round(1e3 * t, 3)) for i, (t, k) in enumerate(zip(dur, kinds,
                                                                                                  strict=True))),
                                         key=lambda x: -x[2])[:5],
                    gc_ms={g: round(ms, 3) for g, ms in sorted(gc_ms.items())}, gc_ticks=gc_ticks,
                    token_ids=tokens)


def tick_records(ticks: list[tuple[float, float]], records) -> list:
    """The record of the engine step each step() call launched (the one whose t_launch falls inside the call), or
    None."""
    recs = sorted(records, key=lambda r: r.t_launch)
    starts = [r.t_launch for r in recs]
    out = []
    for t0, t1 in ticks:
        i = bisect.bisect_left(starts, t0)
        out.append(recs[i] if i < len(recs) and starts[i] <= t1 else None)
    return out


def tick_kinds(ticks: list[tuple[float, float]], records) -> list[str | None]:
    """The kind of the engine step each step() call launched."""
    return [r.kind if r is not None else None for r in tick_records(ticks, records)]


def closed_loop(llm, streams: int, requests_per_stream: int, seed: int, prompt_len: int = 64, make_params=None,
                lengths=(50, 150)) -> dict:
    """`streams` requests in flight at all times until streams x requests_per_stream are done. make_params(i) gives
    request i's SamplingParams (default: greedy, ignore_eos, max_tokens uniform in `lengths`). Launch-to-launch
    periods and host phases come from the engine's telemetry. The prefix cache is emptied first (as in timed_run)."""
    from jphoton import SamplingParams

    llm.reset_prefix_cache()
    rng = np.random.default_rng(seed)
    total = streams * requests_per_stream
    max_tokens = rng.integers(lengths[0], lengths[1] + 1, size=total).tolist()
    prompts = [rng.integers(0, llm.config.vocab_size, prompt_len).tolist() for _ in range(total)]
    if make_params is None:
        def make_params(i):
            return SamplingParams(max_tokens=max_tokens[i], temperature=0, ignore_eos=True)
    index, out = {}, {}  # request id -> submission index; index -> {"text", "token_ids", "finish_reason"}

    def submit():
        i = len(index)
        index[llm.add_request({"prompt_token_ids": prompts[i]}, make_params(i))] = i
        out[i] = {"text": "", "token_ids": [], "finish_reason": None}

    for _ in range(streams):
        submit()
    llm.telemetry.clear()
    t0 = time.perf_counter()
    with jax.transfer_guard("disallow"):
        while llm.has_unfinished_requests():
            for o in llm.step():
                r = out[index[o.request_id]]
                r["text"] += o.delta.text or ""
                r["token_ids"] += o.delta.token_ids
                if o.finished:
                    r["finish_reason"] = o.delta.finish_reason
                    if len(index) < total:
                        submit()
    wall = time.perf_counter() - t0
    recs = sorted(llm.telemetry.records, key=lambda r: r.step_id)
    decode = [r for r in recs if r.kind == "decode"]
    # A pipelined launch waits for the commit of the step two back, so a period reflects the device time of the step
    # before it: count decode periods only where that step was a decode step too.
    periods = [c.t_launch - b.t_launch for a, b, c in zip(recs, recs[1:], recs[2:], strict=False)
               if a.kind == b.kind == c.kind == "decode"] or [float("nan")]
    host = [(r.t_planned - r.t_plan) + (r.t_launched - r.t_launch) + (r.t_committed - r.t_ready) for r in decode]
    by_kind: dict[str, list[float]] = {}  # launch-to-launch period of every step, by the step's kind
    for a, b in zip(recs, recs[1:], strict=False):
        by_kind.setdefault(a.kind, []).append(b.t_launch - a.t_launch)
    tokens = sum(len(r["token_ids"]) for r in out.values())
    return dict(wall_s=wall, tokens=tokens, tok_s=tokens / wall, mean_len=tokens / total,
                lengths=[len(out[i]["token_ids"]) for i in range(total)], outputs=[out[i] for i in range(total)],
                period_ms=1e3 * statistics.median(periods), host_ms=1e3 * statistics.median(host or [float("nan")]),
                steps=len(recs), kind_periods={k: (len(v), statistics.median(v)) for k, v in by_kind.items()},
                # in a pipelined run a long step's device time shows up in the periods after it: only the mean over
                # every step charges each kind what it really costs
                mean_period_ms=1e3 * (recs[-1].t_launch - recs[0].t_launch) / max(1, len(recs) - 1),
                timeline=llm.telemetry.timeline())


def write_json(path: str | os.PathLike, payload: dict) -> None:
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=1, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o)
                            else str(o)))
