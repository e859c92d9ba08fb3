"""AsyncLLM: the engine loop in its own thread, driven by many concurrent asyncio callers (what a server uses).

Requests are validated in the caller's thread (bad input raises there, before anything is queued); the engine thread
owns every piece of engine state and hands outputs back to each caller's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from jphoton.api import LLM, Prompt
from jphoton.engine.engine import Output
from jphoton.params import SamplingParams

log = logging.getLogger("jphoton")


class AsyncLLM:
    def __init__(self, llm: LLM):
        self.llm = llm
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards request creation (id counter, seed rng) across caller threads
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jphoton-engine", daemon=True)
        self._thread.start()

    # ---- callers ---------------------------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: SamplingParams | None = None) -> tuple[int, asyncio.Queue]:
        """Validate and enqueue; returns (request id, queue of Outputs). Raises ValueError on bad input."""
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}")
        with self._lock:
            [seq] = self.llm._make_sequences([self.llm._prompt_ids(prompt)], params)
        outputs: asyncio.Queue = asyncio.Queue()
        self._sinks[seq.request_id] = (asyncio.get_running_loop(), outputs)
        self._commands.put(("add", seq))
        self._wake.set()
        return seq.request_id, outputs

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> AsyncIterator[Output]:
        """Stream Outputs (`.delta.text`, `.delta.token_ids`, `.delta.finish_reason`) for one request. Leaving the
        loop early (break, cancellation) aborts the request."""
        request_id, outputs = self.submit(prompt, params)
        finished = False
        try:
            while True:
                out = await outputs.get()
                if out is None:
                    raise RuntimeError(f"engine loop died: {self._error!r}")
                finished = out.delta.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: int) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict:
        return self.llm.stats()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ---- the engine thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.llm.engine
        try:
            while not self._stop:
                self._drain_commands(engine)
                if engine.has_work():
                    for out in engine.step():
                        self._deliver(out)
                else:
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
        except BaseException as e:  # a bug, not bad input: fail every waiting caller loudly rather than hang them
            log.exception("engine loop died")
            self._error = e
            for loop, sink in list(self._sinks.values()):
                loop.call_soon_threadsafe(sink.put_nowait, None)

    def _drain_commands(self, engine) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    engine.add(arg)
                except ValueError as e:
                    self._deliver(Output(arg, arg.finish("error", str(e))))
            elif kind == "abort":
                out = engine.abort(arg)
                if out is not None:
                    self._deliver(out)

    def _deliver(self, out: Output) -> None:
        sink = self._sinks.get(out.seq.request_id)
        if sink is None:
            return
        loop, outputs = sink
        if out.delta.finish_reason is not None:
            del self._sinks[out.seq.request_id]
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, out)
        except RuntimeError:  # the caller's loop is closed; nobody is listening
            pass
