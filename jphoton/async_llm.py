"""AsyncLLM: the engine loop (engine/driver.py) on a thread of its own, driven by many concurrent asyncio callers.

`submit` hands a request to the engine thread at once; the driver prepares it (validated, tokenized, its constraint
compiled: `LLM.prepare_request`; an image skill's image decoded and cropped: `LLM.prepare_skill`) inline when quick,
else on worker threads, never on the caller's event loop: a huge prompt, grammar or image delays only itself. Bad
input comes back as the request's first output, `Rejected` (`generate`, `query`, `caption` raise it as ValueError);
nothing is queued. Outputs go back to each caller's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

import jax

from jphoton.api import LLM, Prompt
from jphoton.engine.driver import ChatPrompt, SkillPrompt
from jphoton.image import spatial
from jphoton.params import SamplingParams, SpatialParams
from jphoton.sequence import RequestOutput

log = logging.getLogger("jphoton")


@dataclasses.dataclass(frozen=True)
class Rejected:
    """The first (and only) item on a request's output queue when preparing it failed (bad input): nothing was queued."""

    message: str


class AsyncLLM:
    def __init__(self, llm: LLM):
        self.llm = llm
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._error: BaseException | None = None
        self.ticked_at = time.monotonic()  # the engine thread's last pass (idle passes included: every 50 ms)
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
        self._commands.put(("add", rid, prompt, params))
        self._wake.set()
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

    def query(self, image, question: str, params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """`generate` for a question about an image (what `LLM.query` takes; None: a text-only query); the image is
        decoded and cropped on a preparation thread. Bad input (an image that does not decode, a model that takes no
        images) raises ValueError at the first iteration; nothing is queued. params default as LLM.query's."""
        return self.generate(SkillPrompt("query", image, question), params)

    def caption(self, image, length: str = "normal", params: SamplingParams | None = None
                ) -> AsyncIterator[RequestOutput]:
        """`generate` for a caption of an image: length "short", "normal" or "long" (as `query`)."""
        return self.generate(SkillPrompt("caption", image, length), params)

    async def point(self, image, obj: str, max_objects: int = spatial.DEFAULT_MAX_OBJECTS) -> list[tuple[float, ...]]:
        """`LLM.point`: where obj is in the image, a list of (x, y) in [0, 1]; ValueError for bad input (at submission)
        or a failed request."""
        return await self._spatial("point", image, obj, max_objects)

    async def detect(self, image, obj: str, max_objects: int = spatial.DEFAULT_MAX_OBJECTS) -> list[tuple[float, ...]]:
        """`LLM.detect`: boxes (x_min, y_min, x_max, y_max) in [0, 1] around obj in the image."""
        return await self._spatial("detect", image, obj, max_objects)

    async def _spatial(self, skill: str, image, obj: str, max_objects: int) -> list[tuple[float, ...]]:
        ids = []
        async for out in self.generate(SkillPrompt(skill, image, obj), SpatialParams(max_objects)):
            ids += out.delta.token_ids
            if out.delta.finish_reason == "error":
                raise ValueError(out.error)
        return spatial.answer_of(skill, ids, max_objects).normalized(*self.llm.model.vision.region_bins)

    def abort(self, request_id: int) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict:
        return self.llm.stats()

    async def fresh_stats(self) -> dict:
        return self.llm.stats()

    def has_unfinished_requests(self) -> bool:
        return self.llm.has_unfinished_requests()

    def chat_prompt(self, messages: list[dict]) -> ChatPrompt:
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

    # ---- the engine thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        llm = self.llm
        try:
            with llm.driving(self._deliver, self._reject, wake=self._wake.set) as driver:
                llm.grammar.warm()  # here, not in __init__: that runs on the server's event loop (health checks)
                while not self._stop:
                    self.ticked_at = time.monotonic()
                    with llm._engine_lock:
                        driver.begin_pass()
                        self._drain_commands(driver)
                        llm.step()  # (admits what is prepared; on an idle engine, nothing more)
                        busy = llm.has_unfinished_requests()
                    if not busy and not driver.idle():
                        self._wake.wait(timeout=0.05)
                        self._wake.clear()
                self._land_zombies()
        except BaseException as e:  # a bug, not bad input: fail every waiting caller loudly rather than hang them
            log.exception("engine loop died")
            self._error = e
            for loop, sink in list(self._sinks.values()):
                loop.call_soon_threadsafe(sink.put_nowait, None)

    def _land_zombies(self) -> None:
        """At shutdown: commit the steps still in flight when every request in them has finished (zombies), so that
        their pages come back now; live requests are left to whoever drives the LLM next."""
        llm = self.llm
        for _ in range(4):  # (at most pipeline depth steps are in flight)
            with llm._engine_lock:
                if not llm.engine.has_work() or not all(s.finalized for s in llm.engine.sequences.values()):
                    return
                llm.step()

    def _drain_commands(self, driver) -> None:
        while True:
            try:
                kind, *args = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                rid, prompt, params = args
                driver.add(rid, prompt, params, request_id=rid)
            elif kind == "abort":
                driver.abort(args[0])

    def _reject(self, rid: int, message: str) -> None:
        sink = self._sinks.pop(rid, None)
        if sink is not None:
            loop, outputs = sink
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, Rejected(message))
            except RuntimeError:
                pass

    def _deliver(self, key, out: RequestOutput) -> None:
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


def model_info(llm: LLM) -> dict:
    """What the server's GetModelInfo reports about `llm`."""
    leaves = jax.tree_util.tree_leaves(llm.model.params)
    return {"name": llm.model.name or llm.config.name, "architecture": llm.config.architecture,
            "vocab_size": llm.config.vocab_size, "max_context": llm.max_model_len,
            "dtype": leaves[0].dtype.name if leaves else ""}
