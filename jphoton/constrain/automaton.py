"""Grammar automata for the device: a regular constraint as a token-level DFA whose tables live on the GPU, so that a
constrained row samples inside the step like a free row (no host mask, no deferred sampler). Plain Python and numpy.

outlines-core compiles a regex (or a JSON schema turned into one by `jphoton.constrain.json_regex`) into a
`TokenAutomaton`: per state, the bitmask of allowed tokens (llguidance's layout: bit v % 32 of word v // 32) and each
allowed token's next state. Invariant: for the constraints routed here it accepts the same token sequences as
llguidance, the reference and the path for everything else (tests/test_automaton.py), so a request's tokens do not
depend on the path. `AutomatonPool` places automata in the device tables (row 0 the free state), by reference count,
evicting the least recently used idle ones. Design and numbers: docs/constrained.md; docs/decisions.md, "Constrained decoding".
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

import numpy as np

log = logging.getLogger("jphoton.constrain.compiler")

FREE_STATE = 0  # the device tables' row for rows without an automaton: every token allowed, every token goes back to 0


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character a byte-level BPE vocabulary writes for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_bytes(tokenizer) -> list[bytes | None] | None:
    """The bytes each token id stands for (None: a special token, never allowed by a constraint), or None if the
    tokenizer's vocabulary format is not understood (byte-level BPE and SentencePiece with byte fallback are)."""
    import json

    spec = json.loads(tokenizer.hf_json())
    tok = tokenizer._tok
    vocab = tok.get_vocab(with_added_tokens=True)
    special = tokenizer.special_token_ids()
    out: list[bytes | None] = [None] * (max(vocab.values(), default=-1) + 1)
    decoder = json.dumps(spec.get("decoder") or {})
    if "ByteLevel" in decoder:
        u2b = _bytes_to_unicode()
        for s, i in vocab.items():
            if i in special:
                continue
            try:
                out[i] = bytes(u2b[c] for c in s)
            except KeyError:  # an added, non-special token written as plain text
                out[i] = s.encode("utf-8")
        return out
    if "ByteFallback" in decoder or spec.get("model", {}).get("byte_fallback"):
        for s, i in vocab.items():
            if i in special:
                continue
            if len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
                out[i] = bytes([int(s[3:5], 16)])
            else:
                out[i] = s.replace("\u2581", " ").encode("utf-8")
        return out
    return None


class AutomatonVocab:
    """One tokenizer's vocabulary as outlines-core takes it: token bytes -> ids (EOS apart)."""

    def __init__(self, tokens: list[bytes | None], vocab_size: int, eos_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.eos_ids = tuple(e for e in eos_ids if 0 <= e < vocab_size)
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(tokens[:vocab_size]):
            if b and i not in self.eos_ids:
                by_bytes.setdefault(b, []).append(i)
        # outlines-core wants one EOS id: it allows it in final states (we allow every EOS id there, below)
        self.eos = self.eos_ids[0] if self.eos_ids else vocab_size
        self.by_bytes = by_bytes


# outlines-core builds a regex's DFA without a size limit, and some small regexes have exponentially many states
# ((a|b)*a(a|b){20}): the index is built in a child process with a memory and a time limit, so such a constraint costs
# a failed build (it stays on llguidance), never the serving process.
INDEX_MEMORY_BYTES = 4 * 2**30
# A build is a CPU core taken from serving for its whole run (on the 2-core CPU box a 60 s limit let one 16-byte regex,
# (a|b)*a(a|b){20}, take a core for 60 s; (abc|def){1,3000} takes 7.5 s). Builds that serve (<= automaton_states
# states) take 0.05-1.5 s there.
INDEX_TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 60.0  # the child's start-up (imports), not counted in INDEX_TIMEOUT_S
# A regex longer than this many bytes per table state is not built at all (logged): its automaton would not fit the
# tables anyway (a JSON schema's regex has about one state a byte: 378 bytes, 362 states), and outlines-core takes
# ~0.35 ms a byte over it (a 20,000-value enum: 269 KB of regex, 9 s of a core).
MAX_REGEX_BYTES_PER_STATE = 8


@dataclasses.dataclass
class RegexIndex:
    """outlines-core's index of a regex over the vocabulary, as flat arrays: state `states[i]` has the transitions
    `tokens[offsets[i]:offsets[i + 1]]` -> `targets[...]`. Arrays, not outlines-core's dict of dicts, cross the pipe
    from the child process: unpickling 2.1M dict entries (a 5-field JSON schema on a 49k vocabulary) held the
    serving process's GIL for 265 ms, a stall of every stream; the arrays take a few ms."""

    initial: int
    states: np.ndarray  # [S] int64, the index's state ids
    offsets: np.ndarray  # [S + 1]
    tokens: np.ndarray  # [E] int32
    targets: np.ndarray  # [E] uint32 (outlines-core's state ids are u32)
    finals: np.ndarray  # [F] int64

    def __post_init__(self):
        self._row = {int(s): i for i, s in enumerate(self.states)}

    def edges(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, next states) out of `state`."""
        i = self._row.get(state)
        if i is None:
            return self.tokens[:0], self.targets[:0]
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.tokens[a:b], self.targets[a:b]


def regex_index(regex: str, vocab: AutomatonVocab, memory_bytes: int = INDEX_MEMORY_BYTES,
                timeout_s: float = INDEX_TIMEOUT_S) -> RegexIndex | str:
    """outlines-core's index of the regex, built in a child process (limited to `memory_bytes` and `timeout_s`: some
    regexes explode), or why not (a string)."""
    import os
    import pickle
    import selectors
    import subprocess
    import sys

    payload = pickle.dumps((regex, vocab.eos, vocab.by_bytes, memory_bytes))
    child = subprocess.Popen([sys.executable, "-m", "jphoton.constrain.automaton"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # The limit is the build's: the child's start-up (Python, numpy, outlines-core: 0.3 s idle, seconds on a busy
        # box) ends with one byte on stdout, and only then does the clock start.
        with selectors.DefaultSelector() as sel:
            sel.register(child.stdout, selectors.EVENT_READ)
            started = sel.select(STARTUP_TIMEOUT_S) and os.read(child.stdout.fileno(), 1) == b"R"
        if not started:
            child.kill()
            _, err = child.communicate()
            return f"index build failed (the child did not start: {err.decode(errors='replace').strip()[-200:]})"
        out, err = child.communicate(payload, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return f"index build over {timeout_s:.0f} s"
    if child.returncode != 0 or not out:
        return f"index build failed ({err.decode(errors='replace').strip()[-200:] or child.returncode})"
    return RegexIndex(*pickle.loads(out))


def _index_child() -> None:
    """The child process of `regex_index`: reads (regex, eos, vocabulary, memory limit), writes the index as
    `RegexIndex`'s fields."""
    import itertools
    import pickle
    import resource
    import sys

    from outlines_core import Index, Vocabulary

    sys.stdout.buffer.write(b"R")  # started: the parent's time limit runs from here
    sys.stdout.buffer.flush()
    regex, eos, by_bytes, memory_bytes = pickle.load(sys.stdin.buffer)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    try:
        index = Index(regex, Vocabulary(eos, by_bytes))
        table = index.get_transitions()
        counts = np.fromiter(map(len, table.values()), np.int64, len(table))
        total = int(counts.sum())
        fields = (index.get_initial_state(), np.fromiter(table.keys(), np.int64, len(table)),
                  np.concatenate([[0], np.cumsum(counts)]),
                  np.fromiter(itertools.chain.from_iterable(e.keys() for e in table.values()), np.int32, total),
                  np.fromiter(itertools.chain.from_iterable(e.values() for e in table.values()), np.uint32, total),
                  np.fromiter(index.get_final_states(), np.int64))
    except BaseException as e:  # noqa: BLE001 -- Rust errors (and MemoryError) are reported, not raised
        sys.exit(f"{type(e).__name__}: {str(e)[:200]}")
    pickle.dump(fields, sys.stdout.buffer, protocol=pickle.HIGHEST_PROTOCOL)


@dataclasses.dataclass
class TokenAutomaton:
    """A token-level DFA; state 0 is the initial state. next_state[s, v]: the state after token v (-1: not allowed;
    EOS loops on an accepting state); mask[s]: allowed tokens as int32 bit words; only_eos[s]: nothing but EOS can
    follow (the output is complete)."""

    next_state: np.ndarray  # [S, V] int16 (the device tables' type; at most 32,767 states)
    mask: np.ndarray  # [S, W] int32
    only_eos: np.ndarray  # [S] bool
    eos_ids: tuple[int, ...]
    build_s: float = 0.0

    def __post_init__(self):
        self.done_states = frozenset(np.flatnonzero(self.only_eos).tolist())

    @property
    def num_states(self) -> int:
        return self.next_state.shape[0]

    @classmethod
    def build(cls, regex: str, vocab: AutomatonVocab, max_states: int, oracle) -> TokenAutomaton | None:
        """The automaton of a constraint, or None (it then stays on llguidance): more than max_states states, a regex
        outlines-core cannot build, or a mask that its index cannot follow.

        `regex` (its language: the constraint's) gives the states and the next state of each token; `oracle()` (a
        fresh llguidance matcher of the constraint itself) gives the masks: state by state, breadth first, the matcher
        walked to the state by one token path computes the state's mask. So the automaton allows exactly what the host
        path allows, llguidance's own choices included (where the next bytes are forced it allows only the canonical
        tokens, e.g. "ay" after "m" in "maybe", not "a"). A token llguidance allows that the index has no transition
        for (outlines-core drops some, e.g. " " from an accepting state into an optional group) means no automaton."""
        t0 = time.perf_counter()
        index = regex_index(regex, vocab)
        if isinstance(index, str):
            log.info("no device automaton for this constraint: %s", index)
            return None
        start = index.initial
        V, eos = vocab.vocab_size, np.asarray(vocab.eos_ids, np.int64)
        W = (V + 31) // 32
        number = {start: 0}
        queue = collections.deque([(start, oracle())])
        rows_next, rows_mask, only_eos = [], [], []
        while queue:
            state, matcher = queue.popleft()
            words = np.frombuffer(matcher.compute_bitmask(), np.int32)[:W].copy()
            allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:V])
            to_index = np.full(V, -1, np.int64)
            edge_tokens, edge_targets = index.edges(state)
            to_index[edge_tokens] = edge_targets
            tokens = allowed[~np.isin(allowed, eos)]
            targets = to_index[tokens]
            if (targets < 0).any():
                log.info("no device automaton for this constraint: llguidance allows token %d where the regex index "
                         "has no transition", int(tokens[targets < 0][0]))
                return None
            row = np.full(V, -1, np.int16)
            for target, first in zip(*np.unique(targets, return_index=True), strict=True):
                if int(target) not in number:
                    if len(number) >= max_states:
                        log.info("no device automaton for this constraint: more than %d states", max_states)
                        return None
                    number[int(target)] = len(number)
                    child = matcher.deep_copy()
                    child.consume_token(int(tokens[first]))
                    queue.append((int(target), child))
            if len(tokens):
                row[tokens] = _renumber(targets, number)
            row[allowed[np.isin(allowed, eos)]] = number[state]  # EOS where the output may end (loops there)
            rows_next.append(row)
            rows_mask.append(words)
            only_eos.append(not len(tokens))
        return cls(np.stack(rows_next), np.stack(rows_mask), np.array(only_eos), tuple(int(e) for e in eos),
                   time.perf_counter() - t0)


def _renumber(targets: np.ndarray, number: dict[int, int]) -> np.ndarray:
    keys, inverse = np.unique(targets, return_inverse=True)
    return np.asarray([number[int(k)] for k in keys], np.int16)[inverse]


class AutomatonState:
    """One request's position in its automaton (host side, advanced at each commit)."""

    def __init__(self, automaton: TokenAutomaton, placement: Placement):
        self.automaton = automaton
        self.placement = placement
        self.state = 0  # local state after the committed tokens
        self.error_text = ""
        self._next = automaton.next_state.item  # (the commit calls advance for every row of every step)
        self._vocab = automaton.next_state.shape[1]

    def advance(self, token: int) -> bool:
        """Feed the committed token; False if the automaton does not allow it (`error_text` says so)."""
        nxt = self._next(self.state, token) if 0 <= token < self._vocab else -1
        if nxt < 0:
            self.error_text = f"token {token} is not allowed in automaton state {self.state}"
            return False
        self.state = nxt
        return True

    def done_after(self, token: int) -> bool:
        """The output is complete once `token` is committed: it was EOS, or only EOS may follow."""
        return token in self.automaton.eos_ids or self.automaton.done_states.__contains__(self.state)

    @property
    def global_state(self) -> int:
        return self.placement.offset + self.state


@dataclasses.dataclass
class Placement:
    """Where an automaton's states sit in the device tables (rows offset .. offset + num_states - 1)."""

    key: object
    offset: int
    num_states: int
    refs: int = 0
    written: bool = False  # the runner wrote its rows (set by the engine)


class AutomatonPool:
    """Rows of the device tables, handed out to automata; row 0 is the free state. Idle placements (no request uses
    them) stay, for the next request with the same constraint, until their rows are needed (least recently used first).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._placed: collections.OrderedDict[object, Placement] = collections.OrderedDict()

    def place(self, key, num_states: int) -> Placement | None:
        """The automaton's placement (existing or new; its refs + 1), or None if it cannot fit even after evicting every
        idle one."""
        p = self._placed.get(key)
        if p is None:
            offset = self._find(num_states)
            while offset is None:
                idle = next((k for k, q in self._placed.items() if q.refs == 0), None)
                if idle is None:
                    return None
                del self._placed[idle]
                offset = self._find(num_states)
            p = self._placed[key] = Placement(key, offset, num_states)
        self._placed.move_to_end(key)
        p.refs += 1
        return p

    def release(self, p: Placement) -> None:
        p.refs -= 1

    def _find(self, n: int) -> int | None:
        """First gap of n rows (row 0 is the free state's)."""
        spans = sorted((p.offset, p.offset + p.num_states) for p in self._placed.values())
        at = 1
        for a, b in spans:
            if a - at >= n:
                return at
            at = max(at, b)
        return at if self.capacity - at >= n else None

    @property
    def states_used(self) -> int:
        return sum(p.num_states for p in self._placed.values())


class AutomatonCache:
    """Automata by constraint, built on a background thread: the first request with a constraint is served by
    llguidance while its automaton builds (outlines-core takes ~0.05-0.5 s), later ones by the device tables."""

    def __init__(self, vocab: AutomatonVocab, max_states: int):
        self.vocab = vocab
        self.max_states = max_states
        self.max_cached_states = 4 * max_states  # host memory: 2 bytes x vocabulary a state
        self._built: collections.OrderedDict[object, TokenAutomaton | None] = collections.OrderedDict()
        self._building: dict[object, threading.Event] = {}
        self._lock = threading.Lock()
        self.builds = 0
        self.max_regex_bytes = MAX_REGEX_BYTES_PER_STATE * max_states
        self._background: threading.Thread | None = None  # the one build running in the background, if any

    def built(self, key) -> TokenAutomaton | None:
        """The automaton if it is built (None: not asked for yet, building, or none)."""
        with self._lock:
            return self._built.get(key)

    def get(self, key, regex: str, oracle, wait: bool = False) -> TokenAutomaton | None:
        """The automaton if built (None while it builds, or if it cannot be built: that constraint stays on
        llguidance). wait: until it is built (in this thread, unless another is building it). One build runs in the
        background at a time (each takes a CPU core): while one does, another constraint's build is not started (a
        later request with it tries again). A regex over `max_regex_bytes` is never built (logged once)."""
        with self._lock:
            if key in self._built:
                self._built.move_to_end(key)
                return self._built[key]
            if len(regex) > self.max_regex_bytes:
                log.info("no device automaton for this constraint: its regex is %d bytes, over %d (%d a table "
                         "state); served by llguidance", len(regex), self.max_regex_bytes, MAX_REGEX_BYTES_PER_STATE)
                self._built[key] = None
                return None
            done = self._building.get(key)
            start = done is None
            if start and not wait and self._background is not None and self._background.is_alive():
                return None  # (another constraint's build is running)
            if start:
                done = self._building[key] = threading.Event()
                if not wait:
                    self._background = threading.Thread(target=self._build, args=(key, regex, oracle, done),
                                                        daemon=True, name="jphoton-automaton")
        if start and wait:
            self._build(key, regex, oracle, done)
        elif start:
            self._background.start()
        if not wait:
            return None
        done.wait()
        with self._lock:
            return self._built.get(key)

    def _build(self, key, regex: str, oracle, done: threading.Event) -> None:
        try:
            automaton = TokenAutomaton.build(regex, self.vocab, self.max_states, oracle)
        except Exception:  # noqa: BLE001 -- logged; the constraint stays on llguidance
            log.exception("device automaton build failed")
            automaton = None
        if automaton is not None:
            log.info("device automaton built: %d states in %.2f s", automaton.num_states, automaton.build_s)
        with self._lock:
            del self._building[key]
            self._built[key] = automaton
            self.builds += 1
            while sum(a.num_states for a in self._built.values() if a) > self.max_cached_states:
                self._built.popitem(last=False)  # (requests holding it keep their copy)
        done.set()


if __name__ == "__main__":
    _index_child()
