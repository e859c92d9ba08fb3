"""Host-side stop detection and incremental detokenization (no device involved)."""

from __future__ import annotations

import random

import pytest

from jphoton.params import SamplingParams
from jphoton.sequence import Sequence
from jphoton.text.tokenizer import IncrementalDetokenizer, Tokenizer

from conftest import FIXTURES


@pytest.fixture(scope="module")
def tok(embedded_llm):
    return embedded_llm.tokenizer


def _seq(tok, params, prompt="Hi"):
    return Sequence(0, tok.encode(prompt), params, tokenizer=tok, eos_token_ids=(2,), max_model_len=8192, seed=0)


def test_detokenizer_never_emits_broken_utf8(tok):
    text = "naïve café — 日本語のテキスト ☃ 🎉 done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # some characters span several byte-level tokens
    detok = IncrementalDetokenizer(tok, tok.encode("Start:"))
    pieces = [detok.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)


class _WindowDetokenizer:
    """The reference: two decodes a token over a short window, a delta held back while the window's text ends in
    U+FFFD (what `IncrementalDetokenizer`'s DecodeStream does in Rust; jphoton used this until 2026-11-29)."""

    def __init__(self, tok, prompt_ids):
        self.tok, self.ids = tok, list(prompt_ids[-6:])
        self.prefix, self.read = 0, len(self.ids)

    def push(self, token_id):
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        full_text = self.tok.decode(self.ids[self.prefix:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return full_text[len(prefix_text):]
        return ""


@pytest.mark.parametrize("which", ["embedded", "llama3"])
def test_detokenizer_equals_the_window_reference(tok, which):
    """Every delta equal to the reference's, for text and for random ids (invalid UTF-8 on the way, special tokens),
    after any prompt tail that ends on a character boundary (one that ends inside a character: the class docstring)."""
    if which == "llama3":  # a tiny byte-level vocabulary: many ids are lone UTF-8 bytes
        tok = Tokenizer.from_hf_dir(FIXTURES / "tiny" / "llama3")
    rng = random.Random(5)
    texts = ["The quick brown fox. ", "naïve café — 日本語のテキスト ☃ 🎉", "  spaces\n\ttabs\n", "def f(x):\n    return x"]
    checked = 0
    for trial in range(300):
        ids = (tok.encode(rng.choice(texts) * rng.randint(1, 4)) if trial % 2
               else [rng.randrange(tok.vocab_size) for _ in range(rng.randint(8, 60))])
        k = rng.randint(1, min(8, len(ids) - 1))
        prompt, out = ids[:k], ids[k:]
        if tok.decode(prompt[-6:]).endswith("\ufffd"):
            continue
        fast, ref = IncrementalDetokenizer(tok, prompt), _WindowDetokenizer(tok, prompt)
        assert [fast.push(i) for i in out] == [ref.push(i) for i in out], (trial, prompt, out)
        checked += 1
    assert checked > 150


def test_stop_string_across_token_boundaries_is_cut_and_never_streamed(tok):
    target = " and then STOP here"
    seq = _seq(tok, SamplingParams(stop=("STOP",)))
    streamed = ""
    for t in tok.encode(target):
        d = seq.append(t)
        streamed += d.text
        if seq.finished:
            break
    assert seq.finish_reason == "stop"
    assert seq.text == " and then "
    assert streamed == seq.text
    assert "ST" not in streamed


def test_stop_token_ids_eos_and_length(tok):
    seq = _seq(tok, SamplingParams(stop_token_ids=(42,)))
    seq.append(7)
    assert not seq.finished
    seq.append(42)
    assert seq.finish_reason == "stop" and seq.output_ids == [7, 42]

    seq = _seq(tok, SamplingParams())
    seq.append(2)  # EOS
    assert seq.finish_reason == "stop"
    seq = _seq(tok, SamplingParams(ignore_eos=True, max_tokens=2))
    seq.append(2)
    assert not seq.finished
    seq.append(2)
    assert seq.finish_reason == "length"


def test_context_end_stops_when_max_tokens_is_none(tok):
    seq = Sequence(0, [5, 6, 7], SamplingParams(max_tokens=None, ignore_eos=True), tokenizer=tok, eos_token_ids=(2,),
                   max_model_len=5, seed=0)
    seq.append(9)
    assert not seq.finished
    seq.append(9)
    assert seq.finish_reason == "length" and seq.num_tokens == 5


def test_abort_flushes_held_back_text(tok):
    seq = _seq(tok, SamplingParams(stop=("NEVER_MATCHES",)))
    streamed = "".join(seq.append(t).text for t in tok.encode(" hello world"))
    assert streamed != seq.text  # the tail is held back while it could start a stop string
    streamed += seq.finish("abort").text
    assert streamed == seq.text and seq.finish_reason == "abort"


def test_tokens_between_spans_prompt_and_output():
    """A prefill chunk's tokens (a preempted sequence is prefilled again over its prompt and its output)."""
    seq = Sequence(0, [10, 11, 12], SamplingParams(max_tokens=8, ignore_eos=True), tokenizer=None, eos_token_ids=(),
                   max_model_len=64, seed=0)
    for t in (20, 21):
        seq.append(t)
    everything = [10, 11, 12, 20, 21]
    for a in range(6):
        for b in range(a, 6):
            assert seq.tokens_between(a, b) == everything[a:b]
    with pytest.raises(AssertionError):
        seq.tokens_between(4, 6)  # the sixth is not sampled yet
