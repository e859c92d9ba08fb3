"""pytest plugin: count XLA compiles (backend compiles + persistent-cache hits) over a whole test run, for issue 22's
before/after report. Independent of jphoton's own counter, so it works on any commit:
    PYTHONPATH=lab .venv/bin/python -m pytest -q -p pytest_compile_count
"""

import threading
import time

_count = 0
_lock = threading.Lock()
_t0 = time.perf_counter()


def _on_duration(event, duration, **kwargs):
    global _count
    if event == "/jax/core/compile/backend_compile_duration":
        with _lock:
            _count += 1


def _on_event(event, **kwargs):
    global _count
    if event == "/jax/compilation_cache/cache_hits":
        with _lock:
            _count += 1


def pytest_configure(config):
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


_per_file: dict = {}


def pytest_runtest_protocol(item, nextitem):
    before, t = _count, time.perf_counter()
    yield
    path = item.nodeid.split("::")[0]
    n, s = _per_file.get(path, (0, 0.0))
    _per_file[path] = (n + _count - before, s + time.perf_counter() - t)


pytest_runtest_protocol.hookwrapper = True


def pytest_terminal_summary(terminalreporter):
    for path, (n, s) in sorted(_per_file.items(), key=lambda kv: -kv[1][0]):
        terminalreporter.write_line(f"  {n:6d} compiles {s:7.1f} s  {path}")
    terminalreporter.write_line(f"XLA compiles in this run: {_count}; wall {time.perf_counter() - _t0:.0f} s")
