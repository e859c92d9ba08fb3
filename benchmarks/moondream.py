"""Moondream 2 served by jphoton, measured as .kestrel/bench_kestrel.py measures Photon's engine (kestrel) on the same
checkpoint file (benchmarks/gpu_suite.sh moondream-vs-kestrel): one JSON line a measurement (also appended to --out),
the same names, prompts and token counts.

    python3 benchmarks/moondream.py --model CKPT_DIR --out $OUT/moondream_jphoton.jsonl
    python3 benchmarks/moondream.py --model random:moondream2 --only decode --variants '{"matmul": "xla"}'

Rows: start-up (process start -> `LLM()` returned, and -> every step shape compiled), first token of one 128-token
text query (p50 of 5), decode at batch 1 (256 tokens, p50 of 3), output tokens/s with 32 and 64 concurrent text queries
(128 in, 256 out, 2 reps), an image query (a random 378x378 JPEG + 8-word question, 32 tokens: 3 cold images, the
first a warm-up, then one repeated: a prefix-cache hit), a caption, and point / detect (cold and cached image); every
text answer runs to max_tokens (ignore_eos).
The text prompts are kestrel's: random words `w<id>` of the checkpoint's word-level tokenizer (one id each).
--variants: decode at batch 1 and device step times for other `matmul` kinds (each a fresh engine in this process).
--smoke: a tiny random checkpoint on the CPU with few tokens (tests/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import collections
import gc
import io
import json
import os
import random
import statistics
import sys
import tempfile
import time

T0 = time.time()
sys.path.insert(0, __file__.rsplit("/", 2)[0])


def emit(out_file, **rec):
    rec.setdefault("t_s", round(time.time() - T0, 3))
    line = json.dumps(rec, default=str)
    print(line, flush=True)
    if out_file:
        with open(out_file, "a") as f:
            f.write(line + "\n")


def process_age_s() -> float:
    """Seconds since this process started (from /proc: the interpreter's start-up counts, as in kestrel's row)."""
    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    start = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return float(open("/proc/uptime").read().split()[0]) - start


def words(n: int, rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(1000, 51000)}" for _ in range(n))


def jpeg(seed: int, size: int = 378) -> bytes:
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    b = io.BytesIO()
    Image.fromarray(arr).save(b, format="JPEG", quality=90)
    return b.getvalue()


QUERY_TEMPLATE_TOKENS = 6  # BOS + the query prefix (3) + the suffix twice


def timed_stream(llm, skill: str, image, text: str, params) -> tuple[float, float, int]:
    """(seconds to the first token, seconds to the end, tokens) of one streamed request, from its submission (the
    image's decode and crops included)."""
    t = time.perf_counter()
    first, n = None, 0
    stream = llm.query(image, text, params, stream=True) if skill == "query" else \
        llm.caption(image, text, params, stream=True)
    for delta in stream:
        if delta.token_ids and first is None:
            first = time.perf_counter() - t
        n += len(delta.token_ids)
    return first, time.perf_counter() - t, n


def concurrent_text(llm, n: int, prompt_words: int, out_tokens: int, rng: random.Random) -> dict:
    """n text queries submitted at once, run to the end by the engine loop in this thread: output tokens/s."""
    from jphoton import SamplingParams

    params = SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True)
    seqs = [llm.prepare_skill("query", None, words(prompt_words, rng), params) for _ in range(n)]
    first: dict[int, float] = {}
    t = time.perf_counter()
    for s in seqs:
        llm.add_request(s)
    out = 0
    while llm.has_unfinished_requests():
        for o in llm.step():
            out += len(o.delta.token_ids)
            if o.delta.token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t
    wall = time.perf_counter() - t
    return {"concurrency": n, "out_tokens_total": out, "wall_s": round(wall, 3), "out_tok_per_s": round(out / wall, 1),
            "ttft_ms_p50": round(1e3 * statistics.median(first.values()), 2),
            "steps": step_breakdown([r for r in llm.engine.telemetry.records if r.t_plan >= t])}


def step_breakdown(records) -> dict:
    """The run's steps from the engine's telemetry: how many of each kind, the seconds until the last step holding
    prompt tokens was done (the prefill phase), and for the decode-only phase after it: the p50 gap between consecutive
    steps' results (the device's step time if the device is the bottleneck), the host's p50 ms per tick in planning,
    launching and committing, and how long a commit waited for its step's result (~0: the host is the bottleneck)."""
    kinds = collections.Counter(r.kind for r in records)
    last_prefill = max((r.t_ready for r in records if r.kind != "decode"), default=records[0].t_plan if records else 0)
    decode = sorted((r for r in records if r.kind == "decode" and r.t_ready > last_prefill), key=lambda r: r.t_ready)
    gaps = [b.t_ready - a.t_ready for a, b in zip(decode, decode[1:], strict=False)]

    def p50(f):
        return round(1e3 * statistics.median(f(r) for r in decode), 3) if decode else None

    return {"count": dict(kinds), "prefill_phase_s": round(last_prefill - records[0].t_plan, 3) if records else 0,
            "decode_gap_ms_p50": round(1e3 * statistics.median(gaps), 3) if gaps else None,
            "host_ms_p50": {"plan": p50(lambda r: r.t_planned - r.t_plan), "launch": p50(lambda r: r.t_launched - r.t_launch),
                            "commit": p50(lambda r: r.t_committed - r.t_ready)},
            "commit_wait_ms_p50": p50(lambda r: r.t_ready - r.t_commit)}


def measure(llm, args, out_file, rng: random.Random, tag: str) -> None:
    from jphoton import SamplingParams

    q_words = max(1, args.prompt_tokens - QUERY_TEMPLATE_TOKENS)
    greedy = dict(temperature=0, ignore_eos=True)
    if "ttft" in args.only:
        runs = [timed_stream(llm, "query", None, words(q_words, rng), SamplingParams(max_tokens=8, **greedy))
                for _ in range(6)][1:]
        emit(out_file, m="ttft_text_1req", engine=tag, prompt_tokens=q_words + QUERY_TEMPLATE_TOKENS,
             wall_first_token_ms_p50=round(1e3 * statistics.median(r[0] for r in runs), 2),
             wall_first_token_ms_min=round(1e3 * min(r[0] for r in runs), 2))
    if "decode" in args.only:
        timed_stream(llm, "query", None, words(q_words, rng), SamplingParams(max_tokens=4, **greedy))  # (warm)
        runs = [timed_stream(llm, "query", None, words(q_words, rng), SamplingParams(max_tokens=args.out_tokens,
                                                                                       **greedy)) for _ in range(3)]
        per_tok = [1e3 * (wall - first) / max(1, n - 1) for first, wall, n in runs]
        emit(out_file, m="decode_b1", engine=tag, out_tokens=args.out_tokens,
             ms_per_token_p50=round(statistics.median(per_tok), 3), runs=[round(x, 3) for x in per_tok],
             device_step_ms={b: round(llm.device_step_ms(b), 3) for b in args.step_rows})
    if "throughput" in args.only:
        for n in args.concurrency:
            for rep in range(args.reps):
                emit(out_file, m="throughput_text", engine=tag, rep=rep, prompt_tokens=q_words + QUERY_TEMPLATE_TOKENS,
                     **concurrent_text(llm, n, q_words, args.out_tokens, rng))
    if "image" in args.only and llm.model.vision is not None:
        params = SamplingParams(max_tokens=args.image_tokens, **greedy)
        rows = []
        for seed in (1, 2, 3, 3):  # the first a warm-up, two cold images, then the last one again (cached)
            first, wall, n = timed_stream(llm, "query", jpeg(seed, args.image_size), words(8, rng), params)
            rows.append({"image_seed": seed, "ttft_ms": round(1e3 * first, 2), "wall_ms": round(1e3 * wall, 2),
                         "tokens": n})
        cold = rows[1:3]
        stats = llm.stats()
        emit(out_file, m="image_query", engine=tag, size=f"{args.image_size}x{args.image_size}",
             max_tokens=args.image_tokens, prompt_positions=1 + llm.model.vision.embed_rows + 3 + 8 + 2,
             wall_ms_cold_p50=statistics.median(r["wall_ms"] for r in cold),
             ttft_ms_cold_p50=statistics.median(r["ttft_ms"] for r in cold), repeat_image=rows[3], first_call=rows[0],
             runs=cold, image_cache_hits=stats.get("image_cache_hits"), prefix_hit_tokens=stats["prefix_hit_tokens"])
        first, wall, n = timed_stream(llm, "caption", jpeg(3, args.image_size), "short",
                                      SamplingParams(max_tokens=args.image_tokens, **greedy))
        emit(out_file, m="caption", engine=tag, length="short", ttft_ms=round(1e3 * first, 2),
             wall_ms=round(1e3 * wall, 2), tokens=n)
        # point / detect as the kit asks kestrel (its objects w2000 / w2001, 16 answer steps: 8 points, 5 boxes), on
        # a new image (cold: decode, encoder, prefill) and on it again (cached); the objects found are reported
        # (greedy answers that end at eos run fewer steps)
        for skill, obj, limit, seed in (("point", "w2000", 8, 11), ("detect", "w2001", 5, 12)):
            image = jpeg(seed, args.image_size)
            runs = {}
            for label in ("cold", "cached"):
                t = time.perf_counter()
                found = getattr(llm, skill)(image, obj, max_objects=limit)
                runs[label] = {"wall_ms": round(1e3 * (time.perf_counter() - t), 2), "objects": len(found)}
            emit(out_file, m=skill, engine=tag, object=obj, max_objects=limit, **runs)


def report(folder: str) -> str:
    """The side-by-side table of moondream_jphoton.jsonl and moondream_kestrel.jsonl in `folder` (markdown): each row
    jphoton, kestrel, their ratio and issue 62's target where it sets one."""
    def rows(name):
        out = {}
        path = os.path.join(folder, name)
        for line in open(path) if os.path.exists(path) else []:
            rec = json.loads(line)
            if rec.get("engine", "jphoton") != "jphoton" and name.endswith("jphoton.jsonl"):
                rec["m"] = f"{rec['m']} {rec['engine']}"
            out.setdefault(rec["m"], []).append(rec)
        return out

    j, k = rows("moondream_jphoton.jsonl"), rows("moondream_kestrel.jsonl")

    def get(recs, m, *path, pick=max, where=None):
        vals = []
        for rec in recs.get(m, []):
            if where and any(rec.get(a) != b for a, b in where.items()):
                continue
            for p in path:
                rec = rec.get(p) if isinstance(rec, dict) else None
            if isinstance(rec, (int, float)):
                vals.append(rec)
        return pick(vals) if vals else None

    table = [  # (row, m, path, lower is better, target ratio jphoton / kestrel, pick over reps)
        ("start -> engine ready, s (jphoton: `LLM()` returned)", "startup", ("since_process_start_s",), True, 1.0),
        ("text query, 128 tokens: first token, ms (p50)", "ttft_text_1req", ("wall_first_token_ms_p50",), True, None),
        ("decode at batch 1, ms/token (p50)", "decode_b1", ("ms_per_token_p50",), True, 0.8),
        ("32 concurrent text queries, output tok/s (best of 2)", "throughput_text", ("out_tok_per_s",), False, None,
         {"concurrency": 32}),
        ("64 concurrent text queries, output tok/s (best of 2)", "throughput_text", ("out_tok_per_s",), False, 1.3,
         {"concurrency": 64}),
        ("image query 378x378 + 8 words, 32 tokens: wall, ms", "image_query", ("wall_ms_cold_p50",), True, 0.8),
        ("image query: first token, ms", "image_query", ("ttft_ms_cold_p50",), True, 1.0),
        ("same image again (prefix cache): wall, ms", "image_query", ("repeat_image", "wall_ms"), True, None),
    ]
    lines = ["| row | jphoton | kestrel 0.9.2 | jphoton / kestrel | target | met |", "|---|---|---|---|---|---|"]
    for row, m, path, lower, target, *where in table:
        where = where[0] if where else None
        pick = min if lower else max
        a, b = get(j, m, *path, pick=pick, where=where), get(k, m, *path, pick=pick, where=where)
        ratio = a / b if a is not None and b else None
        met = "" if ratio is None or target is None else (
            "yes" if (ratio <= target if lower else ratio >= target) else "no")
        tgt = "" if target is None else f"{'<=' if lower else '>='} {target}x"
        a, b = (round(v, 2) if v is not None else "-" for v in (a, b))
        lines.append(f"| {row} | {a} | {b} | "
                     f"{f'{ratio:.3f}' if ratio is not None else '-'} | {tgt} | {met} |")
    ready = get(j, "startup", "all_shapes_ready_since_start_s")
    cache = next((r.get("compile_cache") for r in j.get("startup", [])), None)
    for skill in ("point", "detect"):
        kk = get(k, "image_skills", skill, "wall_ms")
        for label in ("cold", "cached"):
            jj = get(j, skill, label, "wall_ms")
            ratio = jj / kk if jj is not None and kk else None
            met = "" if ratio is None else ("yes" if ratio <= 0.8 else "no")
            lines.append(f"| {skill} 378x378 ({label}; kestrel: after a caption of its image), wall ms, objects "
                         f"{get(j, skill, label, 'objects')} | {jj if jj is not None else '-'} | "
                         f"{kk if kk is not None else '-'} | {f'{ratio:.3f}' if ratio is not None else '-'} | "
                         f"<= 0.8x | {met} |")
    m3 = rows("moondream3_jphoton.jsonl")  # (gpu_suite.sh moondream3: random weights, decode rows only)
    for b in (1, 32):
        step = next((r["device_step_ms"].get(str(b), r["device_step_ms"].get(b)) for r in m3.get("decode_b1", [])),
                    None)
        per_tok = get(m3, "decode_b1", "ms_per_token_p50", pick=min) if b == 1 else None
        lines.append(f"| Moondream 3 (random bf16), decode at batch {b}: "
                     f"{'ms/token (p50); ' if b == 1 else ''}device step, ms | "
                     f"{'-' if per_tok is None else per_tok}; step {step if step else '-'} | "
                     f"not run: kestrel serves Moondream 3 only with FP8 experts | - | | |")
    cap_j, cap_k = get(j, "caption", "wall_ms"), get(k, "image_skills", "caption", "wall_ms")
    lines.append(f"\njphoton's start with a {cache} compile cache; every step shape compiled: {ready} s after start; "
                 f"caption (short, 32 tokens, cached image): "
                 f"jphoton {cap_j} ms, kestrel {cap_k} ms; compiles while serving: "
                 f"{get(j, 'serving', 'compiles_while_serving')}")
    return "\n".join(lines)


def vision_attention_check(out_file) -> dict:
    """The vision encoder's attention as the engine runs it on this backend (cuDNN's flash attention on a GPU) and the
    plain einsums, both in bfloat16 on the real shape, against the einsums in float32: max abs differences. Exits
    if the fast path is off by more than twice the plain path (+0.01)."""
    import jax
    import jax.numpy as jnp

    from jphoton.models.moondream_vision import vision_attention

    q, k, v = (jax.random.normal(jax.random.key(i), (2, 729, 16, 72), jnp.float32) for i in range(3))
    ref = vision_attention(q, k, v, "xla")
    diffs = {}
    for impl in ("xla", "cudnn") if jax.default_backend() == "gpu" else ("xla",):
        out = jax.jit(vision_attention, static_argnums=3)(*(a.astype(jnp.bfloat16) for a in (q, k, v)), impl)
        diffs[impl] = round(float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))), 5)
    emit(out_file, m="vision_attention_check", max_abs_diff_vs_float32=diffs)
    if diffs.get("cudnn", 0.0) > 2 * diffs["xla"] + 0.01:
        raise SystemExit(f"vision attention: cuDNN differs from the float32 einsums by {diffs}")
    return diffs


def tiny_checkpoint() -> str:
    """A small random Moondream 2 checkpoint in the official layout (the CPU smoke test)."""
    from jphoton.models.moondream import MoondreamConfig, RegionConfig, TextConfig, VisionConfig
    from jphoton.weights.moondream import write_random_checkpoint

    cfg = MoondreamConfig(text=TextConfig(dim=128, ff_dim=256, n_layers=2, n_heads=2),
                          vision=VisionConfig(enc_dim=144, ff_dim=288, n_layers=2, n_heads=2, proj_inner_dim=256),
                          region=RegionConfig(inner_dim=256))
    d = tempfile.mkdtemp(prefix="jphoton-moondream-")
    write_random_checkpoint(d, cfg, seed=0)
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:moondream2")
    ap.add_argument("--out", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--out-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--image-size", type=int, default=378)
    ap.add_argument("--image-tokens", type=int, default=32)
    ap.add_argument("--step-rows", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--only", nargs="+", default=["ttft", "decode", "throughput", "image"],
                    help="rows after start-up (`--only startup`: none; the programs compile into the cache)")
    ap.add_argument("--variants", nargs="*", default=[],
                    help='engines with other options, as JSON (e.g. \'{"matmul": "xla-plain"}\'): decode rows only')
    ap.add_argument("--options", default="{}", help="LLM(...) keywords as JSON (default: none, as a user starts it)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--report", metavar="DIR", help="print the jphoton / kestrel table of DIR's JSON lines and exit")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    options = json.loads(args.options)
    if args.smoke:
        args.model = tiny_checkpoint()
        args.prompt_tokens, args.out_tokens, args.image_tokens, args.reps = 16, 6, 4, 1
        args.concurrency, args.step_rows, args.image_size = [4], [1], 200
        options = {"max_num_seqs": 4, "max_num_batched_tokens": 1024, "dtype": "float32", "warmup": "off",
                   **options}

    import jax

    from benchmarks.common import device_info
    from jphoton import LLM
    from jphoton.weights.store import cache_dir

    xla_cache = cache_dir().parent / "xla"  # (programs compiled by an earlier process: a warm start)
    warm = xla_cache.is_dir() and any(xla_cache.iterdir())
    emit(args.out, m="env", import_s=round(time.time() - T0, 2), model=args.model, options=options, **device_info())
    t = time.perf_counter()
    llm = LLM(args.model, **options)
    t_llm = time.perf_counter() - t
    age = process_age_s()
    llm.wait_until_ready()
    emit(args.out, m="startup", engine="jphoton", compile_cache="warm" if warm else "cold",
         since_process_start_s=round(age, 2), llm_s=round(t_llm, 2),
         all_shapes_ready_since_start_s=round(process_age_s(), 2), num_compiles=llm.stats()["num_compiles"],
         config={k: str(v) for k, v in vars(llm.engine_config).items() if k in ("max_num_seqs", "buckets",
                                                                               "max_num_batched_tokens", "kernels")},
         gpu_mem_gib=round((jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30, 2))
    vision_attention_check(args.out)
    rng = random.Random(1234)
    at_ready = llm.stats()["num_compiles"]
    measure(llm, args, args.out, rng, "jphoton")
    stats = llm.stats()
    emit(args.out, m="serving", engine="jphoton", compiles_while_serving=stats["num_compiles"] - at_ready,
         kv_pages_leaked=stats["kv_pages_total"] - stats["kv_pages_free"] - stats["kv_pages_evictable"])
    for spec in args.variants:
        del llm
        gc.collect()
        llm = LLM(args.model, **{"warmup": "off", **options, **json.loads(spec)})  # (compiles what it runs)
        llm.wait_until_ready()
        measure(llm, argparse.Namespace(**{**vars(args), "only": ["decode"]}), args.out, rng, f"jphoton {spec}")
    emit(args.out, m="done", total_s=round(time.time() - T0, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
