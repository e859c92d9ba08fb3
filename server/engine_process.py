"""The engine in a child process of its own, behind AsyncLLM's interface: what `jphoton serve` runs
(`Server.load(Spawn(build))`; `serve(llm)` with an LLM object keeps its loop in a thread of the caller's process).

Why a process: in one process the engine thread and the gRPC event loop share the GIL. Under load the event loop is
busy building and writing messages, and the engine thread waits for the GIL each time the device finishes a step; on
the H100 the served decode ran at 0.31-0.41x of the engine alone (RESULTS.md, "Serving (gRPC)"). In its own process the
engine loop runs as it does under `LLM.generate`, and the server process spends all of its own time on gRPC.

Transport: two one-way pipes (multiprocessing connections, pickled tuples). Down: ("add", id, prompt, params, name),
("abort", id), ("abort_named", nonce, name), ("stats", nonce), ("lora_load", nonce, name, path), ("lora_unload",
nonce, name), ("lora_list", nonce), ("shutdown",). Up: one list of events per engine tick, however many requests it
served: ("out", id, token_ids, text, finish_reason, logprobs, prompt_tokens, completion_tokens, error), ("reject", id,
message) for a request the engine refused (ValueError: bad input, e.g. an adapter unloaded since the request was
checked; nothing was queued), ("stats", nonce, dict), ("lora", nonce, ok, result or (kind, message)), ("aborted",
nonce, found). The server assigns request ids itself, so submitting never waits for the child.

Several frontends (`jphoton serve --frontends N`, docs/serving.md): one pipe pair per frontend process, each frontend
numbering its ids (requests and nonces) i, i + N, i + 2N, ...; the engine routes every event by id modulo N, and stops
once every frontend has sent "shutdown" or gone (a frontend that dies has its requests aborted).

LoRA loads never stall the loop: the adapter is read and checked on a thread (`LLM.read_lora`), then installed between
ticks (`LLM.install_lora`, which never waits). If every slot is taken and one is draining, the load stays pending and is
retried each tick, the engine serving meanwhile, until the slot frees or LORA_WAIT_S pass.

Detokenization and stop strings stay with the sequence in the engine process (as under `LLM.generate`): the text that
streams is the text the engine stops on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
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

from jphoton.async_llm import ChatPrompt, Preparer, Rejected, model_info, prepare, tokenize_long_prompts_apart
from jphoton.engine.loras import NoFreeLoraSlot
from jphoton.params import SamplingParams
from jphoton.sequence import Delta, RequestOutput

log = logging.getLogger("jphoton.server")

_STATS_EVERY_S = 0.25  # the child pushes a stats snapshot this often while busy (metrics scrapes read it)
LORA_WAIT_S = 60.0  # a LoRA load waits this long for a draining slot (as LLM.load_lora's default timeout)


@dataclasses.dataclass(frozen=True)
class Spawn:
    """Serve the LLM that `build()` returns from a child process (`Server.load(Spawn(...))`). `build` must be
    picklable: a module-level function or a `functools.partial` of one (e.g. of `jphoton.LLM`)."""

    build: Callable[[], Any]
    start_timeout: float | None = None  # seconds for the child to build the LLM (None: no limit)


class EngineDied(RuntimeError):
    pass


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


@dataclasses.dataclass
class EngineLink:
    """Frontend `index` of `count`: its ends of the pipe pair to the engine process (passed to a spawned frontend
    process, which serves through `EngineProcess(link=...)`)."""

    index: int
    count: int
    down: Any  # multiprocessing Connection: commands to the engine
    up: Any  # events from the engine

    def close(self) -> None:
        self.down.close()
        self.up.close()


class EngineProcess:
    """Start with `start()` (blocking: the child builds the LLM; run it off the event loop), then `attach(loop)`.

    frontends: pipe pairs to make, one per frontend process; this object serves through the first, `links` are the
    others' (hand each to a frontend process, then `close()` them here). link: serve through another frontend's pair
    (in that frontend's process); the engine process is then not ours to start or stop."""

    def __init__(self, spawn: Spawn | None = None, *, frontends: int = 1, link: EngineLink | None = None):
        if (spawn is None) == (link is None):
            raise ValueError("EngineProcess needs a Spawn or a link, not both")
        self.spawn = spawn
        self.links: list[EngineLink] = []
        self._proc = None
        if link is None:
            ctx = multiprocessing.get_context("spawn")  # never fork a process that may have initialised CUDA or XLA
            pairs = [(ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)) for _ in range(frontends)]
            (self._down_recv, self._down), (self._up, self._up_send) = pairs[0]
            self.links = [EngineLink(i, frontends, down, up) for i, ((_, down), (up, _)) in enumerate(pairs) if i]
            self._child_ends = [(down_recv, up_send) for (down_recv, _), (_, up_send) in pairs]
            # The child logs as this process does (its records go to the same stderr, marked "engine").
            levels = (logging.getLogger().getEffectiveLevel(), logging.getLogger("jphoton").getEffectiveLevel())
            self._proc = ctx.Process(target=_child_main, args=(spawn.build, self._child_ends, levels),
                                     name="jphoton-engine", daemon=True)
            index, count = 0, frontends
        else:
            self._down, self._up, self._child_ends = link.down, link.up, []
            index, count = link.index, link.count
        self._start_lock = threading.Lock()
        self._join_lock = threading.Lock()
        # Commands go through a writer thread: a 15 MB prompt is a 15 MB pipe write, which would hold the event loop
        # (and every health check) until the child had read it all.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="jphoton-engine-writer", daemon=True)
        self._ids = itertools.count(index, count)  # the engine routes events by id modulo count
        self._ids_count = count
        self._remote_pid: int | None = None
        self._sinks: dict[int, asyncio.Queue] = {}
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._lora_waiters: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: str | None = None
        self._closing = False
        self.info: dict = {}
        self.text_limits: dict = {}  # LLM.text_limits() of the child's LLM: oversized text is refused here
        self.last_stats: dict = {}
        self.on_death: Callable[[str], None] | None = None  # called on the attached loop if the engine process dies

    # ---- life cycle ------------------------------------------------------------------------------------------------
    def start(self) -> dict:
        """Spawn the child and wait until its LLM is built (first step shapes compiled). Returns the model info.
        Re-raises the child's exception if building failed."""
        with self._start_lock:
            if self._closing:
                raise EngineDied("the server stopped before the engine process started")
            if self._proc is not None:
                self._proc.start()
            self._writer.start()
        for ends in self._child_ends:
            for end in ends:
                end.close()
        timeout = self.spawn.start_timeout if self.spawn is not None else None
        if not self._up.poll(timeout):
            self._proc.kill()
            raise TimeoutError(f"the engine process did not start in {timeout} s")
        try:
            kind, payload = pickle.loads(self._up.recv_bytes())
        except (EOFError, OSError):
            if self._proc is None:
                raise EngineDied("the engine process exited while starting") from None
            self._proc.join(5)
            raise EngineDied(f"the engine process exited while starting (exit code {self._proc.exitcode})") from None
        if kind == "failed":
            if self._proc is not None:
                self._proc.join(30)
            raise payload
        self.info, self.last_stats, self.text_limits, self._remote_pid = payload
        return self.info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver outputs on `loop` (where submit is called): a reader thread unpickles each tick's events and hands
        them to the loop in one call."""
        self._loop = loop
        threading.Thread(target=self._read, name="jphoton-engine-reader", daemon=True).start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is left, let the child free its pages and exit; kill it if it does not within `timeout`."""
        with self._start_lock:
            self._closing = True
            if self._proc is not None and self._proc.pid is None:  # never started (stopped while loading)
                return
        try:
            self._send(("shutdown",))
        except EngineDied:
            pass
        if self._proc is None:  # another frontend's engine: it stops once every frontend has sent shutdown
            if self._writer.is_alive():
                self._writer.join(timeout)
            return
        self._join(timeout)
        if self._proc.exitcode is None:
            log.warning("the engine process did not exit in %.0f s; killing it", timeout)
            self._proc.kill()
            self._join(5)

    def _join(self, timeout: float) -> None:
        """Join the child from one thread at a time: the reader (at end of file) and shutdown both join it, and the
        loser of two concurrent waitpid calls gets ECHILD, which multiprocessing reports as "still running" (exit
        code None: shutdown then logged that the child did not exit in 30 s and killed a dead process, at once)."""
        with self._join_lock:
            self._proc.join(timeout)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else self._remote_pid

    # ---- AsyncLLM's interface (called on the attached loop) ----------------------------------------------------------
    @property
    def frontends(self) -> int:
        return self._ids_count

    def submit(self, prompt, params: SamplingParams | None = None, name: str | None = None
               ) -> tuple[int, asyncio.Queue]:
        """Queue a request; returns (id, queue of RequestOutputs). A request the engine refuses gets one `Rejected`.
        name: the client's request id, for `abort_named` from another frontend (several frontends only)."""
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error}")
        rid = next(self._ids)
        outputs: asyncio.Queue = asyncio.Queue()
        self._sinks[rid] = outputs
        self._send(("add", rid, prompt, params, name if self._ids_count > 1 else None))
        return rid, outputs

    def abort(self, request_id: int) -> None:
        if self._error is None:
            self._send(("abort", request_id))

    async def abort_named(self, name: str, timeout: float = 5.0) -> bool:
        """Abort the live request that a frontend submitted under the client id `name` (its stream ends with
        finish_reason "abort"); False if there is none."""
        if self._error is not None:
            return False
        nonce = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters[nonce] = fut
        self._send(("abort_named", nonce, name))
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            return False
        finally:
            self._stats_waiters.pop(nonce, None)

    def chat_prompt(self, messages: list[dict]):
        return ChatPrompt(messages)  # the child applies the chat template (it has the tokenizer)

    def stats(self) -> dict:
        """The child's latest snapshot (at most ~0.25 s old while it is busy, exact once it is idle)."""
        return self.last_stats

    async def fresh_stats(self, timeout: float = 5.0) -> dict:
        """The child's stats now (after every command sent before this call has been handled)."""
        if self._error is not None:
            return self.last_stats
        nonce = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters[nonce] = fut
        self._send(("stats", nonce))
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            return self.last_stats
        finally:
            self._stats_waiters.pop(nonce, None)

    async def load_lora(self, name: str, path: str) -> dict:
        """Load a LoRA adapter in the child (LLM.read_lora + install_lora, waiting for a draining slot up to
        LORA_WAIT_S); its list_loras() entry. Raises LoraError."""
        return await self._lora_command("lora_load", name, path)

    async def unload_lora(self, name: str) -> bool:
        return await self._lora_command("lora_unload", name)

    async def list_loras(self) -> list[dict]:
        return await self._lora_command("lora_list")

    def has_unfinished_requests(self) -> bool:
        return bool(self._sinks)

    # ---- internals ---------------------------------------------------------------------------------------------------
    async def _lora_command(self, kind: str, *args):
        """Send a LoRA command and wait for its answer (no timeout: the child always answers, and a death fails it)."""
        if self._error is not None:
            raise EngineDied(f"the engine process is gone: {self._error}")
        nonce = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._lora_waiters[nonce] = fut
        try:
            self._send((kind, nonce, *args))
            return await fut
        finally:
            self._lora_waiters.pop(nonce, None)

    def _send(self, command: tuple) -> None:
        """Queue a command for the child (in order; the writer thread pickles and writes it)."""
        if self._error is not None:
            raise EngineDied(f"the engine process is gone: {self._error}")
        self._outbox.put(command)

    def _write(self) -> None:
        while True:
            command = self._outbox.get()
            try:
                self._down.send_bytes(pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL))
            except (OSError, ValueError):  # the child is gone: the reader sees EOF and fails what is open
                return
            if command[0] == "shutdown":
                return

    def _read(self) -> None:
        loop = self._loop
        while True:
            try:
                events = pickle.loads(self._up.recv_bytes())
            except (EOFError, OSError):
                break
            try:
                loop.call_soon_threadsafe(self._dispatch, events)
            except RuntimeError:  # the loop is closed
                return
        if self._proc is not None:
            self._join(5)
        code = self._proc.exitcode if self._proc is not None else "unknown: another frontend's child"
        try:
            loop.call_soon_threadsafe(self._died, f"the engine process exited (exit code {code})")
        except RuntimeError:
            pass

    def _dispatch(self, events: list) -> None:
        for ev in events:
            kind = ev[0]
            if kind == "out":
                _, rid, token_ids, text, reason, logprobs, prompt_tokens, completion_tokens, error, choice = ev
                sink = self._sinks.get(rid)
                if sink is None:
                    continue
                if reason is not None:
                    del self._sinks[rid]
                sink.put_nowait(RequestOutput(rid, Delta(token_ids, text, reason), logprobs, prompt_tokens,
                                              completion_tokens, error, choice))
            elif kind == "reject":
                sink = self._sinks.pop(ev[1], None)
                if sink is not None:
                    sink.put_nowait(Rejected(ev[2]))
            elif kind == "aborted":
                fut = self._stats_waiters.get(ev[1])
                if fut is not None and not fut.done():
                    fut.set_result(ev[2])
            elif kind == "stats":
                self.last_stats = ev[2]
                fut = self._stats_waiters.get(ev[1])
                if fut is not None and not fut.done():
                    fut.set_result(ev[2])
            elif kind == "lora":
                _, nonce, ok, result = ev
                fut = self._lora_waiters.get(nonce)
                if fut is not None and not fut.done():
                    fut.set_result(result) if ok else fut.set_exception(LoraError(*result))
            elif kind == "fatal":
                self._died(ev[1])

    def _died(self, why: str) -> None:
        if self._error is not None:
            return
        self._error = why
        (log.info if self._closing else log.error)("engine process: %s", why)
        for sink in self._sinks.values():
            sink.put_nowait(None)  # the servicer answers INTERNAL
        self._sinks.clear()
        for fut in self._lora_waiters.values():
            if not fut.done():
                fut.set_exception(EngineDied(f"the engine process is gone: {why}"))
        if self.on_death is not None and not self._closing:
            self.on_death(why)


# ---- the child -------------------------------------------------------------------------------------------------------
def _child_main(build: Callable[[], Any], links: list[tuple[Any, Any]], levels: tuple[int, int]) -> None:
    """links: (commands, events) connection pair per frontend."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole process group: the server drains us
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
    ready = pickle.dumps(("ready", (model_info(llm), llm.stats(), llm.text_limits(), os.getpid())))
    for _, events in links:
        _send_quietly(events, ready)
    try:
        _EngineLoop(llm, links).run()
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


class _EngineLoop:
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
        self.stats_at = 0.0
        # Requests are prepared (tokenized, constraint compiled) on worker threads: a huge prompt never stalls a tick.
        self.preparer = Preparer()
        # LoRA loads: adapters are read on threads (lora_reading: nonces), installed between ticks (lora_pending:
        # [nonce, name, adapter, deadline once a draining slot was found]).
        self.lora_read: queue.SimpleQueue = queue.SimpleQueue()
        self.lora_reading: set[int] = set()
        self.lora_pending: list[list] = []
        tokenize_long_prompts_apart(llm)

    def run(self) -> None:
        llm = self.llm
        while True:
            busy = llm.has_unfinished_requests()
            # Block on the pipes only when there is nothing to step (the first command wakes us); while requests are
            # being prepared, look back soon.
            waiting = self.preparer.pending() or self.lora_reading or self.lora_pending
            timeout = 0 if busy or self.stopping else 0.005 if waiting else 0.5
            if timeout == 0 or self.n == 1:  # (a poll costs a few us a pipe; a wait over several, a selector's setup)
                ready = [i for i in sorted(self.open) if self.commands[i].poll(timeout)]
            else:
                conns = [self.commands[i] for i in self.open]
                ready = [self.commands.index(c) for c in mp_connection.wait(conns, timeout)] if conns else []
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

    def _flush(self) -> None:
        for i, out in enumerate(self.out):
            if out:
                _send_quietly(self.events[i], pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
                self.out[i] = []

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
                self.preparer.submit(rid, lambda p=prompt, q=params: prepare(llm, p, q))
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

    def _read_lora(self, nonce: int, name: str, path: str) -> None:
        if self.stopping:
            self._lora_answer(nonce, False, ("unavailable", "the engine is shutting down"))
            return

        def read() -> None:
            try:
                result = self.llm.read_lora(path)
            except BaseException as e:  # noqa: BLE001 - answered as this load's error (lora_error sorts it)
                result = e
            self.lora_read.put((nonce, name, result))

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


def _die_with_parent() -> None:
    """Exit when the server process dies, however it dies (this process must not keep holding the GPU). Not
    PR_SET_PDEATHSIG: that fires when the *thread* that spawned us exits (the server starts us from a loader thread)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="jphoton-parent-watch", daemon=True).start()
