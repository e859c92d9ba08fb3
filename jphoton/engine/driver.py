"""The engine loop, one for every entry point: `LLM` ticks it in the caller's thread, `AsyncLLM` on its engine thread,
the server's engine process behind its pipes (jphoton/server/engine_loop.py). Same admission, same tick, same idle
work, so a request takes the same path to its first token whichever way it came.

A pass of the driving thread: requests that arrived are prepared (validated, tokenized, constraint compiled, image
decoded and cropped) inline when quick (`quick_to_prepare`, up to INLINE_BUDGET_S of the pass), else on worker threads
(`Preparer`) whose results are admitted at the next pass; aborts are applied; adapters read on threads are installed
(one that finds every slot taken while one drains is retried each pass for LORA_WAIT_S); then one engine tick, whose
outputs go to `deliver`. An idle pass runs one compiled program's first execution (`LLM.run_programs_once`), which no
request then pays.
Invariant: only the driving thread calls the driver's methods (other threads reach it through their entry point's
queue or pipe, and wake it); a request is known by the caller's key, mapped to its engine request id here.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from jphoton.engine.images import ImageInput
from jphoton.engine.loras import NoFreeLoraSlot
from jphoton.params import SamplingParams
from jphoton.sequence import RequestOutput

log = logging.getLogger("jphoton")

PREPARE_THREADS = 2  # requests prepared at once (each may tokenize a long prompt or compile a grammar)
INLINE_BUDGET_S = 0.001  # of a pass, for preparing quick requests in the driving thread itself
INLINE_MAX_CHARS = 2048  # a text prompt up to this long is tokenized in ~0.2 ms (2-core CPU box, 540 chars: 0.16)
LORA_WAIT_S = 60.0  # a LoRA load waits this long for a draining slot (as LLM.load_lora's default timeout)


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """A chat as a prompt for `Driver.add` (the template is applied when the request is prepared)."""

    messages: list


@dataclasses.dataclass(frozen=True)
class SkillPrompt:
    """An image skill as a prompt for `Driver.add`: `LLM.prepare_skill(skill, image, text)` when it is prepared
    (skill "query": text is the question; "caption": text is the length). image: what `LLM.query` takes, or an
    ImageInput already decoded and cropped (the server's frontends do that), or None (a text-only query)."""

    skill: str
    image: object
    text: str


def prepare(llm, prompt, params: SamplingParams | None, request_id: int | None = None):
    """`llm.prepare_request` for any prompt the driver takes (ChatPrompt and SkillPrompt included)."""
    if isinstance(prompt, SkillPrompt):
        return llm.prepare_skill(prompt.skill, prompt.image, prompt.text, params, request_id=request_id)
    if isinstance(prompt, ChatPrompt):
        prompt = {"prompt_token_ids": llm.encode_chat(prompt.messages)}
    return llm.prepare_request(prompt, params, request_id=request_id)


def quick_to_prepare(prompt, params: SamplingParams | None) -> bool:
    """A request whose preparation is bounded and short: token ids or a short text, no constraint to compile, no chat
    template. The driving thread prepares these itself, in the pass they arrive, rather than on a worker thread whose
    result waits for the next pass (~1 step of TTFT)."""
    if isinstance(params, SamplingParams) and params.constraint is not None:  # (SpatialParams: none)
        return False
    if isinstance(prompt, SkillPrompt):  # an image still to decode and crop (10-50 ms) never is
        return (prompt.image is None or isinstance(prompt.image, ImageInput)) and quick_to_prepare(prompt.text, None)
    if isinstance(prompt, str):
        return len(prompt) <= INLINE_MAX_CHARS
    if isinstance(prompt, dict):  # {"prompt_token_ids": [...]}: checked, never tokenized
        ids = prompt.get("prompt_token_ids")
        return hasattr(ids, "__len__") and len(ids) <= INLINE_MAX_CHARS * 4
    return False


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


class Preparer:
    """Runs request preparation on PREPARE_THREADS worker threads. `submit(key, fn)`; the owner collects finished ones
    with `take()`: (key, fn's result or its ValueError, cancelled?) in completion order. `on_done` (from a worker
    thread) tells the owner that something is ready. Thread-safe."""

    def __init__(self, on_done: Callable[[], None] | None = None, workers: int = PREPARE_THREADS):
        self._workers = workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # (made at the first submit, again after a
        # shutdown: an LLM outlives the loops that drive it)
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: dict[Any, bool] = {}  # key -> cancelled
        self.on_done = on_done

    def submit(self, key, fn: Callable[[], Any]) -> None:
        with self._lock:
            self._pending[key] = False
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self._workers, thread_name_prefix="jphoton-prepare")
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

    def has_done(self) -> bool:
        """Something is ready to `take` (no lock: a tick asks every time)."""
        return not self._done.empty()

    def cancel_where(self, which: Callable[[Any], bool]) -> None:
        with self._lock:
            for key in self._pending:
                if which(key):
                    self._pending[key] = True

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
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _work(self, key, fn) -> None:
        self._done.put((key, run_preparation(fn)))
        if self.on_done is not None:
            self.on_done()


class Driver:
    """One LLM's engine loop: its state and passes (see the module docstring). `LLM.step()` is one `tick`; the entry
    point that drives the loop from a thread of its own (AsyncLLM, the server's engine process) `attach`es to it:
    deliver(key, output): an output of a request added through the driver (others reach their callers by `LLM.route`);
    reject(key, message): a request refused when it was prepared or admitted (nothing was queued);
    answer(key, ok, result): a LoRA load's outcome (the adapter's listing, or the exception);
    wake(): called from worker threads when something is ready for the next pass."""

    def __init__(self, llm):
        self.llm = llm
        self.deliver: Callable[[Any, RequestOutput], None] = lambda key, out: None
        self.reject: Callable[[Any, str], None] = lambda key, message: None
        self.answer: Callable[[Any, bool, Any], None] | None = None
        self.wake: Callable[[], None] = lambda: None
        self.preparer = Preparer(on_done=lambda: self.wake())
        self.key_of: dict[int, Any] = {}  # engine request id -> the caller's key
        self.engine_id: dict[Any, int] = {}
        self.inline_until = 0.0
        self.programs_left = True  # compiled programs not yet run once
        # LoRA loads: read on threads (lora_reading: keys), installed between ticks (lora_pending: [key, name, adapter,
        # deadline once a draining slot was found])
        self._lora_read: queue.SimpleQueue = queue.SimpleQueue()
        self.lora_reading: set = set()
        self.lora_pending: list[list] = []

    def attach(self, deliver: Callable[[Any, RequestOutput], None], reject: Callable[[Any, str], None],
               answer: Callable[[Any, bool, Any], None] | None = None, wake: Callable[[], None] | None = None) -> None:
        """The thread that drives the loop from now on takes the outputs, refusals and LoRA answers."""
        self.deliver, self.reject, self.answer = deliver, reject, answer
        self.wake = wake or (lambda: None)

    # ---- what arrives ------------------------------------------------------------------------------------------------
    def begin_pass(self) -> None:
        """A pass starts: quick requests that arrive in it are prepared inline, up to INLINE_BUDGET_S."""
        self.inline_until = time.perf_counter() + INLINE_BUDGET_S

    def add(self, key, prompt, params: SamplingParams | None, request_id: int | None = None) -> None:
        work = functools.partial(prepare, self.llm, prompt, params, request_id)
        if quick_to_prepare(prompt, params) and time.perf_counter() < self.inline_until:
            self._admit(key, run_preparation(work), False)
        else:
            self.preparer.submit(key, work)

    def abort(self, key) -> None:
        """End a request (finish_reason "abort"), prepared or still being prepared; unknown keys are ignored."""
        eid = self.engine_id.get(key)
        if eid is None:
            self.preparer.cancel(key)
            return
        out = self.llm.abort(eid)
        if out is not None:
            self._output(out)

    def abort_where(self, which: Callable[[Any], bool]) -> None:
        """Abort every request whose key `which` accepts, admitted or still being prepared."""
        self.preparer.cancel_where(which)
        for eid, key in list(self.key_of.items()):
            if which(key):
                out = self.llm.abort(eid)
                if out is not None:
                    self._output(out)

    def load_lora(self, key, name: str, path: str, allowed_dirs=None) -> None:
        """Read an adapter on a thread (no file outside allowed_dirs is opened: LLM.read_lora); install it between
        ticks; answer(key, ...) when done."""
        dirs = {} if allowed_dirs is None else {"allowed_dirs": allowed_dirs}

        def read() -> None:
            try:
                result = self.llm.read_lora(path, **dirs)
            except BaseException as e:  # noqa: BLE001 - answered as this load's error
                result = e
            self._lora_read.put((key, name, result))
            self.wake()

        self.lora_reading.add(key)
        threading.Thread(target=read, name="jphoton-lora-read", daemon=True).start()

    # ---- a pass ------------------------------------------------------------------------------------------------------
    def tick(self) -> list[RequestOutput]:
        """Admit what is prepared, install adapters read, then one engine tick (`Engine.step`); its outputs, each
        also given to `route` (the LLM's per-request queues) and to `deliver`. The caller holds the engine lock."""
        if self.preparer.has_done():
            for key, seq, cancelled in self.preparer.take():
                self._admit(key, seq, cancelled)
        if self.lora_reading or self.lora_pending:
            self._install_loras()
        outputs = self.llm.engine.step()
        route = self.llm.route
        for out in outputs:
            route(out)
        if self.key_of:  # (an LLM stepped by its callers alone has none: nothing more per output)
            for out in outputs:
                self._output(out)
        return outputs

    def idle(self) -> bool:
        """Idle work: one compiled program's first run, when nothing is running, prepared or read. True if it ran."""
        if not self.programs_left or self.preparer.pending() or self.lora_reading:
            return False
        ran = self.llm.run_programs_once(limit=1)
        self.programs_left = bool(ran) or not self.llm.warmup.all_ready
        if not self.programs_left and self.llm.stats()["programs_run_once"]:
            log.info("every program has run once (%d)", self.llm.stats()["programs_run_once"])
        return bool(ran)

    def busy(self) -> bool:
        """Work for the next pass: requests in the engine, being prepared, or adapters being read or installed."""
        return bool(self.llm.has_unfinished_requests() or self.preparer.pending() or self.lora_reading
                    or self.lora_pending)

    def close(self, reason: str = "the engine is shutting down") -> None:
        """No more passes: adapters still being loaded fail with `reason`; the preparation threads stop."""
        self.preparer.shutdown()
        for key in [*self.lora_reading, *(p[0] for p in self.lora_pending)]:
            self._answer(key, False, RuntimeError(reason))
        self.lora_reading.clear()
        self.lora_pending = []

    # ---- internals ---------------------------------------------------------------------------------------------------
    def _admit(self, key, seq, cancelled: bool) -> None:
        """Add a prepared request (seq: its Sequence, or the ValueError that refuses it)."""
        if isinstance(seq, ValueError):
            self.reject(key, str(seq))
        elif cancelled:
            self.deliver(key, seq.output(seq.finish("abort")))
        else:
            try:
                self.llm.add_request(seq)
            except ValueError as e:  # checked when prepared, no longer true (its LoRA adapter was unloaded since)
                self.reject(key, str(e))
            else:
                self.key_of[seq.request_id], self.engine_id[key] = key, seq.request_id

    def _output(self, out: RequestOutput) -> None:
        key = self.key_of.get(out.request_id)
        if key is None:  # (a request added without the driver: LLM.add_request, generate from another thread)
            return
        if out.delta.finish_reason is not None:
            del self.key_of[out.request_id], self.engine_id[key]
        self.deliver(key, out)

    def _install_loras(self) -> None:
        """Install the adapters read so far, in the order they were read; those that find every slot taken and one
        draining stay pending (retried next pass) until LORA_WAIT_S pass."""
        while True:
            try:
                key, name, adapter = self._lora_read.get_nowait()
            except queue.Empty:
                break
            self.lora_reading.discard(key)
            if isinstance(adapter, BaseException):
                self._answer(key, False, adapter)
            else:
                self.lora_pending.append([key, name, adapter, None])
        pending, self.lora_pending = self.lora_pending, []
        for load in pending:
            key, name, adapter, deadline = load
            try:
                info = self.llm.install_lora(name, adapter)
            except NoFreeLoraSlot as e:
                if e.draining:
                    now = time.monotonic()
                    if deadline is None:
                        load[3] = deadline = now + LORA_WAIT_S
                    if now < deadline:
                        self.lora_pending.append(load)
                        continue
                    e = NoFreeLoraSlot(f"{e}; no slot freed in {LORA_WAIT_S:.0f} s", draining=True)
                self._answer(key, False, e)
            except Exception as e:  # noqa: BLE001 - a failed load fails that load only
                self._answer(key, False, e)
            else:
                self._answer(key, True, info)

    def _answer(self, key, ok: bool, result) -> None:
        if self.answer is not None:
            self.answer(key, ok, result)
