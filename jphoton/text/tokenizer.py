"""Tokenizer (HF `tokenizers`), chat templates (jinja2) and incremental detokenization.

Sources: a HF directory (tokenizer.json + tokenizer_config.json), or any `tokenizers.Tokenizer` handed to the
constructor (weights/gguf_file.py rebuilds one from GGUF metadata).
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
import subprocess
import sys
import threading
from typing import Any

import jinja2
import jinja2.sandbox
import numpy as np
import tokenizers

log = logging.getLogger("jphoton")

# Texts this long (characters) are tokenized in a helper process once `use_helper_process()` was called (servers do):
# tokenizers' encode holds the GIL for its whole run (2 s for 2 MB on a 2-core CPU), which would stall the engine loop
# and every other thread of the process, health checks included.
HELPER_MIN_CHARS = 64 * 2**10
# `encode_within`: a text longer than this many characters a token of the context is first tokenized in part (a cut at
# a word boundary past that length): if the part alone cannot fit, the text is refused without tokenizing the rest
# (2 MB of English took 1.8 s to tokenize on the 2-core CPU box: 600k tokens, for a context of 8,192). English runs at
# ~3-5 bytes a token, so a text this long almost never fits, and a prefix of it that does fit is tokenized again whole.
PREFIX_CHARS_PER_TOKEN = 16
# Where a text may be cut so that its part's tokens are the whole text's first tokens: between a letter and a space
# that a letter follows. Byte-level BPE pre-tokenizers (GPT-2, Llama 3, Qwen regexes) and SentencePiece ("▁" opens a
# piece) never put "x y" into one piece, and BPE merges stay inside a piece.
_WORD_CUT = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")


class Tokenizer:
    """Text <-> token ids, plus the model's chat template."""

    def __init__(self, tok: tokenizers.Tokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 chat_template: str | None = None, add_bos: bool = False):
        self._tok = tok
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tok.token_to_id(eos_token) if eos_token else None
        self._template: jinja2.Template | None = None
        self._max_token_bytes: int | None = None
        self._max_input_bytes: int | None = None
        self._slack: int | None = None
        self._helper: subprocess.Popen | None = None
        self._helper_wanted = False
        self._helper_lock = threading.Lock()

    # ---- sources ------------------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: pathlib.Path) -> Tokenizer | None:
        tj = path / "tokenizer.json"
        if not tj.is_file():
            return None
        try:
            tok = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise ValueError(f"{tj}: cannot be read by tokenizers ({e})") from None
        conf: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            conf = json.loads((path / "tokenizer_config.json").read_text())
        template = conf.get("chat_template")
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])

        def token_str(v):
            return v.get("content") if isinstance(v, dict) else v

        return cls(tok, bos_token=token_str(conf.get("bos_token")), eos_token=token_str(conf.get("eos_token")),
                   chat_template=template, add_bos=bool(conf.get("add_bos_token", False)))

    def save(self, directory: pathlib.Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": self.bos_token, "eos_token": self.eos_token, "chat_template": self.chat_template,
            "add_bos_token": self.add_bos}, indent=1))

    # ---- text <-> ids -------------------------------------------------------------------------------------------
    def use_helper_process(self) -> None:
        """From now on tokenize long texts (>= HELPER_MIN_CHARS) in a helper process (started on first use)."""
        self._helper_wanted = True

    def _encode_far(self, text: str) -> list[int] | None:
        """Token ids from the helper process (jphoton/text/helper.py; one text at a time), or None if it failed."""
        from jphoton.text.helper import read_message, write_message

        with self._helper_lock:
            try:
                if self._helper is None:
                    self._helper = subprocess.Popen([sys.executable, "-m", "jphoton.text.helper"],
                                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                    write_message(self._helper.stdin, self._tok.to_str().encode())
                write_message(self._helper.stdin, text.encode("utf-8", "surrogatepass"))
                data = read_message(self._helper.stdout)
            except OSError:
                data = None
            if data is None:
                log.error("the tokenizer helper process failed; tokenizing in this process from now on")
                self._helper_wanted = False
                return None
        return np.frombuffer(data, np.int32).tolist()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = None
        if self._helper_wanted and len(text) >= HELPER_MIN_CHARS:
            ids = self._encode_far(text)
        if ids is None:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def encode_within(self, text: str, max_tokens: int, add_special_tokens: bool = True) -> list[int] | int:
        """encode(text), or, for a text that cannot fit `max_tokens` tokens, an int: a number of tokens it has at least
        (>= max_tokens), found from a part of it (PREFIX_CHARS_PER_TOKEN) without tokenizing the rest. Never an int
        for a text of fewer than max_tokens tokens: the part ends at a word boundary (_WORD_CUT), so its tokens are the
        whole text's first tokens (an added token with such a boundary inside may be cut: that much slack)."""
        limit = max_tokens * PREFIX_CHARS_PER_TOKEN
        while len(text) > limit:
            cut = _WORD_CUT.search(text, limit)
            if cut is None:  # no word boundary past the limit: only the whole text tells
                break
            n = len(self.encode(text[:cut.start()], add_special_tokens))
            if n >= max_tokens + self._cut_slack():
                return n
            limit *= 4
        return self.encode(text, add_special_tokens)

    def _cut_slack(self) -> int:
        """The most tokens a cut (`encode_within`) can add: the longest added token with a word boundary inside."""
        if self._slack is None:
            added = [t.content for t in self._tok.get_added_tokens_decoder().values()]
            self._slack = max((len(t) for t in added if _WORD_CUT.search(t)), default=0)
        return self._slack

    def max_input_bytes_per_token(self) -> int:
        """The most bytes of input text one token stands for, so that a text of B bytes has at least
        B / this tokens: the longest vocabulary entry in input bytes (a byte-level BPE vocabulary writes one
        character per byte; otherwise its UTF-8 length, never shorter than the text it encodes), times 4 if the
        tokenizer normalizes text (NFC/NFKC compose up to 3 code points into one)."""
        if self._max_input_bytes is None:
            spec = json.loads(self._tok.to_str())
            byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
            added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
            vocab = self._tok.get_vocab(with_added_tokens=True)
            alphabet = frozenset(_byte_level_alphabet()) if byte_level else frozenset()

            def input_bytes(t: str) -> int:
                if t in added or not byte_level:
                    return len(t.encode("utf-8", "surrogatepass"))
                return sum(1 if c in alphabet else len(c.encode("utf-8", "surrogatepass")) for c in t)

            longest = max(map(input_bytes, vocab), default=1)
            self._max_input_bytes = longest * (4 if spec.get("normalizer") else 1)
        return self._max_input_bytes

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def hf_json(self) -> str:
        """The tokenizer as HF `tokenizer.json` text (what llguidance and other tools take)."""
        return self._tok.to_str()

    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest vocabulary entry: no token stands for more input text than this (byte-level and
        SentencePiece pieces are never shorter in UTF-8 than the bytes they encode), before normalization."""
        if self._max_token_bytes is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._max_token_bytes = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1)
        return self._max_token_bytes

    def special_token_ids(self) -> set[int]:
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    # ---- chat ---------------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate() with a raw prompt")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                      for m in messages):
            raise ValueError("a conversation is a list of {'role': ..., 'content': ...} dicts")
        if self._template is None:
            # The same environment HF uses: sandboxed, trim_blocks/lstrip_blocks, loop controls, raise_exception.
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                               extensions=["jinja2.ext.loopcontrols"])

            def raise_exception(message):
                raise ValueError(f"chat template: {message}")

            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        # The template writes BOS itself where the model wants it, so no special tokens are added here (as HF).
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


def _byte_level_alphabet():
    from jphoton.constrain.automaton import _bytes_to_unicode

    return _bytes_to_unicode()


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas that never end inside a UTF-8 sequence.

    `tokenizers`' own `DecodeStream` (Rust; 0.9-1.3 us a token on the CI box against 2.2-3.0 us for two Python-side
    window decodes a token, the algorithm it implements: tests/test_sequence.py holds that one as the reference). A few
    prompt tokens are stepped through first, so that leading spaces decode as in the full text. A prompt of token ids
    that ends inside a character: the first delta holds the whole token that completes it."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self._tok = tokenizer._tok
        self._stream = tokenizers.decoders.DecodeStream(skip_special_tokens=True)
        for i in prompt_ids[-6:]:
            self._stream.step(self._tok, int(i))

    def push(self, token_id: int) -> str:
        return self._stream.step(self._tok, int(token_id)) or ""
