"""The engine in a child process of its own, behind AsyncLLM's interface: what `jphoton serve` runs
(`Server.load(Spawn(build))`; `serve(llm)` with an LLM object keeps its loop in a thread of the caller's process).

Why a process: in one process the engine thread and the gRPC event loop share the GIL. Under load the event loop is
busy building and writing messages, and the engine thread waits for the GIL each time the device finishes a step; on
the H100 the served decode ran at 0.31-0.41x of the engine alone (RESULTS.md, "Serving (gRPC)"). In its own process the
engine loop runs as it does under `LLM.generate`, and the server process spends all of its own time on gRPC.

Transport: two one-way pipes (multiprocessing connections, pickled tuples). Down: ("add", id, prompt, params, name),
("abort", id), ("abort_named", nonce, name), ("stats", nonce), ("lora_load", nonce, name, path, allowed_dirs),
("lora_unload", nonce, name), ("lora_list", nonce), ("shutdown",). Up: one list of events per engine tick, however many
requests it served (an empty list, a heartbeat, after HEARTBEAT_S without one, idle or not): ("out", id, token_ids,
text, finish_reason, logprobs, prompt_tokens, completion_tokens, error), ("reject", id, message) for a request the
engine refused (ValueError: bad input, e.g. an adapter unloaded since the request was checked; nothing was queued),
("stats", nonce, dict), ("lora", nonce, ok, result or (kind, message)), ("aborted", nonce, found). The server assigns
request ids itself, so submitting never waits for the child.

Several frontends (`jphoton serve --frontends N`, docs/serving.md): one pipe pair per frontend process, each frontend
numbering its ids (requests and nonces) i, i + N, i + 2N, ...; the engine routes every event by id modulo N, and stops
once every frontend has sent "shutdown" or gone (a frontend that dies has its requests aborted).

LoRA loads never stall the loop: the adapter is read and checked on a thread (`LLM.read_lora`), then installed between
ticks (`LLM.install_lora`, which never waits). If every slot is taken and one is draining, the load stays pending and is
retried each tick, the engine serving meanwhile, until the slot frees or LORA_WAIT_S pass.

Detokenization and stop strings stay with the sequence in the engine process (as under `LLM.generate`): the text that
streams is the text the engine stops on.

Watchdog (in the frontend's process: a stuck engine process may hold its own GIL): the engine process gone (end of
file on its pipe), or silent for `tick_timeout` seconds (no heartbeat: its loop is stuck; the process is killed first),
is a death: every open stream and waiting call fails at once (`EngineDied`: the servicer answers UNAVAILABLE), later
calls too, and `on_death` tells the server, which turns health NOT_SERVING and (`jphoton serve`) exits non-zero.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import multiprocessing
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from jphoton.async_llm import Rejected
from jphoton.engine.driver import LORA_WAIT_S, ChatPrompt
from jphoton.params import SamplingParams
from jphoton.sequence import Delta, RequestOutput
from jphoton.server.engine_loop import HEARTBEAT_S, LoraError, child_main, lora_error

__all__ = ["DEFAULT_TICK_TIMEOUT", "HEARTBEAT_S", "LORA_WAIT_S", "EngineDied", "EngineLink", "EngineProcess", "LoraError",
           "Rejected", "Spawn", "default_frontends", "lora_error"]

log = logging.getLogger("jphoton.server")

# One frontend's event loop wrote ~17-19k messages a second at most on the H100 host (1B, 1.97 tokens a message at 64
# streams, its writes delaying new calls: TTFT). 30k paces the 1B at 64 streams (~43k tokens a second on an H200) to a
# message every 2 steps and leaves 32 streams alone; 18k (32 streams paced too, 64 every 3 steps) cut TTFT more but
# slowed the engine's steps 4-5% (H200 A/B, docs/decisions.md). 6e55017:lab/probes/frontend_capacity.py, docs/serving.md.
DEFAULT_MAX_MESSAGE_RATE = 30_000.0
MAX_PACE = 4

# `jphoton serve`'s frontend processes on a host with at least this many CPUs: 2 (else 1). At 64 streams one event loop
# cannot write a message per stream per step: new calls queue behind the writes (staggered TTFT p50 20-26 ms against
# 9.5 with two on an H200; docs/decisions.md "gRPC frontends"), and a second process needs a core of its own.
TWO_FRONTENDS_MIN_CPUS = 8

# Seconds without any event (the engine loop sends a heartbeat every HEARTBEAT_S, idle or not) after which the engine
# process counts as stuck: killed, and the server exits. Far above any legitimate tick (a step on a cold program: ~0.4 s
# on an H100; compiles happen off the loop, in the background warm-up).
DEFAULT_TICK_TIMEOUT = 60.0


def default_frontends(cpus: int | None = None) -> int:
    """`jphoton serve`'s frontend count: 2 where the process may run on TWO_FRONTENDS_MIN_CPUS or more CPUs, else 1."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 2 if cpus >= TWO_FRONTENDS_MIN_CPUS else 1


@dataclasses.dataclass(frozen=True)
class Spawn:
    """Serve the LLM that `build()` returns from a child process (`Server.load(Spawn(...))`). `build` must be
    picklable: a module-level function or a `functools.partial` of one (e.g. of `jphoton.LLM`)."""

    build: Callable[[], Any]
    start_timeout: float | None = None  # seconds for the child to build the LLM (None: no limit)


class EngineDied(RuntimeError):
    """The engine process is gone (or stuck and killed): what every open and later call fails with (UNAVAILABLE)."""


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
    (in that frontend's process); the engine process is then not ours to start or stop. max_message_rate: past this
    many tokens a second over its streams (0: no limit), a started stream gets one message every 2 (3, 4) ticks,
    carrying those ticks' tokens; first tokens and finishes are never held. tick_timeout: seconds of silence from the
    engine process (no event, no heartbeat) after which it counts as stuck (0: never; the module's docstring)."""

    def __init__(self, spawn: Spawn | None = None, *, frontends: int = 1, link: EngineLink | None = None,
                 max_message_rate: float = DEFAULT_MAX_MESSAGE_RATE, tick_timeout: float = DEFAULT_TICK_TIMEOUT):
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
            self._proc = ctx.Process(target=child_main, args=(spawn.build, self._child_ends, levels),
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
        # Pacing (`_pace`): streams that have their first token, outputs held back until their stream's turn, ticks.
        self.max_message_rate = max_message_rate
        self._started: set[int] = set()
        self._held: dict[int, list[RequestOutput]] = {}
        self._ticks, self._last_tick, self._tick_s = 0, 0.0, None
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._lora_waiters: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: str | None = None
        self._closing = False
        self._ready = False  # the child has built its LLM (before: shutdown terminates it, it cannot take "shutdown")
        self.tick_timeout = tick_timeout
        self._heard_at = 0.0  # time.monotonic() of the last event list from the child (the watchdog's clock)
        self._stalled: str | None = None  # why the watchdog gave up on the child
        self.info: dict = {}
        self.request_limits: dict = {}  # engine_loop.request_limits of the child's LLM: the frontend checks these
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
        self.info, self.last_stats, self.request_limits, self._remote_pid = payload
        self._ready = True
        return self.info

    @property
    def text_limits(self) -> dict:
        """LLM.text_limits() of the child's LLM: oversized text is refused in the frontend."""
        keys = ("max_prompt_bytes", "bytes_per_token", "max_model_len")
        return {k: self.request_limits[k] for k in keys if k in self.request_limits}

    @property
    def error(self) -> str | None:
        """Why the engine process is gone (None while it serves)."""
        return self._error

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver outputs on `loop` (where submit is called): a reader thread unpickles each tick's events and hands
        them to the loop in one call."""
        self._loop = loop
        self._heard_at = time.monotonic()
        threading.Thread(target=self._read, name="jphoton-engine-reader", daemon=True).start()
        if self.tick_timeout:
            threading.Thread(target=self._watch, name="jphoton-engine-watchdog", daemon=True).start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is left, let the child free its pages and exit; kill it if it does not within `timeout`."""
        with self._start_lock:
            self._closing = True
            if self._proc is not None and self._proc.pid is None:  # never started (stopped while loading)
                return
        if self._proc is not None and not self._ready:
            # Still building its LLM, so it reads no command: SIGTERM (it leaves at once, between two Python
            # bytecodes), then SIGKILL if a long C call (an XLA compile) keeps it from that.
            self._proc.terminate()
            self._join(timeout)
            if self._proc.exitcode is None:
                log.info("the engine process is still building its LLM; killing it")
                self._proc.kill()
                self._join(5)
            return
        try:
            self._send(("shutdown",))
        except EngineDied:  # gone: the writer may still wait for a command (its write then fails, or is not read)
            self._outbox.put(("shutdown",))
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
        """Queue a request; returns (id, queue of RequestOutputs). A request the engine refuses gets one `Rejected`;
        one whose engine process dies gets `EngineDied` (raised here if it is gone already). name: the client's
        request id, for `abort_named` from another frontend (several frontends only)."""
        if self._error is not None:
            raise EngineDied(self._error)
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
        """The child's stats now (after every command sent before this call has been handled). EngineDied once the
        child is gone (its last numbers are stale)."""
        if self._error is not None:
            raise EngineDied(self._error)
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

    async def load_lora(self, name: str, path: str, allowed_dirs: list[str] | None = None) -> dict:
        """Load a LoRA adapter in the child (LLM.read_lora + install_lora, waiting for a draining slot up to
        LORA_WAIT_S); its list_loras() entry. allowed_dirs: no file outside them is opened. Raises LoraError."""
        return await self._lora_command("lora_load", name, path, allowed_dirs)

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
            raise EngineDied(self._error)
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
            raise EngineDied(self._error)
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
            self._heard_at = time.monotonic()
            if not events:  # a heartbeat
                continue
            try:
                loop.call_soon_threadsafe(self._dispatch, events)
            except RuntimeError:  # the loop is closed
                return
        if self._proc is not None:
            self._join(5)
        if self._stalled is not None:
            why = self._stalled
        elif self._proc is not None:
            why = f"the engine process exited (exit code {self._proc.exitcode})"
        else:
            why = "the engine process exited (another frontend's child)"
        try:
            loop.call_soon_threadsafe(self._died, why)
        except RuntimeError:
            pass

    def _watch(self) -> None:
        """The watchdog: an engine process silent for tick_timeout seconds is stuck. Ours is killed (the reader then
        sees the end of file and fails what is open); another frontend's is given up on here, its owner kills it."""
        period = min(0.25, self.tick_timeout / 4)
        while self._error is None and not self._closing:
            time.sleep(period)
            silent = time.monotonic() - self._heard_at
            if silent <= self.tick_timeout or self._error is not None or self._closing:
                continue
            self._stalled = (f"the engine process stalled: no event from it for {silent:.1f} s (tick timeout "
                             f"{self.tick_timeout:g} s)")
            log.error("%s; %s", self._stalled, "killing it" if self._proc is not None else "giving up on it")
            if self._proc is not None:
                self._proc.kill()
            else:
                try:
                    self._loop.call_soon_threadsafe(self._died, self._stalled)
                except RuntimeError:
                    pass
            return

    def _pace(self) -> int:
        """Ticks between a started stream's messages: 1 while the streams' tokens come at most `max_message_rate` a
        second, more beyond (up to MAX_PACE). Every gRPC message costs this process's event loop tens of us; past its
        rate the loop falls behind, and a new call waits behind the writes (TTFT)."""
        now = time.perf_counter()
        dt, self._last_tick = now - self._last_tick, now
        if dt < 0.1:  # ticking (not the first tick after idle)
            self._tick_s = dt if self._tick_s is None else 0.9 * self._tick_s + 0.1 * dt
        if not self.max_message_rate or not self._tick_s:
            return 1
        return max(1, min(MAX_PACE, math.ceil(len(self._started) / self._tick_s / self.max_message_rate)))

    def _dispatch(self, events: list) -> None:
        self._ticks += 1
        tick, pace = self._ticks, self._pace()
        held_now: set[int] = set()
        for ev in events:
            kind = ev[0]
            if kind == "out":
                _, rid, token_ids, text, reason, logprobs, prompt_tokens, completion_tokens, error, choice = ev
                sink = self._sinks.get(rid)
                if sink is None:
                    continue
                out = RequestOutput(rid, Delta(token_ids, text, reason), logprobs, prompt_tokens, completion_tokens,
                                    error, choice)
                if reason is None and pace > 1 and rid in self._started and (tick + rid // self._ids_count) % pace:
                    self._held.setdefault(rid, []).append(out)  # this stream's turn comes at a later tick
                    held_now.add(rid)
                    continue
                for held in self._held.pop(rid, ()):
                    sink.put_nowait(held)
                if reason is not None:
                    del self._sinks[rid]
                    self._started.discard(rid)
                else:
                    self._started.add(rid)
                sink.put_nowait(out)
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
        for rid in [r for r in self._held if r not in held_now]:  # no token this tick (preempted): none waits for one
            for held in self._held.pop(rid):
                self._sinks[rid].put_nowait(held)

    def _died(self, why: str) -> None:
        if self._error is not None:
            return
        self._error = why
        (log.info if self._closing else log.error)("engine process: %s", why)
        for sink in self._sinks.values():
            sink.put_nowait(EngineDied(why))  # the servicer answers UNAVAILABLE
        self._sinks.clear()
        self._held.clear()
        self._started.clear()
        for fut in [*self._lora_waiters.values(), *self._stats_waiters.values()]:
            if not fut.done():
                fut.set_exception(EngineDied(why))
        if self.on_death is not None and not self._closing:
            self.on_death(why)
