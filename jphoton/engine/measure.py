"""Measurement hooks for probes and benchmarks (lab/, benchmarks/): clocks that wrap an engine's public calls
(`Runner.launch`, `Engine.add`, `Engine.step`) to timestamp what the telemetry (engine/telemetry.py) does not see:
whether the device had run dry when a step was launched, when requests arrived and finished, Python's GC passes.
Plain Python; a clock changes no behaviour, only adds a timestamp per call.
"""

from __future__ import annotations

import bisect
import gc
import time


class BubbleClock:
    """Whether the device had run out of work when the host launched a step: before each launch, is the step launched
    before it done on the device (its tokens `is_ready`), at the launch's start and at its end? Done at the start: the
    device idled for at least the whole launch (a host-bound tick); done only by the end: it may have idled for part of
    it. Neither: the step was queued behind a running one (a device-bound tick)."""

    def __init__(self, engine):
        self.marks: list[tuple[float, bool, bool]] = []  # (time at the launch's start, done then, done at its end)
        runner = engine.runner
        launch = runner.launch

        def timed_launch(step, defer_sampling=False):
            prev = runner.last_launched
            t = time.perf_counter()
            before = prev is not None and prev.tokens is not None and prev.tokens.is_ready()
            slot = launch(step, defer_sampling)
            after = before or (prev is not None and prev is not slot and prev.tokens is not None
                               and prev.tokens.is_ready())
            self.marks.append((t, before, after))
            return slot

        runner.launch = timed_launch

    def summary(self, lo: float, hi: float) -> dict:
        m = [(b, a) for t, b, a in self.marks if lo <= t <= hi]
        n = max(len(m), 1)
        return {"launches": len(m), "idle_at_launch_start": sum(b for b, _ in m) / n,
                "idle_by_launch_end": sum(a for _, a in m) / n}


class GcClock:
    """Python GC passes (gc.callbacks): count and ms by generation since the last `take`."""

    def __init__(self):

        self.t0, self.stats = 0.0, {}
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            n, ms = self.stats.get(info["generation"], (0, 0.0))
            self.stats[info["generation"]] = (n + 1, ms + 1e3 * (time.perf_counter() - self.t0))

    def take(self) -> dict:
        out, self.stats = {f"gen{g}": [n, round(ms, 2)] for g, (n, ms) in sorted(self.stats.items())}, {}
        return out


class EventClock:
    """When requests arrive (`Engine.add`) and finish (a finished output of `Engine.step`, timed at the tick's end),
    and when `Engine.step` runs: each launch-to-launch period is then tagged quiet / arrival / finish / both, and
    split into time inside and outside `step` (outside: the driver's own work, e.g. admitting the next request)."""

    def __init__(self, engine):
        self.arrivals: list[float] = []
        self.finishes: list[float] = []
        self.steps: list[tuple[float, float]] = []
        add, step = engine.add, engine.step

        def on_add(seq):
            self.arrivals.append(time.perf_counter())
            return add(seq)

        def on_step():
            t = time.perf_counter()
            outs = step()
            end = time.perf_counter()
            self.steps.append((t, end))
            if any(o.finished for o in outs):
                self.finishes.append(end)
            return outs

        engine.add, engine.step = on_add, on_step

    def tag(self, a: float, b: float) -> tuple[str, float]:
        """(tag, seconds outside `step`) of the period (a, b]."""
        arr = bisect.bisect_right(self.arrivals, b) > bisect.bisect_right(self.arrivals, a)
        fin = bisect.bisect_right(self.finishes, b) > bisect.bisect_right(self.finishes, a)
        inside = sum(max(0.0, min(e, b) - max(s, a)) for s, e in self.steps[bisect.bisect_left(self.steps, (a - 1,)):]
                     if s < b)
        return ("both" if arr and fin else "arrival" if arr else "finish" if fin else "quiet"), (b - a) - inside
