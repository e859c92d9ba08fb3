"""The engine process's side of jphoton/server/engine_process.py (whose docstring describes the transport): build the LLM,
tell every frontend it is ready, then run the loop that drains commands, steps the LLM and sends each frontend one
list of events per tick, until every frontend has sent "shutdown" or gone.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection as mp_connection
import multiprocessing.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from jphoton.async_llm import model_info, start_serving
from jphoton.engine.loras import NoFreeLoraSlot
from jphoton.image.skills import CropGeometry
from jphoton.sequence import RequestOutput

log = logging.getLogger("jphoton.server")

_STATS_EVERY_S = 0.25  # the child pushes a stats snapshot this often while busy (metrics scrapes read it)
# A frontend that has had no event for this long gets an empty one (a heartbeat), idle or not: silence for
# --tick-timeout seconds then means that the loop is stuck (EngineProcess's watchdog, in the frontend's process).
HEARTBEAT_S = 0.5

class LoraError(Exception):
    """A LoRA command that failed. kind: "invalid" (bad name, path or adapter), "no_slot" (every slot is taken),
    "off" (the engine has no LoRA slots), "unavailable" (the engine is stopping), "internal" (a bug)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def lora_error(llm, e: BaseException) -> LoraError:
    """What a LoRA call on `llm` raised, as a LoraError (the same kinds in the engine process and in-process)."""
    if isinstance(e, LoraError):
        return e
    if not llm.stats().get("lora_slots_total", 0):
        return LoraError("off", str(e))
    if isinstance(e, NoFreeLoraSlot):
        return LoraError("no_slot", str(e))
    if isinstance(e, (ValueError, OSError)):
        return LoraError("invalid", str(e))
    log.error("LoRA command failed", exc_info=e)
    return LoraError("internal", f"{type(e).__name__}: {e}")


def request_limits(llm) -> dict:
    """What the gRPC frontend checks a request against before it parses the request in full (jphoton/server/service.py
    RequestBounds): LLM.text_limits() (max_prompt_bytes, bytes_per_token, max_model_len) and EngineConfig.limits; and
    "image_geometry", the CropGeometry a frontend prepares images with (None: the model takes no images); "region_bins"
    (the point / detect answers' bins; None: no spatial skills)."""
    vision = llm.model.vision
    spatial = vision is not None and getattr(llm.model, "spatial", None) is not None
    return {**llm.text_limits(), **dataclasses.asdict(llm.engine_config.limits),
            "image_geometry": None if vision is None else CropGeometry.of(vision),
            "region_bins": vision.region_bins if spatial else None}


def _stop_building(signum, frame) -> None:
    """SIGTERM while the LLM is being built (the server stops before it served): leave quietly, with what a normal
    exit runs for multiprocessing (else the resource tracker warns of a leaked semaphore)."""
    multiprocessing.util._exit_function()
    os._exit(0)


def child_main(build: Callable[[], Any], links: list[tuple[Any, Any]], levels: tuple[int, int]) -> None:
    """links: (commands, events) connection pair per frontend."""
    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole process group: the server drains us
    signal.signal(signal.SIGTERM, _stop_building)  # the server stopped while we load (EngineProcess.shutdown)
    # force: an import during unpickling may have configured the root logger already (records lost their marker)
    logging.basicConfig(level=levels[0], format="%(levelname)s %(name)s (engine process): %(message)s", force=True)
    logging.getLogger("jphoton").setLevel(levels[1])
    try:
        llm = build()
    except BaseException as e:  # noqa: BLE001 - report any failure to the parent, which re-raises it
        try:
            pickle.dumps(e)
        except Exception:  # noqa: BLE001
            e = RuntimeError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        for _, events in links:
            _send_quietly(events, pickle.dumps(("failed", e)))
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    ready = pickle.dumps(("ready", (model_info(llm), llm.stats(), request_limits(llm), os.getpid())))
    for _, events in links:
        _send_quietly(events, ready)
    try:
        EngineLoop(llm, links).run()
    except BaseException as e:  # a bug, not bad input: the server fails every open stream with INTERNAL
        logging.getLogger("jphoton").exception("engine loop died")
        for _, events in links:
            _send_quietly(events, pickle.dumps([("fatal", f"engine loop died: {e!r}")]))
        raise
    # Served and drained: leave now. A normal exit would first wait for the background warm-up thread to compile the
    # shapes it has left (minutes on a GPU), and the server would kill us after its timeout. The flush gets a second:
    # stdout may be a pipe nobody reads any more (benchmarks/serving.py's server child: the flush blocked for good).
    flusher = threading.Thread(target=_flush_std, daemon=True)
    flusher.start()
    flusher.join(1.0)
    # What a normal exit runs for multiprocessing: a semaphore made here (tqdm's lock, created at its import) is
    # otherwise left registered, and the resource tracker warns of a "leaked semaphore" when the server exits.
    multiprocessing.util._exit_function()
    os._exit(0)


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _send_quietly(conn, data: bytes) -> bool:
    """Send to a frontend that may be gone (its process died, or it closed its ends); False if it is."""
    try:
        conn.send_bytes(data)
        return True
    except (OSError, ValueError):
        return False


def _flush_std() -> None:
    for stream in (sys.stderr, sys.stdout):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


class EngineLoop:
    """The child's loop: drain each frontend's commands into the LLM's driver (engine/driver.py), tick it, send each
    frontend one list of events per pass. Requests are known by the server's ids (id % n: the frontend's)."""

    def __init__(self, llm, links: list[tuple[Any, Any]]):
        self.llm = llm
        self.commands = [c for c, _ in links]
        self.events = [e for _, e in links]
        self.n = len(links)  # frontend of an id (request or nonce): id % n
        self.open = set(range(self.n))  # frontends that have not sent "shutdown" nor gone
        self.named: dict[str, int] = {}  # client request id -> server id (several frontends: Abort may come via another)
        self.name_of: dict[int, str] = {}
        self.stopping = False
        self.out: list[list] = [[] for _ in links]
        self.sent_at = [0.0] * self.n  # when each frontend was last sent something (HEARTBEAT_S)
        self.stats_at = 0.0
        # A thread that finishes work for the loop (a request prepared, an adapter read) writes a byte here: an idle
        # loop waits on the pipes and this, and takes the work at once (it polled every 5 ms: +5 ms to a TTFT).
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        start_serving(llm)

    def run(self) -> None:
        with self.llm.driving(self._output, self._reject, self._lora_answer, self._wake) as driver:
            self._run(driver)

    def _run(self, driver) -> None:
        llm = self.llm
        while True:
            busy = llm.has_unfinished_requests()
            # Block on the pipes only when there is nothing to step (a command or finished preparation wakes us); an
            # adapter waiting for a draining slot is retried soon; idle, one program's first run comes first.
            timeout = 0 if busy or self.stopping else 0.005 if driver.lora_pending else 0.5
            if timeout == 0.5 and driver.idle():
                timeout = 0
            if timeout == 0:  # (a poll costs a few us a pipe; a wait over several, a selector's setup)
                ready = [i for i in sorted(self.open) if self.commands[i].poll(0)]
            else:
                conns = [self.commands[i] for i in self.open]
                woke = mp_connection.wait([*conns, self.wake_fd], timeout)
                ready = sorted(self.commands.index(c) for c in woke if c is not self.wake_fd)
                if self.wake_fd in woke:
                    _drain_pipe(self.wake_fd)
            driver.begin_pass()
            for i in ready:
                self._drain(i, driver)
            llm.step()  # (admits what is prepared, installs adapters read; on an idle engine, nothing more)
            if llm.has_unfinished_requests():
                now = time.monotonic()
                if now - self.stats_at > _STATS_EVERY_S:
                    self.stats_at = now
                    self._broadcast(("stats", -1, llm.stats()))
            elif busy:  # just went idle: an exact snapshot (pages all back)
                self._broadcast(("stats", -1, llm.stats()))
            self._flush()
            if self.stopping and not driver.busy():
                log.info("engine loop done (%s)", llm.stats())
                driver.close()
                self._flush()
                return

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:  # full: the loop has wake-ups pending already
            pass

    def _flush(self) -> None:
        """Send each frontend its events of this pass; one that has had nothing for HEARTBEAT_S gets an empty list."""
        now = time.monotonic()
        for i, out in enumerate(self.out):
            if out or (i in self.open and now - self.sent_at[i] >= HEARTBEAT_S):
                _send_quietly(self.events[i], pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
                self.out[i] = []
                self.sent_at[i] = now

    def _broadcast(self, event: tuple) -> None:
        for i in self.open:
            self.out[i].append(event)

    def _close(self, i: int, why: str, driver) -> None:
        """Frontend i sent "shutdown" or is gone: abort its requests; stop once no frontend is left."""
        self.open.discard(i)
        driver.abort_where(lambda rid: rid % self.n == i)
        self.stopping = not self.open
        log.info("frontend %d %s; %s", i, why, "stopping" if self.stopping else f"{len(self.open)} frontends left")

    def _drain(self, i: int, driver) -> None:
        llm = self.llm
        commands = self.commands[i]
        while i in self.open and commands.poll(0):
            try:
                cmd = pickle.loads(commands.recv_bytes())
            except (EOFError, OSError):  # the frontend is gone
                self._close(i, "is gone", driver)
                return
            kind = cmd[0]
            if kind == "add":
                _, rid, prompt, params, name = cmd
                if name is not None:
                    self.named[name], self.name_of[rid] = rid, name
                driver.add(rid, prompt, params)
            elif kind == "abort":
                driver.abort(cmd[1])
            elif kind == "abort_named":
                rid = self.named.get(cmd[2])
                self.out[cmd[1] % self.n].append(("aborted", cmd[1], rid is not None))
                if rid is not None:
                    driver.abort(rid)
            elif kind == "stats":
                self.out[cmd[1] % self.n].append(("stats", cmd[1], llm.stats()))
            elif kind == "lora_load":
                if self.stopping:
                    self._lora_answer(cmd[1], False, RuntimeError("the engine is shutting down"))
                else:
                    driver.load_lora(*cmd[1:])
            elif kind == "lora_unload":
                self._lora_answer(cmd[1], True, llm.unload_lora(cmd[2]))
            elif kind == "lora_list":
                self._lora_answer(cmd[1], True, llm.list_loras())
            elif kind == "shutdown":
                self._close(i, "sent shutdown", driver)

    def _reject(self, rid: int, message: str) -> None:
        self.out[rid % self.n].append(("reject", rid, message))
        self._forget_name(rid)

    def _lora_answer(self, nonce: int, ok: bool, result) -> None:
        if not ok and isinstance(result, BaseException):
            err = (LoraError("unavailable", str(result)) if isinstance(result, RuntimeError) and self.stopping
                   else lora_error(self.llm, result))
            result = (err.kind, str(err))
        self.out[nonce % self.n].append(("lora", nonce, ok, result))
        self._broadcast(("stats", -1, self.llm.stats()))  # slot use changed: metrics see it now, not at the next tick

    def _output(self, rid: int | None, o: RequestOutput) -> None:
        if rid is None:  # (a request not from a frontend)
            return
        d = o.delta
        if d.finish_reason is not None:
            self._forget_name(rid)
        if rid % self.n not in self.open:
            return
        self.out[rid % self.n].append(("out", rid, d.token_ids, d.text, d.finish_reason, o.logprobs, o.prompt_tokens,
                                       o.completion_tokens, o.error, o.choice))

    def _forget_name(self, rid: int) -> None:
        name = self.name_of.pop(rid, None)
        if name is not None and self.named.get(name) == rid:
            del self.named[name]


def exit_with_parent() -> None:
    """Exit when the process that started this one dies, however it dies (the engine process must not keep holding the
    GPU; a frontend must not keep the port). Not PR_SET_PDEATHSIG: that fires when the *thread* that spawned us exits
    (the server starts the engine process from a loader thread)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="jphoton-parent-watch", daemon=True).start()
