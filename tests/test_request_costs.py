"""Issue 60: a cost bound, checked at submission, for everything a request asks the engine to do. A choice's options x
their tokens (scored without a prefill row per option), a JSON schema's properties (and no grammar that can crash the
process), a text prompt's tokenization (capped by what fits the context), stop_token_ids; a 64-bit seed; a private
cache directory; an aborted stream's record. Over a limit: a ValueError naming it, in milliseconds; just within: served.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
import time

import numpy as np
import pytest

from jphoton import SamplingParams


@contextlib.contextmanager
def limits(llm, **kw):
    """The shared engine with other request limits for the block (they are read at each submission)."""
    cfg = llm.engine_config
    llm.engine_config = dataclasses.replace(cfg, limits=dataclasses.replace(cfg.limits, **kw))
    try:
        yield
    finally:
        llm.engine_config = cfg


def one_token_words(llm, n):
    vocab = llm.tokenizer._tok.get_vocab()
    words = []
    for t in sorted(t for t in vocab if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 4):
        if len(llm.tokenizer.encode(" " + t[1:], add_special_tokens=False)) == 1:
            words.append(" " + t[1:])
            if len(words) == n:
                return words
    raise AssertionError("not enough one-token words")


def refused(fn, limit, seconds=2.0):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=limit) as e:
        fn()
    assert time.perf_counter() - t0 < seconds, f"refused after {time.perf_counter() - t0:.2f} s"
    return str(e.value)


# ---- 1. choice: options x tokens ------------------------------------------------------------------------------------
def test_a_choice_is_bounded_by_its_tokens_and_scored_without_a_prefill_row_per_option(embedded_llm):
    """1,024 short options (then max_choices) never finished in 240 s: each option prefilled the prompt's last page in
    a row of its own (2 to 4 rows a step). Now the options x their tokens are bounded (max_choice_tokens, checked
    once they are tokenized) and every branch but the leader starts as a decode row on a copy of the prompt's last
    page, also after the first wave has finished (16 options, 8 rows a step here). Scores equal those of the options
    scored a few at a time."""
    llm = embedded_llm
    words = one_token_words(llm, 17)
    prompt = {"prompt_token_ids": llm.encode_chat([{"role": "user", "content": "Say one word."}])}
    default = llm.engine_config.limits
    per = default.max_choice_tokens // default.max_choices  # tokens an option: with its end, over the budget
    over = ["".join(words[i % 17] for i in range(k, k + per)) for k in range(default.max_choices)]
    message = refused(lambda: llm.generate(prompt, SamplingParams(choice=over)), "max_choice_tokens", 0.5)
    assert "tokens to score" in message and len(message) < 200
    refused(lambda: llm.generate(prompt, SamplingParams(choice=[f"c{i}" for i in range(default.max_choices + 1)])),
            "max_choices", 0.5)
    with limits(llm, max_choice_tokens=32):  # 16 one-token options and their ends: 32
        refused(lambda: llm.generate(prompt, SamplingParams(choice=words[:17])), "max_choice_tokens", 0.5)
        llm.telemetry.clear()
        [out] = llm.generate(prompt, SamplingParams(temperature=0, choice=words[:16]))
    records = list(llm.telemetry.records)
    assert sum(r.kind != "decode" for r in records) == 1, [(r.kind, r.rows) for r in records]  # the leader's prefill
    assert len(records) <= -(-2 * 16 // llm.engine_config.max_choice_rows) + 3, [(r.kind, r.rows) for r in records]
    parts = [o for k in range(0, 16, 4) for o in llm.generate(prompt, SamplingParams(temperature=0,
                                                                                     choice=words[k:k + 4]))]
    expect = [s for o in parts for s in o.choice_scores]
    np.testing.assert_allclose(out.choice_scores, expect, atol=2e-4)
    assert out.choice_index == int(np.argmax(expect)) and out.text == words[out.choice_index]


def test_a_choice_at_the_limits_beside_a_stream_adds_rows_not_waits(embedded_llm):
    """A concurrent greedy stream's steps carry at most max_choice_rows of the choice's branches, and none of them waits
    for a host mask (branches are forced on the device): the stream keeps its pipelined tick, its tokens are those of
    its solo run. (The gap itself is measured by lab/probes/choice_cost.py: x2.0-2.6 on the 2-core CPU box.)"""
    llm = embedded_llm
    default = llm.engine_config.limits
    words = one_token_words(llm, default.max_choices)
    stream = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    [solo] = llm.generate("Once upon a time", stream)
    before = llm.engine.num_constrained_steps
    sid = llm.add_request("Once upon a time", stream)
    tokens, cid, done = [], None, False
    llm.telemetry.clear()
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.request_id == sid:
                tokens += out.delta.token_ids
                if len(tokens) >= 4 and cid is None:  # at the limits: 32 one-token options and their ends = 64
                    cid = llm.add_request("Pick one word.", SamplingParams(temperature=0, choice=words))
            done |= out.request_id == cid and out.delta.finish_reason == "stop"
    assert done and tokens == solo.token_ids
    assert llm.engine.num_constrained_steps == before
    assert max(r.rows for r in llm.telemetry.records if r.kind == "decode") <= 1 + llm.engine_config.max_choice_rows


# ---- 2. JSON schemas and grammars: compile time and the compile's stack -----------------------------------------------
def test_a_schema_over_its_property_budget_is_refused_before_it_compiles(embedded_llm):
    """6,000 optional properties (200 KB, under max_constraint_bytes) took 3.8-55 s to compile before llguidance
    refused it; llguidance's compile grows with the square of an object's optional properties."""
    llm = embedded_llm
    n = llm.engine_config.limits.max_schema_properties

    def schema(k, required=False, nested=False):
        props = {f"field_{i}": {"type": "string"} for i in range(k)}
        doc = {"type": "object", "properties": props, **({"required": list(props)} if required else {})}
        return {"type": "object", "properties": {"a": doc}} if nested else doc

    message = refused(lambda: llm.prepare_request("hi", SamplingParams(json_schema=schema(6000))),
                      "max_schema_properties", 0.5)
    assert "more than 1024 properties" in message
    refused(lambda: llm.prepare_request("hi", SamplingParams(json_schema=schema(n, nested=True))),  # (n + 1 in all)
            "max_schema_properties", 0.5)
    t0 = time.perf_counter()
    seq = llm.prepare_request("hi", SamplingParams(json_schema=schema(n, required=True)))  # at the limit: compiled
    assert time.perf_counter() - t0 < 2.0 and seq.constraint is not None
    small = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 8} for i in range(3)},
             "required": [f"field_{i}" for i in range(3)], "additionalProperties": False}
    [out] = llm.generate("A record:", SamplingParams(json_schema=small, temperature=0, max_tokens=80))
    assert sorted(json.loads(out.text)) == ["field_0", "field_1", "field_2"]


def test_deeply_chained_grammars_compile_on_a_stack_that_holds_them(embedded_llm):
    """A JSON schema of 4,000 chained $refs (230 KB, no property) and a Lark grammar of 3,000 chained rules (66 KB)
    overflowed an 8 MiB thread stack inside llguidance and killed the process (SIGSEGV): matchers are built on a thread
    with a 256 MiB stack (constraints.on_compile_stack). Both compile well within 2 s."""
    llm = embedded_llm
    n = 4000
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    chained = json.dumps({"$ref": "#/$defs/d0", "$defs": defs}, separators=(",", ":"))
    lark = "start: r0\n" + "\n".join(f'r{i}: "w" r{i + 1} | "x"' for i in range(3000)) + '\nr3000: "e"'
    for params in (SamplingParams(json_schema=chained), SamplingParams(grammar=lark)):
        t0 = time.perf_counter()
        try:
            llm.prepare_request("hi", params)
        except ValueError as e:  # (refusing it is fine too: it must not crash, nor take long)
            assert len(str(e)) < 400
        assert time.perf_counter() - t0 < 2.0


def test_a_large_regular_constraint_gets_no_device_automaton_build(embedded_llm):
    """An enum of 5,000 values (69 KB) compiles in llguidance in ~20 ms, but its regex (64 KB) took the automaton
    build 2.3 s of a core (a 20,000-value enum 9 s) to find that it does not fit the tables: a regex over 8 bytes a
    table state is not built (logged), and the constraint is served from llguidance's masks."""
    llm = embedded_llm
    params = SamplingParams(json_schema={"enum": [f"value_{i}" for i in range(5000)]}, temperature=0, max_tokens=8)
    t0 = time.perf_counter()
    constraint = llm.grammar.compile(params, wait_automaton=True)
    assert time.perf_counter() - t0 < 1.0 and constraint.automaton is None
    [out] = llm.generate("Pick a value:", params)
    assert json.loads(out.text) in {f"value_{i}" for i in range(5000)}


# ---- 3. text prompts: tokenized only as far as the context can hold ---------------------------------------------------
def _count_encodes(monkeypatch, tok):
    seen = []
    encode = tok.encode

    def spy(text, add_special_tokens=True):
        seen.append(len(text))
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tok, "encode", spy)
    return seen


def test_a_long_text_prompt_is_refused_from_a_part_of_it(embedded_llm, monkeypatch):
    """A 2 MB prompt was tokenized whole (23-78 s under load, 1.8 s alone) before it was refused. It is now refused
    before any tokenizing (a byte-level vocabulary's token stands for at most 81 bytes here, not 4 x 162), and a text
    that passes that bound is tokenized in part (a cut at a word boundary past 16 characters a token of the context)
    when the part already cannot fit. Sound: a text of max_model_len - 1 tokens that is longer than the part is still
    tokenized whole and accepted (its part has fewer tokens than the context)."""
    llm, tok = embedded_llm, embedded_llm.tokenizer
    ctx = llm.max_model_len
    words = "the cat sat on a mat and then it ran to the door " * 50_000
    big = words[:2_000_000]
    seen = _count_encodes(monkeypatch, tok)
    message = refused(lambda: llm.generate(big), r"at least \d+ tokens", 0.5)
    assert "the context holds" in message and not seen
    mid = words[:600_000]  # under 81 x 8192 bytes: tokenized, in part
    refused(lambda: llm.generate(mid), r"prompt has at least \d+ tokens; the context holds", 2.0)
    assert seen and max(seen) < len(mid) // 3, seen
    seen.clear()
    refused(lambda: llm.chat([{"role": "user", "content": mid}]), r"at least \d+ tokens", 2.0)
    assert seen and max(seen) < len(mid) // 3
    # Just within: 29 characters a token, so the text is longer than its part (16 x 8192 characters).
    unit = "\n" + " " * 81 + "ab cd"
    per_unit = len(tok.encode(unit * 10)) / 10
    k = int((ctx - 1) / per_unit)
    while len(tok.encode(unit * (k + 1))) <= ctx - 1:
        k += 1
    while len(tok.encode(unit * k)) > ctx - 1:
        k -= 1
    fits = unit * k
    assert len(fits) > 16 * ctx
    seen.clear()
    ids = llm.requests.prompt_ids(fits)  # (prepare_request's prompt step: this engine's KV pool is smaller than a context)
    assert ids == tok.encode(fits) and len(ids) <= ctx - 1
    assert len(seen) >= 2 and max(seen) == len(fits)  # a part first, then the whole
    refused(lambda: llm.requests.prompt_ids(fits + unit * 4), r"prompt has \d+ tokens; the context holds")


def test_the_tokenizer_helper_process_takes_the_part_too(embedded_llm):
    """Served prompts of >= HELPER_MIN_CHARS are tokenized in a helper process (no GIL held for seconds): a 600 KB text
    is refused there from its 131k-character part."""
    from jphoton.text.tokenizer import Tokenizer

    base = embedded_llm.tokenizer
    tok = Tokenizer(base._tok, bos_token=base.bos_token, eos_token=base.eos_token)
    tok.use_helper_process()
    try:
        t0 = time.perf_counter()
        n = tok.encode_within("one two three four five six " * 21_000, 8192)
        assert isinstance(n, int) and n >= 8192 and time.perf_counter() - t0 < 2.0
        assert tok._helper is not None and tok._helper.poll() is None  # (it ran there)
        assert tok.encode_within("one two three", 8192) == base.encode("one two three")
    finally:
        if tok._helper is not None:
            tok._helper.stdin.close()
            tok._helper.wait(timeout=10)


# ---- 4. smaller ones ------------------------------------------------------------------------------------------------
def test_stop_token_ids_are_bounded(embedded_llm):
    """98k stop_token_ids were accepted (every committed token is checked against them)."""
    llm = embedded_llm
    n = llm.engine_config.limits.max_stop_token_ids
    message = refused(lambda: llm.generate("Hi", SamplingParams(stop_token_ids=list(range(98_000)))),
                      "max_stop_token_ids", 0.5)
    assert "98000 stop_token_ids" in message
    [out] = llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                              stop_token_ids=list(range(30_000, 30_000 + n))))
    assert len(out.token_ids) == 3 or out.finish_reason == "stop"


def test_seeds_take_the_whole_64_bit_range(embedded_llm):
    """seed=2**63 was refused as "must be a non-negative integer" although seeds are 64-bit (sampling.seed_key_data)."""
    llm = embedded_llm
    runs = [llm.generate("Once upon a time", SamplingParams(max_tokens=6, seed=s, ignore_eos=True))[0].token_ids
            for s in (2**63, 2**64 - 1, 2**63)]
    assert runs[0] == runs[2] and runs[0] != runs[1]
    for bad in (2**64, -1):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
            SamplingParams(seed=bad)


def test_the_cache_directories_are_private(tmp_path, monkeypatch):
    """The XLA cache directory (and the converted-model cache beside it) were made 0755 under a shared home."""
    import jax

    from jphoton.weights.store import cache_dir, private_dir

    old = os.umask(0o022)
    try:
        monkeypatch.setenv("JPHOTON_CACHE_DIR", str(tmp_path / "home" / "jphoton"))
        root = cache_dir().parent
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o755)
        private_dir(shared / "xla")
        private_dir(shared)
        assert stat.S_IMODE((shared / "xla").stat().st_mode) == 0o700
        assert stat.S_IMODE(shared.stat().st_mode) == 0o700  # ours and too open: narrowed
    finally:
        os.umask(old)
    xla = jax.config.jax_compilation_cache_dir  # this session's, set by its first LLM()
    if xla and os.environ.get("JPHOTON_CACHE_DIR") and xla.startswith(os.environ["JPHOTON_CACHE_DIR"]):
        assert stat.S_IMODE(os.stat(xla).st_mode) == 0o700


def test_an_aborted_stream_that_nobody_reads_lets_go_of_its_record(embedded_llm):
    """`s = llm.stream(...); next(s); llm.abort(id)` left the sequence in llm.engine.sequences (and its pages held,
    has_unfinished_requests() True) until some other call ticked the engine; its stream never saw the abort."""
    llm = embedded_llm
    s = llm.stream("Once upon a time", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert next(s).token_ids
    assert llm.abort(s.request_id).delta.finish_reason == "abort"
    stats = llm.stats()
    assert not llm.engine.sequences and not llm.has_unfinished_requests() and s.request_id not in llm._outputs
    assert stats["kv_pages_free"] + stats["kv_pages_evictable"] == stats["kv_pages_total"]
    assert [d.finish_reason for d in s][-1:] == ["abort"]  # read later, the stream ends with the abort
    assert llm.abort(s.request_id) is None
    with llm.stream("Hello", SamplingParams(max_tokens=4, temperature=0)) as again:  # the engine serves on
        assert "".join(d.text for d in again)
