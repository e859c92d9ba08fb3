"""`--llm-args`: LLM keyword arguments on a benchmark's command line (no jax import: the serving load generator's
parent process uses it too)."""

from __future__ import annotations

import ast


def add_llm_args(ap) -> None:
    """The `--llm-args` option of the benchmarks that build the default engine (the CPU smoke tests narrow it)."""
    ap.add_argument("--llm-args", default="", help="LLM keyword arguments beside the defaults, k=v,k=v (python "
                    "literals); none by default: the point is the defaults")


def parse_llm_args(text: str) -> dict:
    """`--llm-args k=v,k=v` (values are python literals, e.g. `prefill_buckets=((1,16),)`) -> LLM keyword arguments."""
    out, depth, start = {}, 0, 0
    for i, ch in enumerate(text + ","):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            if kv := text[start:i].strip():
                k, v = kv.split("=", 1)
                out[k.strip()] = ast.literal_eval(v)
            start = i + 1
    return out
