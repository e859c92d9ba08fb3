"""Issue 25's "free row not below 98dc4d0's in the same call": runs 98dc4d0's own benchmarks/constrained.py (put that
tree first on PYTHONPATH) with two shims: its `device_ms` stubbed out, since that helper crashes on that tree
(StopIteration in `device_step_ms`, the crash the issue reports) after the runs whose free row we want; and
llguidance.LLTokenizer given one EOS id where that tree passes a list (llguidance 1.6, the device's wheel, takes one;
main does the same, jphoton/constraints.py). Same arguments as that script.
`PYTHONPATH=.ab/base:/tmp/site python3 lab/issue25_base_free.py --streams 8 32 --out DIR`"""

from __future__ import annotations

import llguidance

import benchmarks.constrained as base  # the tree on PYTHONPATH

_LLTokenizer = llguidance.LLTokenizer


def _one_eos(hf_json, n_vocab=None, eos_token=None, **kw):
    if isinstance(eos_token, list | tuple):
        eos_token = eos_token[0] if eos_token else None
    return _LLTokenizer(hf_json, n_vocab=n_vocab, eos_token=eos_token, **kw)


llguidance.LLTokenizer = _one_eos
base.device_ms = lambda llm, rows, masked: float("nan")
base.main()
