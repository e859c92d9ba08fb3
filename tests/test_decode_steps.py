"""K decode steps in one launch (`decode_steps=K`, scheduler.py `_decode_steps`, step.py `_decode_steps`): the same
tokens as one step a launch, at every pipeline depth, for greedy, seeded, stop-string, eos-ended and length-ended
requests (lengths that are not multiples of K); fewer launches; a request that arrives mid-run is not held back by
K-step launches; a pool too small for K positions a row falls back to single steps. The embedded model on the CPU."""

from __future__ import annotations

import pytest

from jphoton import SamplingParams

from conftest import make_llm

K = 4
PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "1, 2, 3, 4,", "Hello"]


def _params():
    """Greedy (lengths 3..23, none a multiple of K but one), seeded samples, stop strings, eos allowed."""
    return ([SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (23, 16, 7, 13, 3)]
            + [SamplingParams(max_tokens=21, temperature=0.8, seed=i) for i in range(5)]
            + [SamplingParams(max_tokens=30, temperature=0, stop=[" the", "\n\n"]) for _ in range(5)])


def _run(llm):
    outs = llm.generate(PROMPTS * 3, _params())
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


@pytest.fixture(scope="module")
def reference():
    llm = make_llm(warmup="off")
    out = _run(llm)
    return out, llm.stats()["steps"]


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_k_steps_a_launch_give_the_single_step_tokens(reference, depth):
    want, single_launches = reference
    llm = make_llm(warmup="off", decode_steps=K, pipeline_depth=depth)
    llm.telemetry.clear()
    assert _run(llm) == want
    steps = [r.steps for r in llm.telemetry.records]
    assert K in steps and set(steps) == {1, K}
    assert llm.stats()["steps"] <= single_launches - 10  # (15 requests, 8 rows: the queue keeps most launches single)


def test_a_request_arriving_mid_run_is_not_held_back(reference):
    """While a request waits, launches run one step each: it is prefilled after at most the launches planned before
    it arrived, and every request still gets the single-step tokens."""
    want, _ = reference
    llm = make_llm(warmup="off", decode_steps=K)
    params = _params()
    early = [llm.add_request(p, sp) for p, sp in zip(PROMPTS[:2], params[:2], strict=True)]
    outs = {r: [] for r in early}
    for _ in range(6):
        for o in llm.step():
            outs[o.request_id] += o.delta.token_ids
    assert any(r.steps == K for r in llm.telemetry.records), "no K-step launch before the arrival"
    n_before = len(llm.telemetry.records)
    late = llm.add_request(PROMPTS[2], params[2])
    outs[late] = []
    ticks = 0
    while not outs[late]:
        ticks += 1
        for o in llm.step():
            outs[o.request_id] += o.delta.token_ids
    after = list(llm.telemetry.records)[n_before:]
    assert ticks <= 4 and sum(r.steps == K for r in after) <= 2, [(r.kind, r.steps) for r in after]
    while llm.has_unfinished_requests():
        for o in llm.step():
            outs[o.request_id] += o.delta.token_ids
    assert [outs[r] for r in (*early, late)] == [w[0] for w in want[:3]]


def test_a_pool_without_room_for_k_positions_falls_back_to_single_steps(reference):
    want, _ = reference
    llm = make_llm(warmup="off", decode_steps=K, num_kv_pages=12, page_size=8)
    assert _run(llm) == want
