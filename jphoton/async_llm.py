"""AsyncLLM: the engine loop in its own thread, driven by many concurrent asyncio callers (what a server uses).

Requests are validated in the caller's thread (`LLM.prepare_request`: bad input raises there, before anything is
queued); the engine thread owns the LLM's engine state, drives it through `add_request` / `step` / `abort`, and hands
outputs back to each caller's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

import jax

from jphoton.api import LLM, Prompt
from jphoton.params import SamplingParams
from jphoton.sequence import RequestOutput

log = logging.getLogger("jphoton")


class AsyncLLM:
    def __init__(self, llm: LLM):
        self.llm = llm
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jphoton-engine", daemon=True)
        self._thread.start()

    # ---- callers ---------------------------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: SamplingParams | None = None) -> tuple[int, asyncio.Queue]:
        """Validate and enqueue; returns (request id, queue of RequestOutputs). Raises ValueError on bad input."""
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}")
        seq = self.llm.prepare_request(prompt, params)
        outputs: asyncio.Queue = asyncio.Queue()
        self._sinks[seq.request_id] = (asyncio.get_running_loop(), outputs)
        self._commands.put(("add", seq))
        self._wake.set()
        return seq.request_id, outputs

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs (`.delta.text`, `.delta.token_ids`, `.delta.finish_reason`) for one request. Leaving the
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

    async def fresh_stats(self) -> dict:
        return self.llm.stats()

    def has_unfinished_requests(self) -> bool:
        return self.llm.has_unfinished_requests()

    def chat_prompt(self, messages: list[dict]) -> dict:
        """The prompt `submit` takes for a chat (the chat template applied). Raises ValueError without a tokenizer."""
        return {"prompt_token_ids": self.llm.encode_chat(messages)}

    @property
    def info(self) -> dict:
        return model_info(self.llm)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ---- the engine thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        llm = self.llm
        llm._driver = threading.get_ident()  # from now on only this thread may step the LLM (LLM._check_driver)
        try:
            while not self._stop:
                self._drain_commands()
                if llm.has_unfinished_requests():
                    for out in llm.step():
                        self._deliver(out)
                else:
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
        except BaseException as e:  # a bug, not bad input: fail every waiting caller loudly rather than hang them
            log.exception("engine loop died")
            self._error = e
            for loop, sink in list(self._sinks.values()):
                loop.call_soon_threadsafe(sink.put_nowait, None)
        finally:
            llm._driver = None

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.llm.add_request(arg)
                except ValueError as e:
                    self._deliver(arg.output(arg.finish("error", str(e))))
            elif kind == "abort":
                out = self.llm.abort(arg)
                if out is not None:
                    self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return
        loop, outputs = sink
        if out.delta.finish_reason is not None:
            del self._sinks[out.request_id]
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, out)
        except RuntimeError:  # the caller's loop is closed; nobody is listening
            pass


def model_info(llm: LLM) -> dict:
    """What the server's GetModelInfo reports about `llm`."""
    leaves = jax.tree_util.tree_leaves(llm.model.params)
    return {"name": llm.model.name or llm.config.name, "architecture": llm.config.architecture,
            "vocab_size": llm.config.vocab_size, "max_context": llm.max_model_len,
            "dtype": leaves[0].dtype.name if leaves else ""}
