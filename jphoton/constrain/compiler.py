"""Constrained decoding on the host: one llguidance matcher per request, token bitmasks for many rows at once.

llguidance (Rust, no Python dependencies) compiles a JSON schema, regex or Lark/GBNF grammar against the tokenizer in
about a millisecond and fills one int32 bitmask row (bit v of word v // 32 = token v allowed) per request in ~0.1 ms;
its executor fills and advances many rows in parallel threads with the GIL released. Plain Python otherwise: the
engine decides when masks are built and where they go.
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import time

import numpy as np

from jphoton.params import SamplingParams

log = logging.getLogger("jphoton.constrain.compiler")

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
# llguidance builds a grammar recursively on the calling thread's stack: a JSON schema of 3,000 chained $refs (210 KB)
# or a Lark grammar of 2,800 chained rules (60 KB) overflowed an 8 MiB stack and killed the process (SIGSEGV). Every
# matcher is built on a thread with this stack (virtual: pages are touched only as deep as a build goes); the deepest
# chains that fit max_constraint_bytes (3,600 $refs, 12,000 rules) build in 0.3-0.6 s on a 64 MiB one.
COMPILE_STACK_BYTES = 256 * 2**20
_stack_lock = threading.Lock()


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
        self.automata = None  # jphoton.constrain.automaton.AutomatonCache once the engine has device tables (`use_automata`)
        self._automata_states = 0

    def use_automata(self, table_states: int) -> None:
        """The engine keeps device automaton tables of this many states (0: none): regular constraints get an
        automaton (built on first use, jphoton/constrain/automaton.py)."""
        self._automata_states = table_states if self._tokenizer is not None else 0

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

    def warm(self) -> None:
        """Build one matcher now: llguidance's first matcher of a tokenizer builds its token tables, holding the GIL
        for ~250 ms (2-core CPU box), which in a server would stall every stream during the first constrained
        request. Nothing without llguidance or a tokenizer."""
        try:
            self._llguidance()
        except (ImportError, ValueError):
            return
        self._matcher("regex", "a")

    def compile(self, params: SamplingParams, wait_automaton: bool = False) -> Constraint | None:
        """Compile the request's constraint; a bad schema/regex/grammar is a ValueError here, at submission. A `choice`
        compiles to nothing: its options are scored as sequences (constrain/choice.py). wait_automaton: build the device
        automaton now if the constraint has one (by default the first request starts its build and is served by
        llguidance meanwhile)."""
        spec = params.constraint
        if spec is None or spec[0] == "choice":
            return None
        kind, value = spec
        key = (kind, value)
        if self._automata_states and self.automata is not None and not wait_automaton:
            # A constraint whose automaton is built was compiled and checked before: no llguidance work per request
            # (~1.5 ms of the engine thread's time for a JSON schema), unless the engine falls back to host masks.
            automaton = self.automata.built(key)
            if automaton is not None:
                constraint = Constraint(kind, None, functools.partial(self._matcher, kind, value))
                constraint.automaton_key, constraint.automaton = key, automaton
                return constraint
        grammar, matcher = self._matcher(kind, value, probe=True)
        constraint = Constraint(kind, matcher)
        if self._automata_states and kind in ("regex", "json_schema"):
            llg = self._llguidance()
            constraint.automaton_key = key
            constraint.automaton = self._automaton(kind, value, wait_automaton, functools.partial(
                on_compile_stack, functools.partial(llg.LLMatcher, self._lltok, grammar, log_level=0,
                                                    limits=self._limits)))
        return constraint

    def _matcher(self, kind: str, value: str, probe: bool = False):
        """(grammar, matcher) of a constraint; ValueError if it is invalid or (probe) cannot be served."""
        llg = self._llguidance()
        if kind == "json_schema":
            _check_integers(value)
        try:
            if kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(value)
            elif kind == "grammar":
                grammar = llg.grammar_from("grammar", value)  # Lark as is, GBNF converted to Lark
            else:
                raise AssertionError("choice is scored by the engine (constrain/choice.py), not compiled")
        except ValueError as e:  # llguidance's messages may quote the whole input: keep the start
            raise ValueError(f"invalid {kind}: {_cut(str(e))}") from None
        except RecursionError:
            raise ValueError(f"invalid {kind}: nested too deeply") from None
        matcher, error = on_compile_stack(functools.partial(self._build, grammar, probe))
        if matcher.is_error():
            raise ValueError(f"invalid {kind}: {_cut(_error_of(matcher))}")
        if error:
            raise ValueError(f"{kind} cannot be served: {_cut(error)}")
        return grammar, matcher

    def _build(self, grammar: str, probe: bool):
        """(matcher, the probe's error or "") of an llguidance grammar (on the compile stack: `on_compile_stack`)."""
        matcher = self._llguidance().LLMatcher(self._lltok, grammar, log_level=0, limits=self._limits)
        return matcher, self._probe(matcher) if probe and not matcher.is_error() else ""

    def _automaton(self, kind: str, value: str, wait: bool, oracle):
        """The constraint's device automaton if it is built (the first request with a constraint starts the build on a
        background thread and is served by llguidance meanwhile), else None."""
        from jphoton.constrain import automaton as A

        if self.automata is None:
            tokens = A.token_bytes(self._tokenizer)
            if tokens is None:
                log.info("device automata: this tokenizer's vocabulary format is not understood; llguidance only")
                self._automata_states = 0
                return None
            self.automata = A.AutomatonCache(A.AutomatonVocab(tokens, self.vocab_size, tuple(self._eos)),
                                             max_states=self._automata_states - 1)
        if kind == "json_schema":
            from jphoton.constrain.json_regex import schema_to_regex

            regex = schema_to_regex(value)
            if regex is None:
                return None
        else:
            regex = value
        return self.automata.get((kind, value), regex, oracle, wait=wait)

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
        if not tokens:
            return []
        executor = self._executors["serial" if self.fill_mode == "serial" else "parallel"]
        return executor.consume_token_par([(c.matcher, int(t)) for c, t in tokens])


class Constraint:
    """One request's matcher: its state is the output committed so far (never the tokens still on the device)."""

    def __init__(self, kind: str, matcher, make_matcher=None):
        self.kind = kind
        self._matcher = matcher
        self._make_matcher = make_matcher  # (grammar, matcher) on first use, when `matcher` is None
        # A regular constraint's device automaton (jphoton/constrain/automaton.py), if built; `device` once the engine placed it
        # in its tables: the row then samples on the device and the matcher is not used.
        self.automaton = None
        self.automaton_key = None
        self.device = None  # jphoton.constrain.automaton.AutomatonState

    @property
    def matcher(self):
        """The llguidance matcher (made on first use for a request that came with a built device automaton: only if
        the engine serves it from host masks after all)."""
        if self._matcher is None:
            self._matcher = self._make_matcher()[1]
        return self._matcher

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (EOS included)."""
        return self.matcher.is_stopped()

    @property
    def failed(self) -> bool:
        return self.device is None and self.matcher.is_error()  # (a device row is checked by its automaton)

    def error(self) -> str:
        return _error_of(self.matcher)


def on_compile_stack(fn):
    """fn() on a new thread whose stack is COMPILE_STACK_BYTES (llguidance's grammar builds recurse as deep as the
    grammar nests); waits for it and returns its result or raises its exception. (llguidance releases the GIL while
    it builds.)"""
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller
            box["error"] = e

    with _stack_lock:  # (the size applies to every thread started while it is set)
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="jphoton-compile", daemon=True)
            thread.start()
        except RuntimeError:  # no room for such a stack (a strict overcommit policy): build on this thread
            log.warning("cannot start a thread with a %d MiB stack: grammars are built on the caller's stack",
                        COMPILE_STACK_BYTES >> 20)
            thread = None
        finally:
            threading.stack_size(old)
    if thread is None:
        run()
    else:
        thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _check_integers(schema: str) -> None:
    """ValueError for an integer outside the signed 64-bit range but for its lowest value, anywhere in a JSON schema:
    llguidance 1.9.1 crashes the process on {"enum": [-9223372036854775808]}."""
    import json

    try:
        doc = json.loads(schema)
    except ValueError:
        return  # (llguidance reports a malformed schema)
    todo = [doc]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            todo += v.values()
        elif isinstance(v, list):
            todo += v
        elif isinstance(v, int) and not isinstance(v, bool) and not -2**63 < v < 2**63:
            raise ValueError(f"invalid json_schema: integer {v} is outside (-2^63, 2^63)")


def _error_of(matcher) -> str:
    return matcher.get_error().replace("<non-verbose/>", "").strip()


def _cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
