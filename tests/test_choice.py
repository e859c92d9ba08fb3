"""`choice` scored as whole sequences (constrain/choice.py): the scores against HF transformers, the pick (greedy and
sampled), the branches sharing the prompt's KV pages, both pipeline depths, free neighbours, aborts and preemption."""

from __future__ import annotations

import collections
import json
import math

import numpy as np
import pytest

from jphoton import SamplingParams
from jphoton.constrain.choice import FORCED_SET, pick
from jphoton.models import llama

from conftest import FIXTURES, make_llm

CHOICE = json.loads((FIXTURES / "embedded" / "choice.json").read_text())
OPTIONS = [o["text"] for o in CHOICE["options"]]


def fixture_prompt(llm):
    ids = llm.encode_chat(CHOICE["messages"])
    assert ids == CHOICE["prompt_ids"]
    return {"prompt_token_ids": ids}


def test_the_embedded_model_answers_paris_with_hf_scores(embedded_llm):
    """Token-level masking answered "L" + forced "ondon" here; as sequences "Paris" wins, and "Paris, France" (the same
    first token) is told apart by what follows, end included. Scores and per-token logprobs equal HF's."""
    llm = embedded_llm
    for o in CHOICE["options"]:
        assert llm.tokenizer.encode(o["text"], add_special_tokens=False) == o["token_ids"]
    [out] = llm.generate(fixture_prompt(llm), SamplingParams(temperature=0, choice=OPTIONS, logprobs=2))
    assert (out.text, out.choice_index, out.finish_reason) == ("Paris", 0, "stop")
    assert out.token_ids == CHOICE["options"][0]["token_ids"]
    np.testing.assert_allclose(out.choice_scores, [o["score"] for o in CHOICE["options"]], atol=2e-3)
    np.testing.assert_allclose([lp for _, lp, _ in out.logprobs], CHOICE["options"][0]["logprobs"][:-1], atol=1e-3)
    assert [t for t, _, _ in out.logprobs] == out.token_ids and all(len(top) == 2 for _, _, top in out.logprobs)
    assert out.choice_scores[0] > out.choice_scores[4] + 1  # "Paris, France": the same first token, told apart


def test_choice_is_identical_at_both_depths_and_beside_free_rows(embedded_llm, embedded_d1):
    free = {"prompt_token_ids": embedded_llm.encode_chat([{"role": "user", "content": "Name a colour."}])}
    params = [SamplingParams(temperature=0, choice=OPTIONS), SamplingParams(max_tokens=8, temperature=0),
              SamplingParams(temperature=1.5, seed=11, choice=OPTIONS)]
    [alone] = embedded_llm.generate(free, params[1])
    runs = [llm.generate([fixture_prompt(llm), free, fixture_prompt(llm)], params)
            for llm in (embedded_d1, embedded_llm)]
    for a, b in zip(*runs, strict=True):
        assert (a.text, a.token_ids, a.choice_index) == (b.text, b.token_ids, b.choice_index)
    for outs in runs:
        assert outs[1].token_ids == alone.token_ids
        np.testing.assert_allclose(outs[0].choice_scores, outs[2].choice_scores, atol=1e-4)
        assert outs[2].choice_index == pick(outs[2].choice_scores, 1.5, 11)


def test_branches_share_the_prompts_full_pages(embedded_llm):
    """A prompt of many pages is prefilled once (plus less than a page per other option), and the shared pages give
    the scores a from-scratch dense forward gives."""
    llm = embedded_llm
    text = "Here is a long story about a cat who lives in a lighthouse by the sea. " * 8 + "The cat's name is"
    prompt = llm.tokenizer.encode(text)
    options = [" Tom", " Whiskers", " Captain Fluff", " Luna"]
    page = llm.engine_config.page_size
    assert len(prompt) > 6 * page
    llm.telemetry.clear()
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, choice=options))
    encoded = [llm.tokenizer.encode(o, add_special_tokens=False) for o in options]
    processed = sum(r.tokens for r in llm.telemetry.records)
    assert processed <= len(prompt) + len(options) * page + sum(len(e) + 1 for e in encoded)
    eos = llm.eos_token_ids
    seqs = [np.array(prompt + ids + [eos[0]], np.int32) for ids in encoded]
    expect = []  # one padded batch: one compile
    for seq, logits in zip(seqs, llama.reference_logits(llm.model.params, llm.config, seqs), strict=True):
        logits = np.asarray(logits, np.float64)
        lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        expect.append(sum(lp[i - 1, seq[i]] for i in range(len(prompt), len(seq))))
    np.testing.assert_allclose(out.choice_scores, expect, atol=2e-3)
    assert out.choice_index == int(np.argmax(expect))


def test_pick_is_greedy_or_drawn_from_the_scores():
    assert pick([-1.0, -0.5, -0.5], 0.0, 1) == 1  # the first of equals
    scores = [-1.0, -2.0, -0.2]
    assert len({pick(scores, 1.0, 42) for _ in range(5)}) == 1  # same seed, same pick
    n = 4000
    counts = collections.Counter(pick(scores, 0.7, seed) for seed in range(n))
    weights = [math.exp(s / 0.7) for s in scores]
    for i, w in enumerate(weights):
        p = w / sum(weights)
        assert abs(counts[i] / n - p) < 4 * math.sqrt(p * (1 - p) / n), (i, counts, p)


def test_a_choice_longer_than_allowed_is_refused_at_submission(embedded_llm):
    with pytest.raises(ValueError, match=r"choice option 1 .* is 3 tokens; max_tokens is 2"):
        embedded_llm.generate("Capital?", SamplingParams(max_tokens=2, choice=["Paris", "Paris, France"]))
    prompt = {"prompt_token_ids": [1] * (embedded_llm.max_model_len - 2)}
    with pytest.raises(ValueError, match="with its end it needs 4 positions"):
        embedded_llm.generate(prompt, SamplingParams(max_tokens=None, choice=["Paris, France"]))
    [ok] = embedded_llm.generate("Capital?", SamplingParams(max_tokens=1, temperature=0, choice=["Paris", "Rome"]))
    assert ok.text in ("Paris", "Rome") and len(ok.token_ids) == 1


def test_aborting_a_choice_midway_returns_every_page(embedded_llm):
    llm = embedded_llm
    rid = llm.add_request(fixture_prompt(llm), SamplingParams(temperature=0, choice=OPTIONS))
    for _ in range(3):
        llm.step()
    out = llm.abort(rid)
    assert out is not None and out.delta.finish_reason == "abort"
    assert llm.abort(-1) is None  # a branch is not a request
    while llm.has_unfinished_requests():
        llm.step()
    assert rid not in llm.engine.sequences


def test_choice_under_preemption_matches_a_roomy_pool():
    """The tiny Llama-3 fixture (own tokenizer) with a pool too small for the batch: branches and free rows are
    preempted and recomputed, shared pages included; the outputs equal those of a pool with room."""
    from conftest import FIXTURES as F

    path = F / "tiny" / "llama3"
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (30, 20, 30, 21)]
    options = ["def", "return None", "self", "inputs"]
    params = [SamplingParams(temperature=0, choice=options), SamplingParams(max_tokens=40, temperature=0),
              SamplingParams(temperature=0, choice=options[::-1]), SamplingParams(max_tokens=40, temperature=0)]
    results = []
    # the roomy pool: the default one (a full context per row), whose step programs the other tiny engines of this
    # configuration (the max_choice_rows test below, test_prefix_cache's) share through the compilation cache
    for pages in (None, 10):
        llm = make_llm(path, warmup=False, num_kv_pages=pages, page_size=8, max_model_len=128)
        results.append((llm.generate(prompts, params), llm.stats()["preemptions"]))
    (roomy, _), (tight, preemptions) = results
    assert preemptions > 0
    for a, b in zip(roomy, tight, strict=True):
        assert (a.text, a.token_ids, a.choice_index) == (b.text, b.token_ids, b.choice_index)
        if a.choice_scores is not None:
            np.testing.assert_allclose(a.choice_scores, b.choice_scores, atol=1e-4)
    assert roomy[0].choice_scores == pytest.approx(roomy[2].choice_scores[::-1], abs=1e-4)


def reference_scores(llm, prompt, options, stops):
    """Each option's total logprob from a dense forward: its tokens, then the likeliest of `stops`."""
    encoded = [llm.tokenizer.encode(o, add_special_tokens=False) for o in options]
    seqs = [np.array(prompt + ids, np.int32) for ids in encoded]
    out = []
    for seq, logits in zip(seqs, llama.reference_logits(llm.model.params, llm.config, seqs), strict=True):
        logits = np.asarray(logits, np.float64)
        lp = logits - logits.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        out.append(sum(lp[i - 1, seq[i]] for i in range(len(prompt), len(seq))) + max(lp[-1, s] for s in stops))
    return out


@pytest.mark.parametrize("extra", [2, 5])
def test_branches_are_forced_on_the_device_or_end_under_a_host_mask(embedded_llm, extra):
    """Up to FORCED_SET stop tokens the device takes each branch's token (no grammar step: the choice rides the
    pipeline like free rows); with more, the end is drawn under a host mask. Both score like a dense forward."""
    llm = embedded_llm
    prompt = llm.encode_chat([{"role": "user", "content": "Is the sky blue? Answer yes or no."}])
    options = [" yes", " no", "Yes, it is"]
    stops = sorted({*llm.eos_token_ids, *llm.tokenizer.encode(". ! ? , and", add_special_tokens=False)[:extra]})
    assert (len(stops) <= FORCED_SET) == (extra == 2)
    before = llm.engine.num_constrained_steps
    [out] = llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(temperature=0, choice=options, stop_token_ids=stops))
    assert (llm.engine.num_constrained_steps > before) == (len(stops) > FORCED_SET)
    np.testing.assert_allclose(out.choice_scores, reference_scores(llm, prompt, options, stops), atol=2e-3)


def test_a_choice_takes_at_most_max_choice_rows_rows_a_step():
    """The tiny Llama-3 fixture: 6 options at max_choice_rows=2 score as at the default, in steps of at most 2 rows
    (the prefill step: the leader's)."""
    path = FIXTURES / "tiny" / "llama3"
    prompt = {"prompt_token_ids": list(range(5, 40))}
    options = ["def", "return None", "self", "inputs", "x = 1", "pass"]
    outs = []
    for rows in (7, 2):
        llm = make_llm(path, warmup=False, max_choice_rows=rows, page_size=8, max_model_len=128)
        llm.telemetry.clear()
        [out] = llm.generate(prompt, SamplingParams(temperature=0, choice=options))
        outs.append(out)
        widest = max(r.rows for r in llm.telemetry.records)
        assert widest == rows if rows < len(options) else widest <= rows
    np.testing.assert_allclose(outs[0].choice_scores, outs[1].choice_scores, atol=1e-4)
    assert outs[0].choice_index == outs[1].choice_index
