"""Constrained decoding: JSON schema, regex, Lark grammar and choice rows batched with free rows, at both pipeline
depths, greedy and seeded; bad constraints refused at submission; a grammar failure mid-flight ends one request."""

from __future__ import annotations

import json
import re

import jax
import jsonschema
import pytest
from automaton_walk import host_masks
from schemas import COLOURS, PERSON, WEATHER

from jphoton import SamplingParams

from conftest import llm_at_depth

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
SENTIMENT = ["positive", "negative", "neutral"]
ANSWER_LARK = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'

CASES = [  # (user message, constraint kwargs, validator of the output text)
    ("Describe a fictional person as JSON.", {"json_schema": PERSON}, ("schema", PERSON)),
    ("List some colours you like, as JSON.", {"json_schema": json.dumps(COLOURS)}, ("schema", COLOURS)),
    ("Today's weather in Paris, as JSON.", {"json_schema": WEATHER}, ("schema", WEATHER)),
    ("Give me a phone number.", {"regex": PHONE}, ("regex", PHONE)),
    ("When did the Berlin wall fall?", {"regex": DATE}, ("regex", DATE)),
    ("'I loved this film!' Sentiment?", {"choice": SENTIMENT}, ("choice", SENTIMENT)),
    ("What is 6 times 7?", {"grammar": ANSWER_LARK}, ("regex", r"The answer is [0-9]{1,3}\.")),
]
FREE = ["Tell me a joke.", "Name a city."]


def valid(text: str, check) -> bool:
    kind, spec = check
    if kind == "schema":
        try:
            jsonschema.validate(json.loads(text), spec)
            return True
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    return text in spec


def run_batch(llm, temperature: float):
    chat = [{"prompt_token_ids": llm.encode_chat([{"role": "user", "content": m}])} for m, _, _ in CASES]
    free = [{"prompt_token_ids": llm.encode_chat([{"role": "user", "content": m}])} for m in FREE]
    # max_tokens far beyond any valid output: a "length" finish is a failure, not a truncation.
    params = [SamplingParams(max_tokens=200, temperature=temperature, seed=100 + i, **kw)
              for i, (_, kw, _) in enumerate(CASES)]
    params += [SamplingParams(max_tokens=24, temperature=temperature, seed=7 + i) for i in range(len(FREE))]
    llm.telemetry.clear()
    transfers = llm.engine.runner.input_transfers
    # Interleave free and constrained prompts so that both kinds share steps.
    order = [0, len(CASES), 1, 2, len(CASES) + 1, 3, 4, 5, 6]
    prompts, plist = chat + free, params
    outs = llm.generate([prompts[i] for i in order], [plist[i] for i in order])
    by_index = dict(zip(order, outs, strict=True))
    return ([by_index[i] for i in range(len(CASES))], [by_index[len(CASES) + i] for i in range(len(FREE))],
            llm.engine.runner.input_transfers - transfers)


@pytest.fixture(scope="module")
def runs(embedded_d1, embedded_llm, embedded_d3):
    """{(depth, temperature): (constrained completions, free completions, step records, host->device input copies)}:
    one engine per depth, every grammar row on host masks."""
    results = {}
    for depth, llm in ((1, embedded_d1), (2, embedded_llm), (3, embedded_d3)):
        for temperature in (0.0, 0.8):
            with host_masks(llm):
                constrained, free, transfers = run_batch(llm, temperature)
            results[depth, temperature] = (constrained, free, list(llm.telemetry.records), transfers)
    return results


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_device_automata_give_the_host_masks_tokens(runs, request, depth, temperature):
    """The same batch on engines' device automata, every regular constraint's automaton built beforehand:
    those rows sample under their device automaton (jphoton/constrain/automaton.py) and draw exactly the host path's tokens."""
    llm = llm_at_depth(request, depth)
    for _, kw, _ in CASES:
        llm.grammar.compile(SamplingParams(**kw), wait_automaton=True)
    constrained, free, _ = run_batch(llm, temperature)
    assert any(r.automaton_rows for r in llm.telemetry.records)
    host_constrained, host_free, _, _ = runs[depth, temperature]
    for a, b in zip(host_constrained + host_free, constrained + free, strict=True):
        assert a.token_ids == b.token_ids


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_every_constrained_output_is_valid(runs, depth, temperature):
    constrained, free, _, _ = runs[depth, temperature]
    for (_, kw, check), out in zip(CASES, constrained, strict=True):
        assert out.finish_reason == "stop", (kw, out.text, out.finish_reason)
        assert valid(out.text, check), (kw, out.text)
    assert all(o.finish_reason in ("stop", "length") and o.token_ids for o in free)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_tokens_identical_between_depths(runs, temperature):
    for depth in (2, 3):
        for a, b in zip(sum(runs[1, temperature][:2], []), sum(runs[depth, temperature][:2], []), strict=True):
            assert a.token_ids == b.token_ids


def test_constrained_and_free_rows_share_steps(runs):
    for key, (_, _, records, _) in runs.items():
        shared = [r for r in records if 0 < r.constrained_rows < r.rows]
        assert shared, f"no step mixed free and grammar rows at {key}"
        assert all(r.t_finalize >= r.t_launched for r in records if r.constrained_rows)
    # Depth 2: step t+1's forward is launched before t is committed; only its masks wait for t's tokens.
    records = runs[2, 0.0][2]
    by_id = {r.step_id: r for r in records}
    overlapped = [r for r in records if r.constrained_rows and r.step_id - 1 in by_id
                  and r.t_launched < by_id[r.step_id - 1].t_commit and r.t_finalize > by_id[r.step_id - 1].t_ready]
    assert len(overlapped) > len(records) // 2


def test_a_pipelined_grammar_step_costs_one_input_transfer(runs):
    """The masked sampler's transfer also carries the next step's input (planned while the step ran, at depth 2 and
    at depth 1 alike), so a step costs one host->device copy with or without grammar rows."""
    for depth in (3, 2, 1):
        _, _, records, transfers = runs[depth, 0.0]
        assert sum(r.constrained_rows > 0 for r in records) > len(records) // 2
        assert transfers <= len(records) + 2


def test_a_free_request_is_unchanged_by_grammar_neighbours(runs, embedded_llm):
    prompt = {"prompt_token_ids": embedded_llm.encode_chat([{"role": "user", "content": FREE[0]}])}
    [alone] = embedded_llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.8, seed=7))
    assert runs[2, 0.8][1][0].token_ids == alone.token_ids


@pytest.mark.parametrize("kwargs, message", [
    ({"json_schema": '{"type": "object", "properties": {"a": {"type": "nonsense"}}}'}, "invalid json_schema"),
    ({"json_schema": "{not json"}, "not valid JSON"),
    ({"json_schema": [1, 2]}, "json_schema must be"),
    ({"json_schema": {"enum": [-2**63]}}, "outside"),  # (llguidance 1.9.1 crashes the process on it)
    ({"regex": "(unclosed"}, "invalid regex"),
    ({"grammar": "start: undefined_rule"}, "invalid grammar"),
    ({"choice": []}, "choice must be"),
    ({"regex": "a+", "choice": ["a"]}, "at most one constraint"),
    ({"json_schema": {"type": "object"}, "grammar": 'start: "x"'}, "at most one constraint"),
])
def test_bad_constraints_are_refused_at_submission(embedded_llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        embedded_llm.generate("Hello", SamplingParams(max_tokens=4, **kwargs))
    [ok] = embedded_llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0, choice=["yes", "no"]))
    assert ok.text in ("yes", "no") and ok.finish_reason == "stop"


@pytest.mark.parametrize("depth", [1, 2])
def test_a_grammar_failure_mid_flight_ends_only_that_request(request, monkeypatch, depth):
    """Feed one matcher a token its grammar forbids (as a broken sampler would): that request ends with "error" and
    a message, its pages come back, its neighbours finish normally."""
    llm = llm_at_depth(request, depth)
    monkeypatch.setattr(llm.grammar, "_automata_states", 0)  # the matchers' path (device automata: test_automaton.py)
    letter = llm.tokenizer.encode("x")[0]
    real_advance = llm.grammar.advance
    victims = []

    def sabotage(tokens):
        tokens = list(tokens)
        for i, (c, _) in enumerate(tokens):
            if c.kind == "forced":  # the choice request's branches (constrain/choice.py)
                continue
            if c.kind == "regex" and len(c.calls) == 2:
                tokens[i] = (c, letter)
                victims.append(c)
            c.calls.append(1)
        return real_advance(tokens)

    monkeypatch.setattr(llm.grammar, "advance", sabotage)
    original_compile = llm.grammar.compile

    def compile_and_count(params):
        c = original_compile(params)
        if c is not None:
            c.calls = []
        return c

    monkeypatch.setattr(llm.grammar, "compile", compile_and_count)
    outs = llm.generate(["Phone?", "Colour?", "Hi"], [
        SamplingParams(max_tokens=40, temperature=0, regex=PHONE),
        SamplingParams(max_tokens=40, temperature=0, choice=["red", "green"]),
        SamplingParams(max_tokens=8, temperature=0)])
    assert victims
    assert outs[0].finish_reason == "error" and "rejected token" in outs[0].error
    assert len(outs[0].token_ids) == 2
    assert outs[1].finish_reason == "stop" and outs[1].text in ("red", "green")
    assert outs[2].finish_reason in ("stop", "length") and outs[2].token_ids


def test_the_mask_path_makes_no_implicit_transfer(embedded_llm):
    llm = embedded_llm
    llm.generate("warm", SamplingParams(max_tokens=2, temperature=0, regex="[a-z]+"))
    with jax.transfer_guard_host_to_device("disallow"):
        [out] = llm.generate("Phone?", SamplingParams(max_tokens=40, temperature=0, regex=PHONE))
    assert re.fullmatch(PHONE, out.text)


def test_constrained_steps_compile_nothing_after_warmup(embedded_llm):
    before = embedded_llm.stats()["num_compiles"]
    embedded_llm.generate(["Phone?", "JSON?"], [
        SamplingParams(max_tokens=40, temperature=0.7, top_k=20, logprobs=3, regex=PHONE),
        SamplingParams(max_tokens=80, temperature=0, json_schema=COLOURS)])
    assert embedded_llm.stats()["num_compiles"] == before


def test_mask_fill_modes_agree_and_auto_picks_one(embedded_llm, monkeypatch, caplog):
    """The serial and the parallel fill write the same masks; "auto" times both and settles on one, saying which."""
    import numpy as np

    from jphoton.constrain import compiler as C

    monkeypatch.setattr(C, "AUTO_TRIALS", 3)
    grammar = C.GrammarCompiler(embedded_llm.tokenizer, embedded_llm.config.vocab_size, embedded_llm.eos_token_ids)
    ids = embedded_llm.tokenizer.encode('{"name":"Ada Lovelace","age":36,"address":{"city":"London","zip":"12345"}}')
    rows = []
    for i in range(8):  # eight matchers at different points of one valid document
        c = grammar.compile(SamplingParams(json_schema=PERSON))
        for t in ids[: i * len(ids) // 8]:
            assert c.matcher.consume_token(t)
        rows.append((c, 2 * i))  # every other row: the rows between must stay untouched
    W = C.mask_words(embedded_llm.config.vocab_size)
    masks = {}
    for mode in ("parallel", "serial"):
        grammar.fill_mode = mode
        masks[mode] = np.full((16, W), -1, np.int32)
        grammar.fill_masks(rows, masks[mode])
    np.testing.assert_array_equal(masks["parallel"], masks["serial"])
    assert (masks["serial"][1::2] == -1).all() and (masks["serial"][::2] != -1).any()
    grammar.fill_mode = "auto"
    with caplog.at_level("INFO", logger="jphoton.constrain.compiler"):
        for _ in range(2 * C.AUTO_TRIALS):
            grammar.fill_masks(rows, np.full((16, W), -1, np.int32))
    assert grammar.fill_mode in ("parallel", "serial")
    assert len(grammar.fill_trials["parallel"]) == len(grammar.fill_trials["serial"]) == C.AUTO_TRIALS
    assert any("grammar masks:" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError):
        C.GrammarCompiler(None, 10, (), fill_mode="fastest")
