"""Device automata (jphoton/constrain/automaton.py): the token DFA agrees with llguidance mask for mask; the engine samples
automaton rows inside the step with the same tokens as the host-mask path, at both depths, alone and beside host-mask,
top-k and logprobs rows; the table pool places, keeps and evicts automata; a full table falls back to the host."""

from __future__ import annotations

import re

import numpy as np
import pytest
from automaton_walk import compare_walks, host_masks

from jphoton import SamplingParams
from jphoton.constrain.automaton import AutomatonPool, AutomatonVocab, TokenAutomaton, token_bytes

COORDS = r"\[[0-9]{1,3},[0-9]{1,3}(;[0-9]{1,3},[0-9]{1,3}){0,15}\]"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
REGEXES = [COORDS, PHONE, DATE, r"(yes|no|maybe)!", r"[a-zé ]{2,12}!", r"[A-Z][a-z]+(, [A-Z][a-z]+)*\.", r"(ab|abc)+d"]


def prebuild(llm, params: list[SamplingParams]) -> None:
    for p in params:
        llm.grammar.compile(p, wait_automaton=True)


@pytest.fixture(scope="module")
def vocab(embedded_llm):
    import llguidance

    tok = embedded_llm.tokenizer
    voc = AutomatonVocab(token_bytes(tok), embedded_llm.config.vocab_size, embedded_llm.eos_token_ids)
    return tok, voc, llguidance.LLTokenizer(tok.hf_json(), n_vocab=voc.vocab_size, eos_token=list(voc.eos_ids))


def build(vocab, regex: str, max_states: int = 4000):
    import llguidance

    _, voc, lltok = vocab
    grammar = llguidance.LLMatcher.grammar_from_regex(regex)
    return TokenAutomaton.build(regex, voc, max_states, lambda: llguidance.LLMatcher(lltok, grammar)), grammar


@pytest.mark.parametrize("regex", REGEXES)
def test_the_automaton_allows_what_llguidance_allows(vocab, regex):
    automaton, grammar = build(vocab, regex)
    assert automaton is not None and automaton.num_states > 1
    tok, voc, lltok = vocab
    steps = compare_walks(lltok, grammar, automaton, voc.vocab_size, short_bias=token_bytes(tok))
    assert steps > 30


def test_too_many_states_or_an_index_that_misses_a_token_builds_nothing(vocab):
    assert build(vocab, COORDS, max_states=50)[0] is None
    assert build(vocab, "[0-9]{3}", max_states=50)[0] is not None
    # outlines-core's index has no " " after "no" here (an accepting state), llguidance allows it: no automaton
    assert build(vocab, "(yes|no)( please)?")[0] is None


def test_the_pool_places_keeps_and_evicts_least_recently_used():
    pool = AutomatonPool(capacity=100)
    a = pool.place("a", 40)
    b = pool.place("b", 40)
    assert (a.offset, b.offset) == (1, 41)  # row 0 is the free state
    assert pool.place("c", 40) is None  # both in use
    assert pool.place("a", 40) is a and a.refs == 2  # shared by a second request
    pool.release(a)
    pool.release(a)
    pool.release(b)
    pool.place("b", 40)  # b is now the most recently used
    pool.release(b)
    c = pool.place("c", 30)  # evicts a (least recently used), not b
    assert c.offset == 1 and "a" not in pool._placed and "b" in pool._placed
    assert pool.place("big", 100) is None  # more than the table holds (row 0 is taken)


def _batch(llm, temperature: float, depth_llm=None):
    prompts = ["Where are the cats?", "Phone?", "When?", "Tell me a joke.", "Answer politely.", "Name a city."]
    # seed 70: five coordinate pairs at 0.8 (seed 1 drew all sixteen, 127 tokens: four times the steps of the batch)
    params = [SamplingParams(max_tokens=200, temperature=temperature, seed=70, regex=COORDS),
              SamplingParams(max_tokens=40, temperature=temperature, seed=2, regex=PHONE),
              SamplingParams(max_tokens=40, temperature=temperature, seed=3, regex=DATE),
              SamplingParams(max_tokens=16, temperature=temperature, seed=4),
              SamplingParams(max_tokens=40, temperature=temperature, seed=5, regex=r"(yes|no|maybe)!"),
              SamplingParams(max_tokens=16, temperature=temperature, seed=6, top_k=5)]
    return prompts, params


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_automaton_rows_sample_on_the_device_with_the_host_paths_tokens(embedded_llm, embedded_d1, temperature):
    prompts, params = _batch(embedded_llm, temperature)
    results = {}
    for depth, llm in ((1, embedded_d1), (2, embedded_llm)):
        with host_masks(llm):
            host = llm.generate(prompts, params)
        prebuild(llm, params)
        llm.telemetry.clear()
        before = llm.stats()["num_compiles"]
        device = llm.generate(prompts, params)
        assert llm.stats()["num_compiles"] == before
        records = list(llm.telemetry.records)
        assert any(r.automaton_rows and r.kind != "decode" for r in records)  # first tokens, in prefill steps
        assert any(r.automaton_rows for r in records) and not any(r.constrained_rows for r in records)
        for h, d, p in zip(host, device, params, strict=True):
            assert h.token_ids == d.token_ids, (depth, p.constraint)
            if p.constraint is not None:
                assert d.finish_reason == "stop" and re.fullmatch(p.constraint[1], d.text), d.text
        results[depth] = [d.token_ids for d in device]
        assert all(p.refs == 0 for p in llm.engine.automata._placed.values())
    assert results[1] == results[2]


def test_automaton_rows_beside_host_mask_and_logprobs_rows(embedded_llm):
    """A step with a llguidance row (a Lark grammar) or a logprobs row samples at finalize: automaton rows in it take
    their mask from their table on the host, and the steps after it advance their state on the device."""
    llm = embedded_llm
    prompts = ["Where are the cats?", "What is 6 times 7?", "Phone?"]
    params = [SamplingParams(max_tokens=80, temperature=0, regex=COORDS),
              SamplingParams(max_tokens=20, temperature=0, grammar='start: "The answer is " N "."\nN: /[0-9]{1,3}/'),
              SamplingParams(max_tokens=40, temperature=0.5, seed=9, logprobs=2, regex=PHONE)]
    with host_masks(llm):
        host = llm.generate(prompts, params)
    prebuild(llm, params)
    llm.telemetry.clear()
    device = llm.generate(prompts, params)
    records = list(llm.telemetry.records)
    assert any(r.automaton_rows and r.constrained_rows for r in records)  # automaton rows in finalized steps
    for h, d in zip(host, device, strict=True):
        assert h.token_ids == d.token_ids
        assert d.finish_reason == "stop"
    assert [lp[0] for lp in host[2].logprobs] == [lp[0] for lp in device[2].logprobs]


def test_a_full_table_serves_the_request_from_host_masks():
    from conftest import make_llm

    llm = make_llm(automaton_states=64, warmup=False)  # COORDS needs 130 states (warm-up off: CI time)
    p = SamplingParams(max_tokens=80, temperature=0, regex=COORDS)
    prebuild(llm, [p])  # built? no: more states than the table has
    [out] = llm.generate("Where are the cats?", p)
    assert re.fullmatch(COORDS, out.text)
    assert llm.stats()["automaton_steps"] == 0
    q = SamplingParams(max_tokens=40, temperature=0, regex="[0-9]{3}-[0-9]{4}")
    prebuild(llm, [q])
    [out] = llm.generate("Phone?", q)
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", out.text) and llm.stats()["automaton_steps"] > 0


def test_an_aborted_automaton_request_gives_its_table_rows_back(embedded_llm):
    llm = embedded_llm
    p = SamplingParams(max_tokens=80, temperature=0.9, seed=3, regex=COORDS)
    prebuild(llm, [p])
    stream = llm.stream("Where are the cats?", p)
    next(stream)
    next(stream)
    stream.close()  # aborts the request
    llm.generate("Hi", SamplingParams(max_tokens=2))
    assert all(q.refs == 0 for q in llm.engine.automata._placed.values())
    assert np.all(np.asarray([q.offset for q in llm.engine.automata._placed.values()]) >= 1)


def test_a_new_automaton_serves_without_a_compile_after_the_re_warm(embedded_llm):
    """Runner.warmup() recompiles the table writes too: after jax.clear_caches() and the re-warm (the test harness's,
    between modules), placing a new automaton and sampling under it compiles nothing."""
    import jax

    llm = embedded_llm
    jax.clear_caches()
    llm.engine.runner.warmup()
    p = SamplingParams(max_tokens=40, regex=r"(red|green|blue)( and (red|green|blue)){0,2}\.")
    prebuild(llm, [p])
    before = llm.stats()["num_compiles"]
    out, = llm.generate("Name some colours.", p)
    assert llm.stats()["num_compiles"] == before
    assert re.fullmatch(p.constraint[1], out.text), out.text


def test_a_regex_whose_dfa_explodes_builds_nothing_and_the_process_survives():
    """(a|b)*a(a|b){22} has ~2^22 DFA states: outlines-core's index build runs in a child process with a memory limit,
    so it fails there (the constraint stays on llguidance) instead of taking the engine's memory."""
    from jphoton.constrain import automaton as A

    voc = AutomatonVocab([bytes([i]) for i in range(256)], 256, (0,))
    result = A.regex_index("(a|b)*a(a|b){22}", voc, memory_bytes=512 * 2**20, timeout_s=60)
    assert isinstance(result, str) and "failed" in result
    index = A.regex_index("(a|b)*a(a|b){2}", voc)
    assert len(index.states) >= 8 and len(index.finals)
    tokens, targets = index.edges(index.initial)  # "a" and "b" from the start
    assert sorted(tokens.tolist()) == [ord("a"), ord("b")] and len(targets) == 2
