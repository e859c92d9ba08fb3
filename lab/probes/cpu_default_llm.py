"""Issue 22's CPU before/after, like for like: a fresh process builds the default `LLM()` (the embedded model) in
whatever tree is first on PYTHONPATH and generates one 16-token request; XLA compiles (backend compiles + persistent
cache hits, counted by jax.monitoring as lab/pytest_compile_count.py does) and seconds to the first token, and, where
the tree compiles in the background, until every shape is ready.

    PYTHONPATH=.ab/base .venv/bin/python lab/probes/cpu_default_llm.py
    PYTHONPATH=. .venv/bin/python lab/probes/cpu_default_llm.py
"""

from __future__ import annotations

import json
import time

T0 = time.perf_counter()
COUNT = [0]


def main() -> None:
    import jax

    def on_duration(event, duration, **kwargs):
        COUNT[0] += event == "/jax/core/compile/backend_compile_duration"

    def on_event(event, **kwargs):
        COUNT[0] += event == "/jax/compilation_cache/cache_hits"

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    import jphoton
    from jphoton import LLM, SamplingParams

    llm = LLM()
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    res = {"tree": jphoton.__file__, "first_request_s": time.perf_counter() - T0, "compiles_first_request": COUNT[0],
           "tokens": len(out[0].token_ids) if hasattr(out[0], "token_ids") else None}
    if hasattr(llm, "wait_until_ready"):
        llm.wait_until_ready()
    res.update(all_ready_s=time.perf_counter() - T0, compiles_all_ready=COUNT[0])
    print(json.dumps(res))


if __name__ == "__main__":
    main()
