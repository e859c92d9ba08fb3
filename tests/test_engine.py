"""The serving engine: continuous batching, chunked prefill, preemption, bucketed compiles, streaming, zombies."""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest

from jphoton import SamplingParams
from jphoton.engine.step import StepShape
from jphoton.models.llama import reference_logits
from jphoton.reference import ReferenceDecoder

from conftest import FIXTURES, llm_at_depth, make_llm

MAX_TOKENS = (32, 10, 32, 5, 32, 20)


@pytest.fixture(scope="module")
def hf():
    ref = np.load(FIXTURES / "embedded" / "reference.npz")
    return [(ref[f"prompt_{i}"].tolist(), ref[f"tokens_{i}"].tolist()) for i in range(6)]


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def dense_reference():
    """The dense-cache reference decoder's greedy tokens for (prompts, max_tokens): run once per batch and shared by
    the tests' depths (it does not depend on the engine; every embedded engine holds the same weights)."""
    results, decoders = {}, {}

    def run(llm, prompts, lengths):
        key = (tuple(tuple(p) for p in prompts), tuple(lengths))
        if key not in results:
            if "decoder" not in decoders:
                decoders["decoder"] = ReferenceDecoder(llm.config, llm.model.params)
            seqs = llm.requests.sequences(prompts, [_greedy(n) for n in lengths])
            decoders["decoder"].run(seqs)
            results[key] = [s.output_ids for s in seqs]
        return results[key]

    return run


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_mixed_batch_matches_hf_reference_and_alone(request, hf, dense_reference, depth):
    llm = llm_at_depth(request, depth)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in hf], [_greedy(n) for n in MAX_TOKENS])
    for out, (_, ref), n in zip(outs, hf, MAX_TOKENS, strict=True):
        assert out.token_ids == ref[:n]
        assert out.finish_reason == "length"
    # the dense-cache reference decoder, on the same batch (run once for the three depths)
    assert dense_reference(llm, [p for p, _ in hf], MAX_TOKENS) == [o.token_ids for o in outs]
    # each prompt alone (two of them, to keep the suite fast)
    for i in (1, 4):
        assert llm.generate({"prompt_token_ids": hf[i][0]}, _greedy(MAX_TOKENS[i]))[0].token_ids == outs[i].token_ids


def test_depths_agree_under_random_arrivals_finishes_and_aborts(embedded_d1, embedded_llm, embedded_d3, hf):
    """Arrivals keyed to the step index (deterministic); EOS finishes and one abort; tokens must not depend on depth."""
    lengths = (16, 10, 16, 5, 16, 12)  # half of MAX_TOKENS: the arrivals (steps 0-11) still overlap every finish

    def run(llm):
        rng = np.random.default_rng(7)
        arrivals = sorted(rng.integers(0, 12, size=6).tolist())
        eng = llm.engine
        seqs, pending, step = [], list(range(6)), 0
        while pending or any(not s.finalized for s in seqs):
            while pending and arrivals[len(seqs)] <= step:
                i = pending.pop(0)
                params = SamplingParams(max_tokens=lengths[i], temperature=0, ignore_eos=i % 2 == 0)
                [s] = llm.requests.sequences([hf[i][0]], params)
                llm._submit(s)
                seqs.append(s)
            if len(seqs) > 2 and len(seqs[2].output_ids) >= 3:  # keyed to tokens: ticks differ between depths
                llm.engine.abort(seqs[2].request_id)
            llm._tick()
            step += 1
        while eng.has_work():
            llm._tick()
        for s in seqs:
            llm._outputs.pop(s.request_id, None)
        return [(s.output_ids, s.finish_reason) for s in seqs]

    a, b = run(embedded_d1), run(embedded_llm)
    assert a == b == run(embedded_d3)
    assert {"length", "abort"} <= {r for _, r in a}
    # While shapes still compile, a prefill that no ready shape mixes with decode rows runs alone, and those rows sit
    # out that step: then step t+2, planned before t's commit, cannot carry their token from t (it waits a step).
    for llm in (embedded_llm,):
        sched = llm.engine.scheduler
        ready = sched.ready
        sched.ready = frozenset(x for x in sched.config.all_shapes() if not (x.decode_rows and x.prefill_rows))
        try:
            steps = llm.engine.num_steps
            assert run(llm) == a
            assert llm.engine.num_steps - steps > 12
        finally:
            sched.ready = ready


def test_preemption_with_a_tiny_pool_matches_an_unpreempted_run():
    model = str(FIXTURES / "tiny" / "llama3")
    prompts = [{"prompt_token_ids": list(range(3 + i, 23 + i))} for i in range(5)]
    params = _greedy(40)
    one = dict(decode_buckets=(8,))  # one decode bucket: 3 step programs per pool size, not 4 (CI time)
    big = make_llm(model, warmup=False, **one).generate(prompts, params)
    for depth in (1, 2, 3):
        small = make_llm(model, warmup=False, num_kv_pages=8, page_size=8, pipeline_depth=depth, **one)
        outs = small.generate(prompts, params)
        assert small.stats()["preemptions"] > 0
        assert [o.token_ids for o in outs] == [o.token_ids for o in big]
        assert all(o.finish_reason == "length" for o in outs)


def test_request_larger_than_the_whole_pool_is_refused_at_submission():
    llm = make_llm(str(FIXTURES / "tiny" / "llama2"), warmup=False, num_kv_pages=4, page_size=8)
    with pytest.raises(ValueError, match="whole pool"):
        llm.generate({"prompt_token_ids": [5] * 20}, _greedy(20))
    assert llm.generate({"prompt_token_ids": [5] * 10}, _greedy(4))[0].finish_reason == "length"


def test_no_compile_after_warmup_under_any_request_mix(embedded_llm, hf):
    llm = embedded_llm
    before = llm.stats()["num_compiles"]
    llm.generate([{"prompt_token_ids": hf[0][0] * 3}], _greedy(3))  # a long prompt: several chunks
    llm.generate([{"prompt_token_ids": p[:7]} for p, _ in hf[:3]],
                 [SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=1),
                  SamplingParams(max_tokens=6, temperature=0.5, top_k=5, logprobs=3),
                  SamplingParams(max_tokens=2, stop=["the"])])
    assert list(llm.stream("Tell me a story.", SamplingParams(max_tokens=5)))
    assert llm.stats()["num_compiles"] == before
    # The counter is real: a shape outside the buckets, forced on purpose, compiles.
    llm.engine.runner.warmup([StepShape(3, 0, 0)])
    assert llm.stats()["num_compiles"] > before


@pytest.mark.parametrize("depth", [1, 2])
def test_steady_state_loop_makes_no_implicit_host_to_device_transfer(request, hf, depth):
    llm = llm_at_depth(request, depth)
    with jax.transfer_guard_host_to_device("disallow"):
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in hf[:3]], _greedy(6))
    assert [o.token_ids for o in outs] == [ref[:6] for _, ref in hf[:3]]


def test_stream_matches_generate_and_closing_it_aborts(embedded_llm):
    llm = embedded_llm
    full = llm.generate("Write a haiku about the sea.", _greedy(20))[0]
    deltas = list(llm.stream("Write a haiku about the sea.", _greedy(20)))
    assert sum((d.token_ids for d in deltas), []) == full.token_ids
    assert "".join(d.text for d in deltas) == full.text
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    it = llm.stream("Write a haiku about the sea.", _greedy(20))
    next(it)
    next(it)
    it.close()  # aborts; the autouse check then finds every page back


def test_a_stream_left_early_in_a_with_block_aborts_its_request(embedded_llm):
    """Issue 24: breaking out of a held stream kept its request running and its pages held."""
    llm = embedded_llm
    with llm.stream("Write a haiku about the sea.", _greedy(20)) as stream:
        for i, _ in enumerate(stream):
            if i == 1:
                break
        stats = llm.stats()
        assert stats["kv_pages_free"] + stats["kv_pages_evictable"] < stats["kv_pages_total"]  # held in the block
    stats = llm.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_evictable"] == stats["kv_pages_total"]
    assert not llm.has_unfinished_requests()


def test_logprobs_are_the_models_log_softmax(embedded_llm, hf):
    llm = embedded_llm
    prompt = hf[3][0]
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, temperature=0, logprobs=3))
    logits = reference_logits(llm.model.params, llm.config, [np.array(prompt + out.token_ids[:-1])])[0]
    lsm = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1,
                                                                                                           keepdims=True)
    assert len(out.logprobs) == 4
    for i, (tok, lp, top) in enumerate(out.logprobs):
        pos = len(prompt) - 1 + i
        assert tok == out.token_ids[i] and len(top) == 3
        assert abs(lp - lsm[pos, tok]) < 1e-4
        assert max(top, key=top.get) == tok  # greedy: the chosen token is the most likely
        for t, v in top.items():
            assert abs(v - lsm[pos, t]) < 1e-4


def test_zombie_rides_along_and_appends_nothing(embedded_llm, hf):
    """At depth 2 a sequence stopping at step t is already in t+1's batch: finalized at t's commit, it must append
    nothing at t+1's commit and give its pages back only afterwards."""
    llm = embedded_llm
    prompt, ref = hf[0]
    stop_at = ref[2]  # the third greedy token
    [seq] = llm.requests.sequences([prompt], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(stop_at,)))
    llm._submit(seq)
    refs_at_launch = []
    launch = llm.engine.runner.launch

    def spy(step, **kwargs):  # refs right after a launch, before the commit of the step before it
        slot = launch(step, **kwargs)
        refs_at_launch.append(seq.inflight_refs)
        return slot

    llm.engine.runner.launch = spy
    zombie_seen = False
    while llm.engine.has_work():
        llm._tick()
        if seq.finalized and seq.inflight_refs > 0:
            zombie_seen = True
            assert seq.block_table and seq.status == "running"  # not released while referenced
    del llm.engine.runner.launch
    llm._outputs.pop(seq.request_id)
    assert max(refs_at_launch) == 2 and zombie_seen
    assert seq.output_ids == ref[:3] and seq.finish_reason == "stop"
    assert seq.status == "released"


def test_async_engine_serves_many_concurrent_requests(embedded_llm, hf):
    from jphoton.async_llm import AsyncLLM
    from jphoton.constrain.compiler import GrammarCompiler

    g = embedded_llm.grammar
    fresh = GrammarCompiler(g._tokenizer, g.vocab_size, tuple(g._eos))  # llguidance not set up yet
    embedded_llm.grammar, saved = fresh, g
    try:
        AsyncLLM(embedded_llm).shutdown()
    finally:
        embedded_llm.grammar = saved
    # llguidance's first matcher was built at start (it holds the GIL ~250 ms), not in the first constrained request
    assert fresh._lltok is not None
    engine = AsyncLLM(embedded_llm)

    async def one(i):
        toks = []
        async for out in engine.generate({"prompt_token_ids": hf[i % 6][0]}, _greedy(8)):
            toks += out.delta.token_ids
        return toks

    async def cancelled():
        async for _ in engine.generate("Hello there", _greedy(50)):
            break  # leaving early aborts

    async def main():
        results = await asyncio.gather(*(one(i) for i in range(12)), cancelled())
        with pytest.raises(ValueError, match="temperature"):
            engine.submit("x", SamplingParams(temperature=-1))
        return results

    try:
        results = asyncio.run(main())
        assert [r for r in results[:12]] == [hf[i % 6][1][:8] for i in range(12)]
        for _ in range(200):  # the abort lands on the engine thread a tick later
            if not embedded_llm.engine.has_work():
                break
            import time

            time.sleep(0.01)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_static_context_attention_and_unrolled_layers_match_hf(family):
    """The accelerator configuration (static context buckets, unrolled layers), run here on CPU against HF."""
    from conftest import tiny_reference

    llm = make_llm(str(FIXTURES / "tiny" / family), warmup=False, attention="static", context_buckets=(2, 4, 16),
                   unroll_layers=True)
    ref = tiny_reference(family)
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p, _, _ in ref], _greedy(len(ref[0][1])))
    assert [o.token_ids for o in outs] == [t.tolist() for _, t, _ in ref]


def test_telemetry_shows_launch_of_next_step_before_commit_of_this_one(embedded_d1, embedded_llm, hf):
    for llm, overlapped in ((embedded_llm, True), (embedded_d1, False)):
        llm.telemetry.clear()
        llm.generate([{"prompt_token_ids": p} for p, _ in hf[:2]], _greedy(8))
        recs = sorted(llm.telemetry.records, key=lambda r: r.step_id)
        assert len(recs) >= 8
        ahead = [b.t_launch < a.t_commit for a, b in zip(recs, recs[1:], strict=False)]
        assert all(ahead) if overlapped else not any(ahead)
        timeline = llm.telemetry.timeline()
        assert {"t_plan", "t_launch", "t_commit", "t_ready", "t_committed", "kind"} <= set(timeline[0])


def test_a_researchers_own_model_plugs_in(hf):
    """The README's example: a JaxModel with its own forward (here a Python loop over layers instead of a scan)."""
    import jax.numpy as jnp

    from jphoton.models import llama
    from jphoton.models.layers import apply_rope, rms_norm, rope_inv_freq, swiglu
    from jphoton.models.protocol import JaxModel
    from jphoton.weights import load_model

    base = load_model(FIXTURES / "tiny" / "qwen2", "float32")
    cfg = base.config.replace(architecture="custom")
    inv_freq = jnp.asarray(rope_inv_freq(cfg))

    def forward(params, tokens, positions, kv, attend):
        x = params["embed"][tokens]
        for i in range(cfg.num_layers):
            lp = {k: v[i] for k, v in params["layers"].items()}
            h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
            q = (h @ lp["wq"] + lp["bq"]).reshape(*h.shape[:-1], cfg.num_heads, cfg.head_dim)
            k = (h @ lp["wk"] + lp["bk"]).reshape(*h.shape[:-1], cfg.num_kv_heads, cfg.head_dim)
            v = (h @ lp["wv"] + lp["bv"]).reshape(*h.shape[:-1], cfg.num_kv_heads, cfg.head_dim)
            o, kv = attend(apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v, kv, i)
            x = x + o.reshape(*x.shape[:-1], -1) @ lp["wo"]
            x = x + swiglu(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp["w_gate"], lp["w_up"], lp["w_down"])
        return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), kv

    model = JaxModel(cfg, base.params, forward, llama.lm_head, name="my-model")
    with pytest.raises(ValueError, match="compile_worker=True needs a model jphoton loads"):
        make_llm(model, warmup="background", compile_worker=True)  # (its functions cannot be rebuilt elsewhere)
    llm = make_llm(model, warmup=False)
    from conftest import tiny_reference

    ref = tiny_reference("qwen2")
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p, _, _ in ref], _greedy(len(ref[0][1])))
    assert [o.token_ids for o in outs] == [t.tolist() for _, t, _ in ref]


@pytest.mark.parametrize("depth", [1, 2])
def test_chunked_prefill_of_a_long_prompt_matches_the_reference(request, hf, dense_reference, depth):
    """A 150-token prompt is prefilled in 64-token chunks that attend to the pages of the chunks before them."""
    llm = llm_at_depth(request, depth)
    long_prompt = (hf[0][0] + hf[1][0] + hf[2][0] + hf[0][0] + hf[4][0])[:150]
    prompts = [long_prompt, hf[3][0]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(12))
    assert [o.token_ids for o in outs] == dense_reference(llm, prompts, (12, 12))
    assert len(long_prompt) > 2 * max(t for _, t in llm.engine.scheduler.config.prefill_buckets)


@pytest.mark.parametrize("freeze", [True, False])
def test_llm_freezes_its_start_up_objects_out_of_the_gc(freeze):
    """A full cyclic-GC pass inside the engine loop cost a 550-726 ms tick on the H100 host (RESULTS.md); LLM() collects
    and freezes what exists once it is built, unless asked not to."""
    import gc

    gc.unfreeze()
    llm = make_llm(str(FIXTURES / "tiny" / "llama3"), warmup=False, freeze_gc=freeze)
    assert (gc.get_freeze_count() > 0) == freeze
    frozen, compiled = gc.get_freeze_count(), llm.stats()["num_compiles"]
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].token_ids) == 2
    # no warm-up: the first steps compiled, and a frozen engine froze again after them (the compiles' objects)
    assert llm.stats()["num_compiles"] > compiled
    assert (gc.get_freeze_count() > frozen) == freeze


@pytest.mark.parametrize("num_rows", [3, 40])  # the per-row loop and the masked assignment
def test_block_tables_pack_like_a_row_by_row_copy(num_rows):
    from jphoton.engine.packing import _fill_ragged

    rng = np.random.default_rng(num_rows)
    tables = [rng.integers(0, 1000, rng.integers(0, 12)).tolist() for _ in range(num_rows)]
    got = np.full((num_rows + 2, 12), -7, np.int32)
    want = got.copy()
    for i, t in enumerate(tables):
        want[i, :len(t)] = t
    _fill_ragged(got, tables)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("depth", [2, 3])
def test_steady_decode_packs_equal_full_packs(request, hf, monkeypatch, depth):
    """A decode step with the previous pack's rows starts from that buffer (StepPacker._pack_steady): byte-equal to packing
    from scratch, through page boundaries, finishes and a new arrival, and the tokens still match the reference. The
    steady packs' buffers are reused in turn: never one that a step still in flight was given."""
    embedded_llm = llm_at_depth(request, depth)
    engine = embedded_llm.engine
    runner = engine.runner
    packer = runner.packer
    pack, full = packer.pack, packer._pack_full
    checked = []

    def both(plan, automata=False):  # (no constrained rows here: the automaton fields stay zero in both packs)
        in_flight = [s.step.input.packed for s in engine.inflight if s.step is not None]
        inp = pack(plan, automata)
        assert all(inp.packed is not b for b in in_flight if b is not None)
        np.testing.assert_array_equal(inp.packed, full(plan).packed)
        checked.append(plan.step_id)
        return inp

    monkeypatch.setattr(runner, "pack", both)
    before = packer.steady_packs
    lengths = (32, 32, 32, 9, 32, 20)
    outs = embedded_llm.generate([{"prompt_token_ids": p} for p, _ in hf], [_greedy(n) for n in lengths])
    for out, (_, ref), n in zip(outs, hf, lengths, strict=True):
        assert out.token_ids == ref[:n]
    assert packer.steady_packs - before > 10 and len(checked) > packer.steady_packs - before
