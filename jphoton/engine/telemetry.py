"""Per-step host timestamps: when a step was planned, dispatched, and committed (and how long the commit waited for
the device). Kept in a bounded ring, exportable as a JSON timeline and plotted by benchmarks/plot_timeline.py."""

from __future__ import annotations

import collections
import dataclasses
import json
import time


@dataclasses.dataclass
class StepRecord:
    step_id: int
    kind: str  # "decode" | "prefill" | "mixed"
    rows: int
    tokens: int
    steps: int = 1  # decode steps the launch ran (a K-step decode launch: K)
    t_plan: float = 0.0  # planning starts
    t_planned: float = 0.0  # planned and packed (a step planned ahead waits for its launch after this)
    t_launch: float = 0.0  # dispatch starts
    t_packed: float = 0.0  # the packed input array is built
    t_put: float = 0.0  # its host->device copy is enqueued
    t_dispatched: float = 0.0  # the jitted step call returned
    t_launched: float = 0.0  # dispatch returned (the device may still be busy with earlier steps)
    t_commit: float = 0.0  # commit starts: waiting for this step's host copy
    t_ready: float = 0.0  # host copy landed (the device finished this step no later than this)
    t_advanced: float = 0.0  # grammar matchers fed the step's tokens
    t_committed: float = 0.0  # tokens appended, deltas built, stops checked
    constrained_rows: int = 0  # rows sampled under a grammar mask (the step samples at finalize)
    automaton_rows: int = 0  # grammar rows with a device automaton (sampled in the step unless constrained_rows)
    t_finalize: float = 0.0  # finalize starts (after the previous step's commit): masks are filled
    t_masked: float = 0.0  # masks filled
    t_finalized: float = 0.0  # masked sampler dispatched (with the next step's input), host copy started


class Telemetry:
    def __init__(self, capacity: int = 100_000):
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=capacity)
        self.enabled = True

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def add(self, record: StepRecord) -> None:
        if self.enabled:
            self.records.append(record)

    def clear(self) -> None:
        self.records.clear()

    def timeline(self) -> list[dict]:
        return [dataclasses.asdict(r) for r in self.records]

    def export_json(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.timeline(), f)
