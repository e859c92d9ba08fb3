"""Device time of single step shapes (issue 23): where does a mixed step (decode rows + one arrival's 128-token prefill
chunk) spend its time beyond a decode-only step?

One engine, no warm-up; each shape compiled on first use. Every shape runs back to back on the device (no host work
between: the runner's jitted step, its slots, one packed input already on the device), as Runner.time_decode_steps
does, with real decode contexts (each decode row `--context` tokens on pages of its own) and real prefill rows (128
tokens at position 0, pages of their own). Shapes:

  decode-only C and 2C rows (2C all real, and C real + C padding rows as the scheduler pads them);
  prefill-only (0, 1, 128, ctx), mixed (2C, 1, 128, ctx) [today's mixed shape: C real decode rows + C padding],
  mixed (C, 1, 128, ctx) [unpadded], and the same with 4 prefill rows; ctx = the context bucket the scheduler picks for
  a 128-token chunk at position 0 (Scheduler._ctx_for), plus variants with the prefill rows over the exact 8 pages;
  then the dense part alone (model.forward with an attention stub + the LM head on the sampled rows) at the token
  counts of those steps, which splits the step into weight matmuls vs attention/KV/sampling. --four adds the shapes
  with 4 prefill rows and one whose chunk is cut to 128 - C tokens (the step holds 128 tokens in all).

Rounds interleave the shapes; ms per step is the median over rounds.

    python3 lab/probes/mixed_shapes.py --model random:llama3.2-1b --out $OUT/mixed_shapes.json
    python3 lab/probes/mixed_shapes.py --model random:smollm2-135m:layers=2:vocab=4096 --rows 4 --steps 3 --rounds 1
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3.2-1b")
    ap.add_argument("--rows", type=int, default=32, help="running decode rows C (mixed padded shape has 2C)")
    ap.add_argument("--context", type=int, default=192, help="tokens each decode row attends over")
    ap.add_argument("--chunk", type=int, default=128, help="prefill chunk tokens")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-dense", action="store_true", help="skip the dense-only timings")
    ap.add_argument("--four", action="store_true", help="also the shapes with 4 prefill rows (timed after the rest)")
    ap.add_argument("--compile-threads", type=int, default=6)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import device_info
    from jphoton import LLM
    from jphoton.engine.compiles import num_compiles
    from jphoton.engine.scheduler import StepShape

    C, T = args.rows, args.chunk
    out: dict = {"device": device_info(), "args": vars(args), "ms": {}, "ms_rounds": {}, "compile_s": {}}
    print(json.dumps(out["device"]), flush=True)

    def dump():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)

    t0 = time.perf_counter()
    llm = LLM(args.model, max_model_len=1024, max_num_seqs=2 * C, decode_buckets=(C, 2 * C),
              prefill_buckets=((1, T), (4, T)), max_num_batched_tokens=2 * C + 4 * T, attention=args.attention,
              warmup="off", progress=False)
    out["build_s"] = time.perf_counter() - t0
    runner = llm.engine.runner
    sched = runner.sched
    static = runner.static
    ps, trash = static.page_size, static.trash_page
    out["config"] = {"decode_buckets": sched.decode_buckets, "prefill_buckets": sched.prefill_buckets,
                     "context_buckets": sched.context_buckets, "pallas_attention": runner.static.pallas_attention,
                     "mixed_decode_rows": sched.mixed_decode_rows, "page_size": ps, "num_pages": trash,
                     "pages_per_seq": static.pages_per_seq, "matmul": llm.engine_config.kernels.matmul}

    def bucket(pages: int) -> int:
        """Scheduler._ctx_for: the smallest context bucket holding `pages` (0 with no buckets)."""
        cb = sched.context_buckets
        return next((c for c in cb if c >= pages), cb[-1]) if cb else 0

    d_pages = -(-args.context // ps)
    p_pages = -(-T // ps)
    p_ctx = bucket(p_pages)  # what the scheduler picks for a 128-token chunk at position 0
    static_decode = bool(sched.context_buckets)
    d_ctx = bucket(d_pages) if static_decode else 0
    out["config"].update(decode_ctx_pages=d_ctx, prefill_ctx_pages=p_ctx, decode_pages_per_row=d_pages,
                         prefill_pages_per_row=p_pages)

    def packed_for(shape: StepShape, real_decode: int, real_prefill: int | None = None) -> jax.Array:
        v = runner.layout(shape).empty(trash)
        for i in range(real_decode):
            v["d_table"][i, :d_pages] = (i * d_pages + np.arange(d_pages)) % trash
        v["d_pos"][:real_decode] = args.context - 1
        base = shape.decode_rows * d_pages
        rng = np.random.default_rng(0)
        for j in range(shape.prefill_rows if real_prefill is None else real_prefill):
            v["p_tokens"][j, :] = rng.integers(0, llm.config.vocab_size, shape.prefill_tokens)
            v["p_start"][j] = 0
            v["p_len"][j] = shape.prefill_tokens
            v["p_table"][j, :p_pages] = (base + j * p_pages + np.arange(p_pages)) % trash
        return jax.device_put(v["_buffer"], runner.device)

    def run(shape, packed, n):
        for _ in range(n):
            runner._dispatch_into(runner._take_slot(), shape, packed)
        jax.block_until_ready(runner.kv)

    def mixed_ctx(pc):
        return max(pc, d_ctx) if static_decode else pc

    # name -> (shape, real decode rows); tier 1 first (timed and saved before tier 2 compiles)
    tier1 = {
        f"decode{C}": (StepShape(C, 0, 0, d_ctx), C),
        f"decode{2 * C}": (StepShape(2 * C, 0, 0, d_ctx), 2 * C),
        f"decode{2 * C}_pad{C}": (StepShape(2 * C, 0, 0, d_ctx), C),
        f"prefill1x{T}_ctx{p_ctx}": (StepShape(0, 1, T, p_ctx), 0),
        f"mixed{2 * C}_pad{C}+1x{T}_ctx{p_ctx}": (StepShape(2 * C, 1, T, mixed_ctx(p_ctx)), C),
        f"mixed{C}+1x{T}_ctx{p_ctx}": (StepShape(C, 1, T, mixed_ctx(p_ctx)), C),
    }
    e = mixed_ctx(p_pages)
    if p_ctx and p_ctx != p_pages:  # the prefill rows' attention over the exact pages (no bucket waste)
        tier1[f"prefill1x{T}_ctx{p_pages}"] = (StepShape(0, 1, T, p_pages), 0)
        if e != mixed_ctx(p_ctx):
            tier1[f"mixed{2 * C}_pad{C}+1x{T}_ctx{e}"] = (StepShape(2 * C, 1, T, e), C)
            tier1[f"mixed{C}+1x{T}_ctx{e}"] = (StepShape(C, 1, T, e), C)
    tier2 = {
        f"prefill4x{T}_ctx{p_ctx}": (StepShape(0, 4, T, p_ctx), 0),
        f"mixed{2 * C}_pad{C}+4x{T}_ctx{p_ctx}": (StepShape(2 * C, 4, T, mixed_ctx(p_ctx)), C),
        f"mixed{C}+4x{T}_ctx{p_ctx}": (StepShape(C, 4, T, mixed_ctx(p_ctx)), C),
    } if args.four else {}
    if args.four and T > C:  # a chunk cut so that the step holds T tokens in all (C decode + T - C prefill)
        c2 = T - C
        tier2[f"mixed{C}+1x{c2}_ctx{e}"] = (StepShape(C, 1, c2, e), C)

    # ---- the dense part alone: the model with an attention stub (q passed through, no KV), LM head on sampled rows
    model = runner.model

    def stub(q, k, v, kv, layer):
        return q, kv

    def dense(n_tokens, n_rows, params, tokens, positions):
        h, _ = model.forward(params, tokens, positions, None, stub)
        rows = h if n_rows == n_tokens else h[jnp.arange(n_rows) * max(1, n_tokens // n_rows)]
        return jnp.argmax(model.logits(params, rows), axis=-1)

    dense_jit = jax.jit(dense, static_argnums=(0, 1))
    # (tokens, sampled rows): decode C, 2C; the chunk alone; mixed C + chunk, 2C + chunk
    combos = [] if args.no_dense else [(C, C), (2 * C, 2 * C), (T, 1), (C + T, C + 1), (2 * C + T, 2 * C + 1)]
    if args.four and not args.no_dense and T > C:
        combos.append((T, C + 1))
    dense_args = {}
    for n, rws in combos:
        tok = jax.device_put(jnp.arange(n, dtype=jnp.int32) % llm.config.vocab_size, runner.device)
        pos = jax.device_put(jnp.arange(n, dtype=jnp.int32) % 512, runner.device)
        dense_args[f"{n}tok_{rws}rows"] = (n, rws, tok, pos)
    dense_exe = {}

    def compile_one(item):
        kind, name = item
        t = time.perf_counter()
        if kind == "step":
            runner.compile_step(cases[name][0])
        else:
            n, rws, tok, pos = dense_args[name]
            dense_exe[name] = dense_jit.lower(n, rws, runner.params, tok, pos).compile()
        out["compile_s"][f"{kind}:{name}"] = round(time.perf_counter() - t, 2)
        print(f"compiled {kind} {name} in {out['compile_s'][f'{kind}:{name}']}s", flush=True)

    def time_tier(tier: dict, dense_names: list[str]) -> None:
        t = time.perf_counter()
        unique = {shape: name for name, (shape, _) in reversed(tier.items())}  # a shape timed twice compiles once
        items = [("step", k) for k in unique.values()] + [("dense", k) for k in dense_names]
        with concurrent.futures.ThreadPoolExecutor(args.compile_threads) as pool:
            list(pool.map(compile_one, items))
        print(f"compiled {len(items)} programs in {time.perf_counter() - t:.1f}s", flush=True)
        before = num_compiles()
        inputs = {name: packed_for(*tier[name]) for name in tier}
        for name, (shape, _) in tier.items():
            run(shape, inputs[name], 3)  # warm (the jit cache already holds the executable)
        for name in dense_names:
            jax.block_until_ready(dense_exe[name](runner.params, *dense_args[name][2:]))
        out.setdefault("compiles_after_aot", []).append(num_compiles() - before)  # 0: the timed runs reuse them
        for _ in range(args.rounds):
            for name, (shape, _) in tier.items():
                run(shape, inputs[name], 2)
                t = time.perf_counter()
                run(shape, inputs[name], args.steps)
                out["ms_rounds"].setdefault(name, []).append(1e3 * (time.perf_counter() - t) / args.steps)
            for name in dense_names:
                exe, a = dense_exe[name], (runner.params, *dense_args[name][2:])
                jax.block_until_ready([exe(*a) for _ in range(2)])
                t = time.perf_counter()
                jax.block_until_ready([exe(*a) for _ in range(args.steps)])
                out["dense_ms_rounds"].setdefault(name, []).append(1e3 * (time.perf_counter() - t) / args.steps)
        for name in tier:
            ms = out["ms_rounds"][name]
            out["ms"][name] = float(np.median(ms))
            print(f"{name:40s} {out['ms'][name]:.3f} ms  (rounds {', '.join(f'{m:.3f}' for m in ms)})", flush=True)
        for name in dense_names:
            ms = out["dense_ms_rounds"][name]
            out["dense_ms"][name] = float(np.median(ms))
            print(f"dense {name:34s} {out['dense_ms'][name]:.3f} ms  (rounds {', '.join(f'{m:.3f}' for m in ms)})",
                  flush=True)
        dump()

    def derive() -> None:
        """Differences of the shapes timed so far (ms; a difference whose shapes were not timed is left out)."""
        m = {**out["ms"], **{f"dense:{k}": v for k, v in out["dense_ms"].items()}}
        d, d2, mp = f"decode{C}", f"decode{2 * C}", f"mixed{2 * C}_pad{C}+1x{T}_ctx{p_ctx}"
        mu, mue, pre = f"mixed{C}+1x{T}_ctx{p_ctx}", f"mixed{C}+1x{T}_ctx{e}", f"prefill1x{T}_ctx{p_ctx}"
        dd = f"dense:{C}tok_{C}rows"
        pairs = {
            "mixed_padded_minus_decodeC": (mp, d),
            "mixed_unpadded_minus_decodeC": (mu, d),
            "prefill_only": (pre, None),
            "padding_decode2C_real_minus_decodeC": (d2, d),
            "padding_decode2C_padrows_minus_decodeC": (f"decode{2 * C}_pad{C}", d),
            "padding_in_mixed": (mp, mu),
            "prefill_ctx_bucket_waste_prefill_only": (pre, f"prefill1x{T}_ctx{p_pages}"),
            "prefill_ctx_bucket_waste_mixed_unpadded": (mu, mue),
            "mixed_unpadded_exactctx_minus_decodeC": (mue, d),
            "mixed4_padded_minus_decodeC": (f"mixed{2 * C}_pad{C}+4x{T}_ctx{p_ctx}", d),
            "mixed4_unpadded_minus_decodeC": (f"mixed{C}+4x{T}_ctx{p_ctx}", d),
            "prefill4_only": (f"prefill4x{T}_ctx{p_ctx}", None),
            f"mixed_{T}tokens_total_exactctx_minus_decodeC": (f"mixed{C}+1x{T - C}_ctx{e}", d),
            f"dense_{T}tok_{C + 1}rows_minus_dense_decodeC": (f"dense:{T}tok_{C + 1}rows", dd),
            "dense_decodeC": (dd, None),
            "dense_decode2C_minus_dense_decodeC": (f"dense:{2 * C}tok_{2 * C}rows", dd),
            "dense_mixed_unpadded_minus_dense_decodeC": (f"dense:{C + T}tok_{C + 1}rows", dd),
            "dense_mixed_padded_minus_dense_decodeC": (f"dense:{2 * C + T}tok_{2 * C + 1}rows", dd),
            "dense_chunk_only": (f"dense:{T}tok_1rows", None),
            "nondense_decodeC": (d, dd),
            "nondense_mixed_unpadded": (mu, f"dense:{C + T}tok_{C + 1}rows"),
            "nondense_mixed_padded": (mp, f"dense:{2 * C + T}tok_{2 * C + 1}rows"),
            "nondense_prefill_only": (pre, f"dense:{T}tok_1rows"),
        }
        der = {k: m[a] - (m[b] if b else 0.0) for k, (a, b) in pairs.items() if a in m and (b is None or b in m) and a != b}
        out["derived_ms"] = der
        for k, v in der.items():
            print(f"{k:50s} {v:+.3f} ms", flush=True)

    cases = {**tier1, **tier2}
    out["shapes"] = {k: [*dataclasses.astuple(s), real] for k, (s, real) in cases.items()}
    out["dense_ms"], out["dense_ms_rounds"] = {}, {}
    first_dense = [k for k in dense_args if k != f"{T}tok_{C + 1}rows"]
    time_tier(tier1, first_dense)
    derive()
    if tier2:
        time_tier(tier2, [k for k in dense_args if k not in first_dense])
        derive()
    out["total_s"] = time.perf_counter() - t0
    dump()


if __name__ == "__main__":
    main()
