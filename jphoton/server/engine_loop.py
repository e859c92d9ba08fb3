"""The engine process's side of jphoton/server/engine_process.py (whose docstring describes the transport): build the LLM,
tell every frontend it is ready, then run the loop that drains commands, steps the LLM and sends each frontend one
list of events per tick, until every frontend has sent "shutdown" or gone.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import multiprocessing.connection as mp_connection
import multiprocessing.util
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from jphoton.async_llm import Preparer, model_info, prepare, quick_to_prepare, run_preparation, start_serving
from jphoton.engine.loras import NoFreeLoraSlot
from jphoton.sequence import RequestOutput

log = logging.getLogger("jphoton.server")

_STATS_EVERY_S = 0.25  # the child pushes a stats snapshot this often while busy (metrics scrapes read it)
INLINE_BUDGET_S = 0.001  # of a tick, for preparing quick requests in the engine loop itself
LORA_WAIT_S = 60.0  # a LoRA load waits this long for a draining slot (as LLM.load_lora's default timeout)
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
    RequestBounds): LLM.text_limits() (max_prompt_bytes, bytes_per_token, max_model_len) and EngineConfig.limits."""
    return {**llm.text_limits(), **dataclasses.asdict(llm.engine_config.limits)}


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
    """The child's loop: drain commands, step, send each frontend one list of events per tick."""

    def __init__(self, llm, links: list[tuple[Any, Any]]):
        self.llm = llm
        self.commands = [c for c, _ in links]
        self.events = [e for _, e in links]
        self.n = len(links)  # frontend of an id (request or nonce): id % n
        self.open = set(range(self.n))  # frontends that have not sent "shutdown" nor gone
        self.front_id: dict[int, int] = {}  # engine request id -> server id
        self.engine_id: dict[int, int] = {}  # server id -> engine request id
        self.named: dict[str, int] = {}  # client request id -> server id (several frontends: Abort may come via another)
        self.name_of: dict[int, str] = {}
        self.stopping = False
        self.out: list[list] = [[] for _ in links]
        self.sent_at = [0.0] * self.n  # when each frontend was last sent something (HEARTBEAT_S)
        self.stats_at = 0.0
        self.inline_until = 0.0
        self.programs_left = True  # compiled programs not yet run once (LLM.run_programs_once): run while idle
        # A thread that finishes work for the loop (a request prepared, an adapter read) writes a byte here: an idle
        # loop waits on the pipes and this, and takes the work at once (it polled every 5 ms: +5 ms to a TTFT).
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        # Requests are prepared (tokenized, constraint compiled) on worker threads: a huge prompt never stalls a tick.
        self.preparer = Preparer(on_done=self._wake)
        # LoRA loads: adapters are read on threads (lora_reading: nonces), installed between ticks (lora_pending:
        # [nonce, name, adapter, deadline once a draining slot was found]).
        self.lora_read: queue.SimpleQueue = queue.SimpleQueue()
        self.lora_reading: set[int] = set()
        self.lora_pending: list[list] = []
        start_serving(llm)

    def run(self) -> None:
        llm = self.llm
        while True:
            busy = llm.has_unfinished_requests()
            # Block on the pipes only when there is nothing to step (a command or finished preparation wakes us); an
            # adapter waiting for a draining slot is retried soon.
            timeout = 0 if busy or self.stopping else 0.005 if self.lora_pending else 0.5
            # idle, nothing being prepared or read: one program's first run, then look at the pipes
            if timeout == 0.5 and self.programs_left and not (self.preparer.pending() or self.lora_reading):
                ran = llm.run_programs_once(limit=1)
                self.programs_left = bool(ran) or not llm.warmup.all_ready
                if ran:
                    timeout = 0
                elif not self.programs_left and llm.stats()["programs_run_once"]:
                    log.info("every program has run once (%d)", llm.stats()["programs_run_once"])
            if timeout == 0:  # (a poll costs a few us a pipe; a wait over several, a selector's setup)
                ready = [i for i in sorted(self.open) if self.commands[i].poll(0)]
            else:
                conns = [self.commands[i] for i in self.open]
                woke = mp_connection.wait([*conns, self.wake_fd], timeout)
                ready = sorted(self.commands.index(c) for c in woke if c is not self.wake_fd)
                if self.wake_fd in woke:
                    _drain_pipe(self.wake_fd)
            # Quick requests are prepared here, in the tick they arrive, up to INLINE_BUDGET_S of it (a burst of
            # arrivals goes on to the worker threads); the rest wait a tick for their worker.
            self.inline_until = time.perf_counter() + INLINE_BUDGET_S
            for i in ready:
                self._drain(i)
            self._add_prepared()
            if self.lora_reading or self.lora_pending:
                self._install_loras()
            if llm.has_unfinished_requests():
                for o in llm.step():
                    self._output(o)
                now = time.monotonic()
                if now - self.stats_at > _STATS_EVERY_S:
                    self.stats_at = now
                    self._broadcast(("stats", -1, llm.stats()))
            elif busy:  # just went idle: an exact snapshot (pages all back)
                self._broadcast(("stats", -1, llm.stats()))
            self._flush()
            if self.stopping and not llm.has_unfinished_requests() and not self.preparer.pending():
                log.info("engine loop done (%s)", llm.stats())
                self.preparer.shutdown()
                for nonce in [*self.lora_reading, *(p[0] for p in self.lora_pending)]:
                    self._lora_answer(nonce, False, ("unavailable", "the engine is shutting down"))
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

    def _close(self, i: int, why: str) -> None:
        """Frontend i sent "shutdown" or is gone: abort its requests; stop once no frontend is left."""
        self.open.discard(i)
        self._abort_all(i)
        self.stopping = not self.open
        log.info("frontend %d %s; %s", i, why, "stopping" if self.stopping else f"{len(self.open)} frontends left")

    def _drain(self, i: int) -> None:
        llm = self.llm
        commands = self.commands[i]
        while i in self.open and commands.poll(0):
            try:
                cmd = pickle.loads(commands.recv_bytes())
            except (EOFError, OSError):  # the frontend is gone
                self._close(i, "is gone")
                return
            kind = cmd[0]
            if kind == "add":
                _, rid, prompt, params, name = cmd
                if name is not None:
                    self.named[name], self.name_of[rid] = rid, name
                work = functools.partial(prepare, llm, prompt, params)
                if quick_to_prepare(prompt, params) and time.perf_counter() < self.inline_until:
                    self._admit(rid, run_preparation(work), False)
                else:
                    self.preparer.submit(rid, work)
            elif kind == "abort":
                self._abort(cmd[1])
            elif kind == "abort_named":
                rid = self.named.get(cmd[2])
                self.out[cmd[1] % self.n].append(("aborted", cmd[1], rid is not None))
                if rid is not None:
                    self._abort(rid)
            elif kind == "stats":
                self.out[cmd[1] % self.n].append(("stats", cmd[1], llm.stats()))
            elif kind == "lora_load":
                self._read_lora(*cmd[1:])
            elif kind == "lora_unload":
                self._lora_answer(cmd[1], True, llm.unload_lora(cmd[2]))
            elif kind == "lora_list":
                self._lora_answer(cmd[1], True, llm.list_loras())
            elif kind == "shutdown":
                self._close(i, "sent shutdown")

    def _abort(self, rid: int) -> None:
        eid = self.engine_id.get(rid)
        if eid is None:
            self.preparer.cancel(rid)
        else:
            o = self.llm.abort(eid)
            if o is not None:
                self._output(o)

    def _add_prepared(self) -> None:
        for rid, seq, cancelled in self.preparer.take():
            self._admit(rid, seq, cancelled)

    def _admit(self, rid: int, seq, cancelled: bool) -> None:
        """Add a prepared request (seq: its Sequence, or the ValueError that rejects it)."""
        if isinstance(seq, ValueError):
            self.out[rid % self.n].append(("reject", rid, str(seq)))
            self._forget_name(rid)
        elif cancelled or rid % self.n not in self.open:
            self._output(seq.output(seq.finish("abort")), rid)
        else:
            try:
                self.llm.add_request(seq)
            except ValueError as e:  # checked when prepared, no longer true (its LoRA adapter was unloaded since)
                self.out[rid % self.n].append(("reject", rid, str(e)))
                self._forget_name(rid)
            else:
                self.front_id[seq.request_id], self.engine_id[rid] = rid, seq.request_id

    def _read_lora(self, nonce: int, name: str, path: str, allowed_dirs=None) -> None:
        """allowed_dirs: the server's --lora-dir directories; no file outside them is opened (LLM.read_lora)."""
        if self.stopping:
            self._lora_answer(nonce, False, ("unavailable", "the engine is shutting down"))
            return
        dirs = {} if allowed_dirs is None else {"allowed_dirs": allowed_dirs}

        def read() -> None:
            try:
                result = self.llm.read_lora(path, **dirs)
            except BaseException as e:  # noqa: BLE001 - answered as this load's error (lora_error sorts it)
                result = e
            self.lora_read.put((nonce, name, result))
            self._wake()

        self.lora_reading.add(nonce)
        threading.Thread(target=read, name="jphoton-lora-read", daemon=True).start()

    def _install_loras(self) -> None:
        """Install the adapters read so far, in the order they were read; those that find every slot taken and one
        draining stay pending (retried next tick) until LORA_WAIT_S pass."""
        while True:
            try:
                nonce, name, adapter = self.lora_read.get_nowait()
            except queue.Empty:
                break
            self.lora_reading.discard(nonce)
            if isinstance(adapter, BaseException):
                self._lora_failed(nonce, adapter)
            else:
                self.lora_pending.append([nonce, name, adapter, None])
        pending, self.lora_pending = self.lora_pending, []
        for load in pending:
            nonce, name, adapter, deadline = load
            try:
                info = self.llm.install_lora(name, adapter)
            except NoFreeLoraSlot as e:
                now = time.monotonic()
                if self.stopping:
                    self._lora_answer(nonce, False, ("unavailable", "the engine is shutting down"))
                    continue
                if e.draining:
                    if deadline is None:
                        load[3] = deadline = now + LORA_WAIT_S
                    if now < deadline:
                        self.lora_pending.append(load)
                        continue
                    e = NoFreeLoraSlot(f"{e}; no slot freed in {LORA_WAIT_S:.0f} s", draining=True)
                self._lora_failed(nonce, e)
            except Exception as e:  # noqa: BLE001 - a failed load fails that load only
                self._lora_failed(nonce, e)
            else:
                self._lora_answer(nonce, True, info)

    def _lora_failed(self, nonce: int, e: BaseException) -> None:
        err = lora_error(self.llm, e)
        self._lora_answer(nonce, False, (err.kind, str(err)))

    def _lora_answer(self, nonce: int, ok: bool, result) -> None:
        self.out[nonce % self.n].append(("lora", nonce, ok, result))
        self._broadcast(("stats", -1, self.llm.stats()))  # slot use changed: metrics see it now, not at the next tick

    def _abort_all(self, frontend: int) -> None:
        for eid, rid in list(self.front_id.items()):
            if rid % self.n == frontend:
                o = self.llm.abort(eid)
                if o is not None:
                    self._output(o)

    def _output(self, o: RequestOutput, rid: int | None = None) -> None:
        d = o.delta
        if rid is None:
            rid = self.front_id.get(o.request_id)
            if rid is None:
                return
            if d.finish_reason is not None:
                del self.front_id[o.request_id], self.engine_id[rid]
        if d.finish_reason is not None:
            self._forget_name(rid)
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
