"""AsyncLLM: the engine loop in its own thread, driven by many concurrent asyncio callers (what a server uses).

Requests are prepared (validated, tokenized, their constraint compiled: `LLM.prepare_request`) on a few worker threads
(`Preparer`), never on the caller's event loop nor in the engine thread: a huge prompt or grammar delays only itself.
Bad input comes back as the request's first output, `Rejected` (`generate` raises it as ValueError); nothing is
queued. The engine thread owns the LLM's engine state, drives it through `add_request` / `step` / `abort`, and hands
outputs back to each caller's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import jax

from jphoton.api import LLM, Prompt
from jphoton.params import SamplingParams
from jphoton.sequence import RequestOutput

log = logging.getLogger("jphoton")

PREPARE_THREADS = 2  # requests prepared at once (each may tokenize a long prompt or compile a grammar)


@dataclasses.dataclass(frozen=True)
class Rejected:
    """The first (and only) item on a request's output queue when preparing it failed (bad input): nothing was queued."""

    message: str


class Preparer:
    """Runs request preparation on PREPARE_THREADS worker threads. `submit(key, fn)`; the owner collects finished ones
    with `take()`: (key, fn's result or its ValueError, cancelled?) in completion order. `on_done` (from a worker
    thread) tells the owner that something is ready. Thread-safe."""

    def __init__(self, on_done: Callable[[], None] | None = None, workers: int = PREPARE_THREADS):
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jphoton-prepare")
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: dict[Any, bool] = {}  # key -> cancelled
        self.on_done = on_done

    def submit(self, key, fn: Callable[[], Any]) -> None:
        with self._lock:
            self._pending[key] = False
        self._pool.submit(self._work, key, fn)

    def cancel(self, key) -> bool:
        """Mark a request still being prepared as cancelled (take() reports it so); False if it is not pending."""
        with self._lock:
            if key not in self._pending:
                return False
            self._pending[key] = True
            return True

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def take(self) -> list[tuple[Any, Any, bool]]:
        out = []
        while True:
            try:
                key, result = self._done.get_nowait()
            except queue.Empty:
                return out
            with self._lock:
                cancelled = self._pending.pop(key)
            out.append((key, result, cancelled))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _work(self, key, fn) -> None:
        self._done.put((key, run_preparation(fn)))
        if self.on_done is not None:
            self.on_done()


def run_preparation(fn: Callable[[], Any]):
    """fn's result, or the ValueError that says why the request cannot be served (a bug becomes one too: it fails this
    request, not the server)."""
    try:
        return fn()
    except ValueError as e:
        return e
    except Exception as e:  # noqa: BLE001
        log.exception("preparing a request failed")
        return ValueError(f"cannot prepare the request: {type(e).__name__}: {e}")


INLINE_MAX_CHARS = 2048  # a text prompt up to this long is tokenized in ~0.2 ms (2-core CPU box, 540 chars: 0.16)


def quick_to_prepare(prompt, params: SamplingParams | None) -> bool:
    """A request whose preparation is bounded and short: token ids or a short text, no constraint to compile, no chat
    template. An engine loop prepares these itself, in the tick they arrive, rather than on a worker thread whose
    result waits for the next tick (~1 step of TTFT)."""
    if params is not None and params.constraint is not None:
        return False
    if isinstance(prompt, str):
        return len(prompt) <= INLINE_MAX_CHARS
    if isinstance(prompt, dict):  # {"prompt_token_ids": [...]}: checked, never tokenized
        ids = prompt.get("prompt_token_ids")
        return hasattr(ids, "__len__") and len(ids) <= INLINE_MAX_CHARS * 4
    return False


class AsyncLLM:
    def __init__(self, llm: LLM):
        self.llm = llm
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._error: BaseException | None = None
        self.ticked_at = time.monotonic()  # the engine thread's last pass (idle passes included: every 50 ms)
        self._preparer = Preparer(on_done=self._wake.set)
        start_serving(llm, warm_grammar=False)  # (warmed on the engine thread: this runs on the caller's event loop)
        self._text_limits = llm.text_limits()
        self._thread = threading.Thread(target=self._run, name="jphoton-engine", daemon=True)
        self._thread.start()

    # ---- callers ---------------------------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: SamplingParams | None = None) -> tuple[int, asyncio.Queue]:
        """Enqueue for preparation; returns (request id, queue of RequestOutputs) at once. Bad input arrives on the
        queue as one `Rejected`."""
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}")
        rid = self.llm.new_request_id()
        outputs: asyncio.Queue = asyncio.Queue()
        self._sinks[rid] = (asyncio.get_running_loop(), outputs)
        llm = self.llm
        self._preparer.submit(rid, lambda: prepare(llm, prompt, params, rid))
        return rid, outputs

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
                if isinstance(out, Rejected):
                    finished = True
                    raise ValueError(out.message)
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
        """The prompt `submit` takes for a chat (the template is applied when the request is prepared)."""
        return ChatPrompt(messages)

    @property
    def info(self) -> dict:
        return model_info(self.llm)

    @property
    def error(self) -> str | None:
        """Why the engine thread is gone (None while it runs)."""
        return None if self._error is None else f"engine loop died: {self._error!r}"

    @property
    def text_limits(self) -> dict:
        """LLM.text_limits(): the server refuses oversized text before it is prepared."""
        return self._text_limits

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._preparer.shutdown()

    # ---- the engine thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        llm = self.llm
        llm._driver = threading.get_ident()  # from now on only this thread may step the LLM (LLM._check_driver)
        llm._wake_driver = self._wake.set  # generate() from other threads adds requests and waits for our ticks
        try:
            llm.grammar.warm()  # here, not in __init__: that runs on the server's event loop, which answers health checks
            while not self._stop:
                self.ticked_at = time.monotonic()
                with llm._engine_lock:
                    self._add_prepared()
                    self._drain_commands()
                    busy = llm.has_unfinished_requests()
                    if busy:
                        for out in llm.step():
                            self._deliver(out)
                if not busy:
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
        except BaseException as e:  # a bug, not bad input: fail every waiting caller loudly rather than hang them
            log.exception("engine loop died")
            self._error = e
            for loop, sink in list(self._sinks.values()):
                loop.call_soon_threadsafe(sink.put_nowait, None)
        finally:
            llm._driver = None
            llm._wake_driver = None

    def _add_prepared(self) -> None:
        for rid, seq, cancelled in self._preparer.take():
            if isinstance(seq, ValueError):
                self._reject(rid, str(seq))
            elif cancelled:
                self._deliver(seq.output(seq.finish("abort")))
            else:
                try:
                    self.llm.add_request(seq)
                except ValueError as e:  # checked when prepared, no longer true (its LoRA adapter was unloaded since)
                    self._reject(rid, str(e))

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort" and not self._preparer.cancel(arg):
                out = self.llm.abort(arg)
                if out is not None:
                    self._deliver(out)

    def _reject(self, rid: int, message: str) -> None:
        sink = self._sinks.pop(rid, None)
        if sink is not None:
            loop, outputs = sink
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, Rejected(message))
            except RuntimeError:
                pass

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


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """A chat as a prompt for `AsyncLLM.submit` / the engine process: the template is applied when it is prepared."""

    messages: list


def start_serving(llm: LLM, warm_grammar: bool = True) -> None:
    """Set up a process to serve `llm` (the servers, AsyncLLM) so that no one-off piece of work holds the GIL, and with
    it the engine thread and every stream, for long: long prompts are tokenized in a helper process
    (jphoton/text/tokenizer.py, HELPER_MIN_CHARS: seconds), and llguidance's first matcher, which builds its token tables
    (~250 ms on the 2-core CPU box), is built now rather than in the first constrained request. (LLM() has already
    frozen its start-up objects out of garbage collection: EngineConfig.freeze_gc.)"""
    if hasattr(llm.tokenizer, "use_helper_process"):
        llm.tokenizer.use_helper_process()
    if warm_grammar:
        llm.grammar.warm()


def prepare(llm: LLM, prompt, params: SamplingParams | None, request_id: int | None = None):
    """`llm.prepare_request` for any prompt `submit` takes (ChatPrompt included)."""
    if isinstance(prompt, ChatPrompt):
        prompt = {"prompt_token_ids": llm.encode_chat(prompt.messages)}
    return llm.prepare_request(prompt, params, request_id=request_id)


def model_info(llm: LLM) -> dict:
    """What the server's GetModelInfo reports about `llm`."""
    leaves = jax.tree_util.tree_leaves(llm.model.params)
    return {"name": llm.model.name or llm.config.name, "architecture": llm.config.architecture,
            "vocab_size": llm.config.vocab_size, "max_context": llm.max_model_len,
            "dtype": leaves[0].dtype.name if leaves else ""}
