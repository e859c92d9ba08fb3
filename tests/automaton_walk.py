"""Device automata in tests (jphoton/constrain/automaton.py): walk one and an llguidance matcher of the same constraint side by
side (at every step their token masks and their "the output is complete" verdicts must agree); serve an LLM's
constraints from host masks only."""

from __future__ import annotations

import contextlib

import numpy as np


@contextlib.contextmanager
def host_masks(llm):
    """Serve constraints through llguidance's host masks only (as an engine with automaton_states=0 would)."""
    llm.grammar.use_automata(0)
    try:
        yield
    finally:
        llm.grammar.use_automata(llm.engine.runner.automaton_states)


def bits(words: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


def compare_walks(lltok, grammar, automaton, vocab_size: int, walks: int = 12, steps: int = 200, seed: int = 0,
                  short_bias: list[bytes | None] | None = None) -> int:
    """Random walks (uniform over the allowed tokens; with short_bias, the token list, half of the walks prefer one of
    the shortest allowed tokens, so that they reach the end). Asserts agreement; returns the steps compared."""
    import llguidance

    rng = np.random.default_rng(seed)
    W = automaton.mask.shape[1]
    eos = set(automaton.eos_ids)
    compared = 0
    for w in range(walks):
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        state = 0
        for _ in range(steps):
            expected = np.frombuffer(matcher.compute_bitmask(), np.int32)[:W]
            got = automaton.mask[state]
            compared += 1
            if not np.array_equal(expected, got):
                a, b = bits(expected, vocab_size), bits(got, vocab_size)
                raise AssertionError(f"walk {w}, step {compared}: llguidance only {np.flatnonzero(a & ~b)[:8]}, "
                                     f"automaton only {np.flatnonzero(b & ~a)[:8]}")
            allowed = np.flatnonzero(bits(got, vocab_size))
            non_eos = [t for t in allowed.tolist() if t not in eos]
            if not non_eos:
                break
            if short_bias is not None and w % 2:
                lengths = np.array([len(short_bias[t] or b"") for t in non_eos])
                token = int(rng.choice(np.asarray(non_eos)[lengths == lengths.min()]))
            else:
                token = int(rng.choice(non_eos))
            assert matcher.consume_token(token), (w, token)
            state = int(automaton.next_state[state, token])
            assert state >= 0
            assert matcher.is_stopped() == bool(automaton.only_eos[state]), (w, compared)
            if matcher.is_stopped():
                break
    return compared
