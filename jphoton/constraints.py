"""Constrained decoding on the host: one llguidance matcher per request, token bitmasks for many rows at once.

llguidance (Rust, no Python dependencies) compiles a JSON schema, regex or Lark/GBNF grammar against the tokenizer in
about a millisecond and fills one int32 bitmask row (bit v of word v // 32 = token v allowed) per request in ~0.1 ms;
its executor fills and advances many rows in parallel threads with the GIL released. Plain Python otherwise: the
engine decides when masks are built and where they go.
"""

from __future__ import annotations

import logging
import statistics
import time

import numpy as np

from jphoton.params import SamplingParams

log = logging.getLogger("jphoton.constraints")

# Compact JSON: a small model left free to choose whitespace can indent forever instead of closing the object.
JSON_OPTIONS = {"whitespace_flexible": False}


FILL_MODES = ("auto", "parallel", "serial")
# "parallel": llguidance's default executor (a thread per core); "serial": an executor of one thread (one call for all
# rows, ~35% faster than a Python loop over rows, and it keeps the GIL released for the whole fill). "auto": the first
# AUTO_TRIALS fills of >= AUTO_MIN_ROWS rows alternate between the two, then the faster per row wins. Why measure: one
# mask costs ~5-20 us alone, yet inside the engine the parallel executor took 7-25x that per row (H100 host: 1.56 ms for
# 32 rows; this 2-core CPU box: 2-4 ms, serial 1 ms): thread wake-ups and whatever else the machine is doing decide it,
# and that differs by machine.
AUTO_TRIALS = 16
AUTO_MIN_ROWS = 4
PROBE_STEPS = 4  # tokens a new constraint is walked at submission (GrammarCompiler._probe)


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Turns a request's constraint into a `Constraint` for one tokenizer. Building the llguidance tokenizer takes
    ~0.4 s, so it happens on the first constrained request, not at start-up."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], fill_mode: str = "auto"):
        if fill_mode not in FILL_MODES:
            raise ValueError(f"fill_mode must be one of {FILL_MODES}, got {fill_mode!r}")
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lltok = None
        self._executors = {}  # fill mode -> llguidance.LLExecutor
        self._limits = None
        self.fill_mode = fill_mode  # "auto" becomes "parallel" or "serial" once measured
        self.fill_trials: dict[str, list[float]] = {"parallel": [], "serial": []}  # seconds per row, while "auto"

    def _llguidance(self):
        import llguidance

        if self._lltok is None:
            if self._tokenizer is None:
                raise ValueError("constrained decoding needs a tokenizer; this model has none")
            # The model's vocabulary may be padded past the tokenizer's: n_vocab makes masks cover every logit.
            hf_json = self._tokenizer.hf_json()
            try:
                self._lltok = llguidance.LLTokenizer(hf_json, n_vocab=self.vocab_size, eos_token=self._eos or None)
            except TypeError:  # llguidance <= 1.6 takes one EOS id (the newest wheel for some platforms)
                self._lltok = llguidance.LLTokenizer(hf_json, n_vocab=self.vocab_size,
                                                     eos_token=self._eos[0] if self._eos else None)
            self._executors = {"parallel": llguidance.LLExecutor(), "serial": llguidance.LLExecutor(1)}
            self._limits = llguidance.LLParserLimits(verbose_errors=False)  # errors name the problem, not the state
        return llguidance

    def compile(self, params: SamplingParams) -> Constraint | None:
        """Compile the request's constraint; a bad schema/regex/grammar is a ValueError here, at submission. A `choice`
        compiles to nothing: its options are scored as sequences (engine/choice.py)."""
        spec = params.constraint
        if spec is None or spec[0] == "choice":
            return None
        llg = self._llguidance()
        kind, value = spec
        try:
            if kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(value)
            elif kind == "grammar":
                grammar = llg.grammar_from("grammar", value)  # Lark as is, GBNF converted to Lark
            else:
                raise AssertionError("choice is scored by the engine (engine/choice.py), not compiled")
        except ValueError as e:  # llguidance's messages may quote the whole input: keep the start
            raise ValueError(f"invalid {kind}: {_cut(str(e))}") from None
        except RecursionError:
            raise ValueError(f"invalid {kind}: nested too deeply") from None
        matcher = llg.LLMatcher(self._lltok, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ValueError(f"invalid {kind}: {_cut(_error_of(matcher))}")
        error = self._probe(matcher)
        if error:
            raise ValueError(f"{kind} cannot be served: {_cut(error)}")
        return Constraint(kind, matcher)

    def _probe(self, matcher) -> str:
        """Walk a copy of the matcher PROBE_STEPS tokens in (the lowest allowed non-EOS token each time): a grammar that
        compiles but exceeds llguidance's limits as soon as it is used (a counted repetition like a{1000000}) fails
        here, at submission, instead of mid-generation. The error, or ""."""
        probe = matcher.deep_copy()
        eos = set(self._eos)
        for step in range(PROBE_STEPS):
            bits = np.unpackbits(np.frombuffer(probe.compute_bitmask(), np.uint8), bitorder="little")
            if probe.is_error():
                return _error_of(probe)
            allowed = [t for t in np.flatnonzero(bits[:self.vocab_size]).tolist()[:len(eos) + 1] if t not in eos]
            if not allowed:  # only EOS (or nothing) may follow: the walk is over
                # ... at the start: an empty grammar (`start: ""`), refused as an empty prompt is
                return "it matches only the empty output" if step == 0 else ""
            if not probe.consume_token(allowed[0]):
                return _error_of(probe)
        return ""

    # ---- many rows at once ----------------------------------------------------------------------------------------
    def fill_masks(self, rows: list[tuple[Constraint, int]], mask: np.ndarray) -> None:
        """Write each constraint's next-token bitmask into mask[row] (other rows untouched) with the executor that
        `fill_mode` names or that is being measured ("auto")."""
        forced = [(c, r) for c, r in rows if c.kind == "forced"]  # a choice branch's row: its own mask, no matcher
        if forced:
            for c, r in forced:
                c.fill(mask, r)
            rows = [(c, r) for c, r in rows if c.kind != "forced"]
        if rows:
            from llguidance.numpy import fill_next_token_bitmask_par

            mode = self.fill_mode
            timing = mode == "auto" and len(rows) >= AUTO_MIN_ROWS
            if mode == "auto":
                par, ser = self.fill_trials["parallel"], self.fill_trials["serial"]
                mode = "parallel" if len(par) <= len(ser) else "serial"
            t0 = time.perf_counter()
            fill_next_token_bitmask_par(self._executors[mode], [(c.matcher, r) for c, r in rows], mask)
            if timing:
                self._record_trial(mode, (time.perf_counter() - t0) / len(rows))

    def _record_trial(self, mode: str, seconds_per_row: float) -> None:
        self.fill_trials[mode].append(seconds_per_row)
        par, ser = self.fill_trials["parallel"], self.fill_trials["serial"]
        if min(len(par), len(ser)) < AUTO_TRIALS:
            return
        p, q = statistics.median(par), statistics.median(ser)
        self.fill_mode = "parallel" if p <= q else "serial"
        log.info("grammar masks: %s fill (median %.1f us/row) over %s (%.1f us/row), %d fills each", self.fill_mode,
                 1e6 * min(p, q), "serial" if p <= q else "parallel", 1e6 * max(p, q), AUTO_TRIALS)

    def advance(self, tokens: list[tuple[Constraint, int]]) -> list[bool]:
        """Feed each constraint its committed token (on the executor the fills use); False where the grammar rejected
        it."""
        if any(c.kind == "forced" for c, _ in tokens):  # choice branches (engine/choice.py) mixed with matchers
            matched = iter(self._advance_matchers([(c, t) for c, t in tokens if c.kind != "forced"]))
            return [c.advance(int(t)) if c.kind == "forced" else next(matched) for c, t in tokens]
        return self._advance_matchers(tokens)

    def _advance_matchers(self, tokens: list[tuple[Constraint, int]]) -> list[bool]:
        if not tokens:
            return []
        executor = self._executors["serial" if self.fill_mode == "serial" else "parallel"]
        return executor.consume_token_par([(c.matcher, int(t)) for c, t in tokens])


class Constraint:
    """One request's matcher: its state is the output committed so far (never the tokens still on the device)."""

    def __init__(self, kind: str, matcher):
        self.kind = kind
        self.matcher = matcher

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (EOS included)."""
        return self.matcher.is_stopped()

    @property
    def failed(self) -> bool:
        return self.matcher.is_error()

    def error(self) -> str:
        return _error_of(self.matcher)


def _error_of(matcher) -> str:
    return matcher.get_error().replace("<non-verbose/>", "").strip()


def _cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
