"""The public API: LLM() defaults, EngineConfig, and the step-by-step methods AsyncLLM, the server and the benchmarks use."""

from __future__ import annotations

import dataclasses

import pytest

from jphoton import LLM, Buckets, EngineConfig, Kernels, RequestOutput, SamplingParams
from jphoton.engine.warmup import Warmup

from conftest import FIXTURES, make_llm


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_llm_with_no_arguments_runs_pipelined(monkeypatch):
    """`LLM()` as a notebook user writes it: the embedded model, the default config, depth 2, warm-up in the
    background. The background thread is stopped before it compiles anything (the rest of the default shapes would
    take minutes on 2 CPU cores): the request runs through the first two shapes alone and compiles nothing."""
    monkeypatch.setattr(Warmup, "_run", lambda self, queue: None)
    llm = LLM()
    stats = llm.stats()
    assert llm.engine_config.warmup == "background"
    assert (stats["shapes_compiled"], stats["all_shapes_ready"]) == (2, False) and stats["shapes_total"] > 2
    compiles = stats["num_compiles"]
    assert llm.engine_config.pipeline_depth == 2
    assert llm.engine_config.max_num_seqs == 64
    assert llm.engine_config.max_model_len == min(llm.config.max_position_embeddings, 8192)
    llm.telemetry.clear()
    [out] = llm.generate("The capital of France is", _greedy(8))
    assert len(out.token_ids) == 8
    recs = sorted(llm.telemetry.records, key=lambda r: r.step_id)
    # pipelined: every step after the first is launched before the step before it is committed
    assert len(recs) >= 8 and all(b.t_launch < a.t_commit for a, b in zip(recs, recs[1:], strict=False))
    assert llm.stats()["num_compiles"] == compiles


def test_step_by_step_matches_generate(embedded_llm):
    llm = embedded_llm
    prompts = ["Hello there", "One two three", "The sky is"]
    params = [_greedy(5), _greedy(9), SamplingParams(max_tokens=6, temperature=0.7, seed=3, logprobs=2, ignore_eos=True)]
    want = llm.generate(prompts, params)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    got: dict[int, list[RequestOutput]] = {i: [] for i in ids}
    while llm.has_unfinished_requests():
        for out in llm.step():
            got[out.request_id].append(out)
    for rid, w in zip(ids, want, strict=True):
        outs = got[rid]
        assert [t for o in outs for t in o.delta.token_ids] == w.token_ids
        assert "".join(o.delta.text for o in outs) == w.text
        assert outs[-1].finished and outs[-1].delta.finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        assert outs[-1].prompt_tokens == len(llm.tokenizer.encode(prompts[ids.index(rid)]))
        assert outs[-1].completion_tokens == len(w.token_ids)
    assert all(o.logprobs for o in got[ids[2]] if o.delta.token_ids)


def test_abort_through_the_public_api(embedded_llm):
    llm = embedded_llm
    rid = llm.add_request("Tell me about the sea.", _greedy(50))
    for _ in range(3):
        llm.step()
    last = llm.abort(rid)
    assert last is not None and last.finished and last.delta.finish_reason == "abort"
    assert llm.abort(rid) is None  # already finished
    while llm.has_unfinished_requests():
        assert all(o.request_id != rid for o in llm.step())  # nothing more for the aborted request
    stats = llm.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_evictable"] == stats["kv_pages_total"]


def test_prepared_requests_are_validated_before_queueing(embedded_llm):
    with pytest.raises(ValueError, match="temperature"):
        embedded_llm.prepare_request("hi", SamplingParams(temperature=-1))
    seq = embedded_llm.prepare_request("hi", _greedy(2))
    assert not embedded_llm.has_unfinished_requests()  # prepared, not queued
    rid = embedded_llm.add_request(seq)
    while embedded_llm.has_unfinished_requests():
        embedded_llm.step()
    assert rid == seq.request_id and seq.finish_reason == "length"


def test_engine_config_maps_llm_keywords_onto_groups():
    cfg = EngineConfig.from_kwargs(max_num_seqs=8, decode_buckets=(1, 8), attention="static", matmul="xla")
    assert cfg.max_num_seqs == 8 and cfg.buckets == Buckets(decode=(1, 8)) and cfg.kernels.attention == "static"
    assert cfg.kernels.matmul == "xla" and cfg.pipeline_depth == 2
    base = EngineConfig(kernels=Kernels(moe_backend="expert_centric"))
    assert EngineConfig.from_kwargs(base, page_size=32).kernels.moe_backend == "expert_centric"
    with pytest.raises(TypeError, match="did you mean 'max_num_seqs'"):
        EngineConfig.from_kwargs(max_num_seq=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_num_seqs = 4
    assert {"pipeline_depth", "decode_buckets", "attention", "moe_backend"} <= set(EngineConfig.option_names())


@pytest.mark.parametrize("kwargs, message", [
    ({"pipeline_depth": 4}, "pipeline_depth"), ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"page_size": 1.5}, "page_size"), ({"attention": "flash"}, "attention"),
    ({"kv_memory_fraction": 0}, "kv_memory_fraction"), ({"max_logprobs": -1}, "max_logprobs"),
])
def test_bad_engine_options_are_clear_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_auto_resolves_per_device():
    gpu, cpu = EngineConfig().resolve_kernels("gpu"), EngineConfig().resolve_kernels("cpu")
    assert (gpu.kernels.attention, gpu.kernels.unroll_layers) == ("pallas", True)
    assert (cpu.kernels.attention, cpu.kernels.unroll_layers) == ("dynamic", False)
    shapes = gpu.resolve_shapes(model_limit=131072, min_decode_rows=2)
    assert shapes.max_model_len == 8192  # the default cap, below the model's limit
    assert shapes.buckets.decode == (2, 4, 8, 16, 32, 64)  # one-row steps rounded up to the matmuls' two
    assert shapes.buckets.context == ()  # the Pallas kernels follow each row's length: no context bucket
    assert cpu.resolve_shapes(model_limit=2048).buckets.context == ()  # nor does the dynamic loop
    static = EngineConfig(kernels=Kernels(attention="static")).resolve_kernels("gpu").resolve_shapes(131072)
    assert static.buckets.context[-1] * static.page_size >= 8192
    with pytest.raises(ValueError, match="context_buckets apply to attention='static'"):
        EngineConfig.from_kwargs(context_buckets=(4, 16)).resolve_kernels("gpu").resolve_shapes(131072)
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=4096).resolve_kernels("cpu").resolve_shapes(model_limit=2048)


def test_device_step_time_is_measured_on_an_idle_engine():
    llm = make_llm(str(FIXTURES / "tiny" / "llama3"), warmup=False)
    assert llm.device_step_ms(3, context=40, steps=2) > 0
    assert llm.device_step_ms(1, steps=2, sampler="masked") > 0
    with pytest.raises(ValueError, match="rows exceed"):
        llm.device_step_ms(9)
    rid = llm.add_request({"prompt_token_ids": [1, 2, 3]}, _greedy(4))
    with pytest.raises(RuntimeError, match="idle"):
        llm.device_step_ms(1)
    llm.abort(rid)
    while llm.has_unfinished_requests():
        llm.step()


def test_one_llm_shared_by_threads_batches_their_requests(embedded_llm):
    """Issue 24 item 2: two threads calling generate on one LLM failed ("slot reused before the commit that reads it",
    a donated-buffer error) and left it broken. Now they tick the engine in turn, their requests in the same batches,
    and each gets its own tokens (greedy: equal to the requests run alone)."""
    import threading

    llm = embedded_llm
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    greedy = SamplingParams(max_tokens=10, temperature=0)
    refs = [c.token_ids for c in llm.generate(prompts, greedy)]
    got, errors = {}, []
    steps_before = llm.stats()["steps"]

    def worker(i):
        try:
            for k in range(2):
                j = (i + k) % 4
                if k % 2:
                    with llm.stream(prompts[j], greedy) as stream:
                        got[i, k] = [t for d in stream for t in d.token_ids]
                else:
                    got[i, k] = llm.generate(prompts[j], greedy)[0].token_ids
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert all(got[i, k] == refs[(i + k) % 4] for i in range(4) for k in range(2))
    # 8 requests of 10 tokens one after the other would take >= 80 steps; batched together far fewer.
    assert llm.stats()["steps"] - steps_before < 60
    s = llm.stats()
    assert s["kv_pages_free"] + s["kv_pages_evictable"] == s["kv_pages_total"] and not llm.has_unfinished_requests()
