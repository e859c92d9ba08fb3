"""Where the runner's device calls are made: inline, or in order on one dispatcher thread.

Why a thread: on the H100 host one dispatch of the 1B decode step costs the calling thread 0.4-0.8 ms, and a step
that consumes the outputs of an executable dispatched just before it (the step after a grammar step's masked sampler)
1.0-1.4 ms, waiting on that executable's launch (RESULTS.md, "What a dispatch costs the host"). The call releases the
GIL while it waits: the same probe ran ~1.6 ms of pure Python on the main thread beside such a call on a second thread
at full speed. So when the calls go to a dispatcher thread, the engine thread commits, plans and builds grammar masks
meanwhile, instead of waiting. Measured in the engine (constrained benchmark, same run): the 32-stream step period fell
10% (grammar 3.57 -> 3.22 ms, free 1.54 -> 1.37 ms), but 1 and 8 streams lost up to 12% (most likely the worker
waiting for the GIL to finish each call while the engine thread runs Python; not verified). Off by default.

Ordering: one worker runs the jobs first-in first-out, so device calls happen in the order the runner submitted them
(donated buffers and the carried step input depend on it). The runner waits for a job only where the host needs what it
produced (a slot's tokens at commit). Transfer guards are thread-local in JAX: each job runs under the guards that were
in force where it was submitted, so a loop policed for implicit transfers stays policed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable

import jax

_GUARDS = (("jax_transfer_guard_host_to_device", jax.transfer_guard_host_to_device),
           ("jax_transfer_guard_device_to_host", jax.transfer_guard_device_to_host),
           ("jax_transfer_guard_device_to_device", jax.transfer_guard_device_to_device))


class Dispatcher:
    def __init__(self, threaded: bool):
        self._pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jphoton-dispatch")
                      if threaded else None)
        self._last: concurrent.futures.Future | None = None

    def submit(self, job: Callable[[], None]) -> concurrent.futures.Future | None:
        """Run job (device calls) after every job submitted before it; inline when not threaded (returns None)."""
        if self._pool is None:
            job()
            return None
        guards = [(ctx, getattr(jax.config, name)) for name, ctx in _GUARDS]

        def guarded():
            with contextlib.ExitStack() as stack:
                for ctx, level in guards:
                    if level is not None:
                        stack.enter_context(ctx(level))
                job()

        self._last = self._pool.submit(guarded)
        return self._last

    @staticmethod
    def wait(job: concurrent.futures.Future | None) -> None:
        """Block until job has run; re-raises what it raised."""
        if job is not None:
            job.result()

    def drain(self) -> None:
        """Block until every submitted job has run."""
        self.wait(self._last)
