"""Build, start and stop the grpc.aio server: the Engine service, standard health checking, reflection, metrics.

Life cycle: the port opens first with health NOT_SERVING, the model is loaded and warmed up in a worker thread, then
health turns SERVING. Shutdown is the reverse: health NOT_SERVING, new calls refused, in-flight streams drained for a
grace period (then cancelled), the engine loop stopped. An engine that dies or stalls (engine_process.py's watchdog;
the in-process thread: `_watch_in_process`) turns health NOT_SERVING at once and every call UNAVAILABLE; `jphoton
serve` (`run_until_signal`, and each frontend process) then exits with ENGINE_FAILED_EXIT for a supervisor to restart.
Two ways in: `await Server(...).start()` on your own event loop (what `jphoton serve` does), or `serve(...)`, which
runs the server on a background thread and returns a handle (tests, benchmarks, notebooks). More: docs/serving.md.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jphoton.server.engine_loop import exit_with_parent
from jphoton.server.engine_process import (
    DEFAULT_MAX_MESSAGE_RATE,
    DEFAULT_TICK_TIMEOUT,
    EngineDied,
    EngineLink,
    EngineProcess,
    Spawn,
)
from jphoton.server.metrics import Metrics
from jphoton.server.service import SERVICE_NAME, Admission, EngineServicer, method_handlers

log = logging.getLogger("jphoton.server")

DEFAULT_PORT = 50051
DEFAULT_MAX_QUEUE = 512
# A prompt of a whole 128k context is ~0.5 MiB as text or packed token ids; anything far bigger is a mistake.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 2**20
ENGINE_FAILED_EXIT = 3  # `jphoton serve`'s exit status when its engine died or stalled (docs/serving.md)
FAILED_GRACE_S = 1.0  # draining once the engine is gone: every stream has ended already


class Server:
    """One gRPC server around one LLM. Every method runs on the event loop that called start().

    frontends: serve a `Spawn` from this many processes, each with its own event loop, all on one port (SO_REUSEPORT:
    the kernel spreads connections over them) and each with its own pipe pair to the one engine process; this one
    starts and stops the others (docs/serving.md). max_queue is split evenly among them. reuse_port: bind the port
    shared (set for the frontends after the first). tick_timeout: seconds of silence from the engine (its process, or
    the in-process engine thread) after which it counts as stalled (0: never). lora_dirs: the directories LoadLora may
    load adapters from (none: LoadLora is refused)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT, max_queue: int = DEFAULT_MAX_QUEUE,
                 metrics_port: int | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 frontends: int = 1, reuse_port: bool = False, frontend_index: int = 0,
                 max_message_rate: float = DEFAULT_MAX_MESSAGE_RATE, tick_timeout: float = DEFAULT_TICK_TIMEOUT,
                 lora_dirs=()):
        if frontends < 1:
            raise ValueError(f"frontends must be >= 1, got {frontends}")
        if not tick_timeout >= 0:
            raise ValueError(f"tick_timeout must be >= 0, got {tick_timeout}")
        if frontends > 1 and metrics_port is not None and not Metrics.multiprocess():
            raise ValueError("Prometheus metrics with several frontends need PROMETHEUS_MULTIPROC_DIR set before "
                             "prometheus_client is imported (`jphoton serve` does this)")
        self.host, self.requested_port = host, port
        self.port: int | None = None
        self.frontends, self.frontend_index = frontends, frontend_index
        self.reuse_port = reuse_port or frontends > 1
        self._frontend_procs: list = []
        self._frontends_ready: list = []  # one multiprocessing Event per frontend process after the first
        # the other frontends drain for this long at stop, with this GIL switch interval (run_until_signal's)
        self.drain_grace, self.switch_interval = 30.0, None
        self.metrics = Metrics()
        self.metrics_port_requested = metrics_port
        self.metrics_port: int | None = None
        self.max_queue = max_queue
        self.admission = Admission(-(-max_queue // frontends))
        self.lora_dirs = tuple(str(d) for d in lora_dirs)
        self.servicer = EngineServicer(self.admission, self.metrics, lora_dirs=self.lora_dirs)
        self.max_message_bytes = max_message_bytes
        self.max_message_rate = max_message_rate
        self.tick_timeout = tick_timeout
        self.engine_failed: asyncio.Future | None = None  # set to why, once the engine died or stalled (start())
        self._watchdog: asyncio.Task | None = None
        self.health: health.aio.HealthServicer | None = None  # grpc.aio objects are made on the serving loop, in start()
        self._grpc: grpc.aio.Server | None = None
        self._engine_process: EngineProcess | None = None
        self._stopped = False

    @property
    def llm(self):
        return self.servicer.llm

    async def start(self) -> int:
        """Open the port (health NOT_SERVING until load()); returns the bound port (port 0 picks a free one)."""
        self.health = health.aio.HealthServicer()
        self.engine_failed = asyncio.get_running_loop().create_future()
        self._grpc = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            # a second server on a busy port must fail, not share it (frontends share theirs: checked free first)
            ("grpc.so_reuseport", int(self.reuse_port)),
        ])
        self._grpc.add_generic_rpc_handlers((method_handlers(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self._grpc)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"[{self.host}]:{self.requested_port}" if ":" in self.host else f"{self.host}:{self.requested_port}"
        if self.frontends > 1 and self.requested_port:
            _check_port_free(self.host, self.requested_port)
        try:
            self.port = self._grpc.add_insecure_port(address)
        except RuntimeError:  # grpcio >= 1.6x raises where older ones returned 0
            self.port = 0
        if not self.port:
            raise OSError(f"cannot bind {address} (in use, or not an address of this machine)")
        await self._grpc.start()
        self.metrics.watch(self.servicer.stats)
        if self.metrics_port_requested is not None:
            self.metrics_port = self.metrics.serve_http(self.metrics_port_requested, self.host)
        log.info("gRPC listening on %s:%d (health NOT_SERVING until the model is warm)%s%s", self.host, self.port,
                 f", metrics on :{self.metrics_port}/metrics" if self.metrics_port else "",
                 f", frontend {self.frontend_index}" if self.reuse_port else "")
        return self.port

    async def load(self, model: Spawn | Callable[[], object] | object) -> None:
        """Serve `model`: `Spawn(build)` (the LLM built and run in a child process: what `jphoton serve` does), an LLM,
        or a zero-argument callable that builds one (in a worker thread of this process). Health checks are answered
        while it loads and compiles; health turns SERVING when it is ready."""
        t0 = time.perf_counter()
        if self.frontends > 1 and not isinstance(model, Spawn):
            raise ValueError("several frontends need the engine in a process of its own (a Spawn)")
        if isinstance(model, (Spawn, EngineLink)):
            if isinstance(model, Spawn):
                llm = EngineProcess(model, frontends=self.frontends, max_message_rate=self.max_message_rate,
                                    tick_timeout=self.tick_timeout)
                self._start_frontends(llm.links)
            else:
                llm = EngineProcess(link=model, max_message_rate=self.max_message_rate, tick_timeout=self.tick_timeout)
            self._engine_process = llm
            await _in_daemon_thread(llm.start)
            # SERVING once every frontend serves: the port is shared, so a call right after it may reach any of them
            await _in_daemon_thread(self._wait_for_frontends)
            llm.on_death = self._engine_died
            llm.attach(asyncio.get_running_loop())
        else:
            llm = await _in_daemon_thread(model) if callable(model) else model
        if self._stopped:
            return
        self.servicer.attach(llm)
        if self._engine_process is None:
            self._watchdog = asyncio.create_task(self._watch_in_process())
        elif self._engine_process.error is not None:  # it died while the other frontends were starting
            self._engine_died(self._engine_process.error)
            return
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        stats = self.servicer.engine.stats()
        log.info("SERVING %s (ready in %.1f s%s, %d compiles so far, %d of %d step shapes ready)",
                 self.servicer.engine.info["name"], time.perf_counter() - t0,
                 f", engine process {llm.pid}" if isinstance(llm, EngineProcess) else "", stats["num_compiles"],
                 stats["shapes_compiled"], stats["shapes_total"])

    def _wait_for_frontends(self, timeout: float = 120.0) -> None:
        """Block until every other frontend process has attached to the engine (or died, or `timeout` passed: then
        the ones that did serve, and a warning says which did not)."""
        deadline = time.monotonic() + timeout
        for proc, ready in zip(self._frontend_procs, self._frontends_ready, strict=True):
            while not ready.wait(0.1):
                if not proc.is_alive() or time.monotonic() > deadline:
                    log.warning("frontend process %d is not serving (%s)", proc.pid,
                                "exited" if not proc.is_alive() else f"not ready after {timeout:.0f} s")
                    break

    def _start_frontends(self, links: list[EngineLink]) -> None:
        """Start a frontend process per link (each binds this server's port shared), then drop our copies of their
        ends, so that the engine sees a frontend that dies as an end of file."""
        ctx = multiprocessing.get_context("spawn")
        levels = (logging.getLogger().getEffectiveLevel(), logging.getLogger("jphoton").getEffectiveLevel())
        kwargs = dict(host=self.host, port=self.port, max_queue=self.admission.capacity,
                      max_message_bytes=self.max_message_bytes, max_message_rate=self.max_message_rate,
                      metrics_port=None, reuse_port=True, tick_timeout=self.tick_timeout, lora_dirs=self.lora_dirs)
        for link in links:
            ready = ctx.Event()
            self._frontends_ready.append(ready)
            proc = ctx.Process(target=_frontend_main, name=f"jphoton-frontend-{link.index}", daemon=True,
                               args=(link, {**kwargs, "frontend_index": link.index}, levels, self.drain_grace,
                                     self.switch_interval, ready))
            proc.start()
            self._frontend_procs.append(proc)
            link.close()
        if links:
            log.info("%d more frontend processes on port %d: %s", len(links), self.port,
                     [p.pid for p in self._frontend_procs])

    def _engine_died(self, why: str) -> None:
        """The engine is gone (its process died or stalled, or the in-process engine thread died): health says
        NOT_SERVING at once (a load balancer stops sending), every call gets UNAVAILABLE (the servicer sees the
        engine's error), and `engine_failed` is set, on which `jphoton serve` exits non-zero."""
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.engine_failed is not None and not self.engine_failed.done():
            self.engine_failed.set_result(why)

    def _set_health(self, status) -> None:
        if not self._stopped:
            for name in ("", SERVICE_NAME):
                asyncio.ensure_future(self.health.set(name, status))

    async def _watch_in_process(self) -> None:
        """The in-process engine (AsyncLLM's thread): its death is the engine's death; a pass that does not come for
        tick_timeout seconds (the thread stuck) turns health NOT_SERVING and new calls UNAVAILABLE until it comes
        (a thread cannot be killed, and serve(llm) never ends the caller's process)."""
        engine = self.servicer.engine
        period = min(0.25, self.tick_timeout / 4) if self.tick_timeout else 0.25
        while not self._stopped:
            await asyncio.sleep(period)
            error = getattr(engine, "error", None)  # (a stand-in engine of the tests may have neither)
            if error is not None:
                log.error("engine: %s", error)
                self._engine_died(error)
                return
            ticked_at = getattr(engine, "ticked_at", None)
            silent = 0.0 if ticked_at is None else time.monotonic() - ticked_at
            stalled = bool(self.tick_timeout) and silent > self.tick_timeout
            if stalled and self.servicer.failure is None:
                self.servicer.failure = (f"the engine thread stalled: no pass for {silent:.1f} s (tick timeout "
                                         f"{self.tick_timeout:g} s)")
                log.error("%s", self.servicer.failure)
                self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            elif not stalled and self.servicer.failure is not None:
                log.warning("the engine thread runs again after %s", self.servicer.failure)
                self.servicer.failure = None
                self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float = 30.0) -> None:
        """Graceful shutdown: NOT_SERVING, refuse new calls, let in-flight streams finish for up to `grace` seconds,
        cancel what is left, then stop the engine loop once the aborted requests' pages are back."""
        if self._stopped:
            return
        self._stopped = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self.health.enter_graceful_shutdown()
        self.servicer.draining = True
        for proc in self._frontend_procs:  # they drain as we do (their SIGTERM handler), then leave
            if proc.is_alive():
                proc.terminate()
        await self._grpc.stop(grace)
        for proc in self._frontend_procs:
            await asyncio.to_thread(proc.join, grace + 15)
            if proc.is_alive():
                log.warning("frontend process %d did not exit; killing it", proc.pid)
                proc.kill()
        log.info("frontend %d: %d Generate calls served", self.frontend_index, self.servicer.calls)
        engine = self.servicer.engine
        if engine is not None:
            # Cancelled streams queued aborts; let the engine loop run them so the LLM is left clean (it may be reused
            # in this process, as the tests do; an engine process frees its pages before it exits).
            deadline = time.monotonic() + 10
            while engine.has_unfinished_requests() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(engine.shutdown)
        elif self._engine_process is not None:  # stopped while the child was still building its LLM
            await asyncio.to_thread(self._engine_process.shutdown, 5)
        self.metrics.close()
        log.info("server stopped")


class ServerThread:
    """A Server on its own event loop in a daemon thread; what serve() returns."""

    def __init__(self, server: Server):
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._load_task: asyncio.Future | None = None
        self._thread = threading.Thread(target=self._run, name="jphoton-grpc", daemon=True)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def metrics_port(self) -> int | None:
        return self.server.metrics_port

    def start(self, model) -> ServerThread:
        self._model = model
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the model is loaded and health is SERVING; re-raises a load failure."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"server not SERVING after {timeout} s")
        if self._error is not None:
            raise self._error

    def call(self, coro, timeout: float | None = None):
        """Run a coroutine on the server's loop (e.g. to inspect it without racing its handlers)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, grace: float = 5.0) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self.server.start())
        except BaseException as e:
            self._error = e
            self._started.set()
            self._ready.set()
            return
        self._started.set()
        self._load_task = self._loop.create_task(self.server.load(self._model))
        self._load_task.add_done_callback(self._loaded)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _loaded(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._error = task.exception()
            log.error("model load failed: %r", self._error)
        self._ready.set()


def serve(model, *, host: str = "127.0.0.1", port: int = 0, max_queue: int = DEFAULT_MAX_QUEUE,
          metrics_port: int | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
          wait: bool = True, frontends: int = 1, max_message_rate: float = DEFAULT_MAX_MESSAGE_RATE,
          tick_timeout: float = DEFAULT_TICK_TIMEOUT, lora_dirs=()) -> ServerThread:
    """Start a server for `model` (an LLM, a callable that builds one, or a `Spawn`: the engine in a child process)
    on a background thread. Returns once the port is open, and, with wait=True, once the model is SERVING.
    handle.port, handle.stop(grace). frontends > 1: a Spawn served from that many processes; tick_timeout, lora_dirs:
    Server's doc. An engine that dies or stalls leaves the server up, NOT_SERVING (`handle.server.engine_failed`)."""
    handle = ServerThread(Server(host=host, port=port, max_queue=max_queue, metrics_port=metrics_port,
                                 max_message_bytes=max_message_bytes, frontends=frontends,
                                 max_message_rate=max_message_rate, tick_timeout=tick_timeout,
                                 lora_dirs=lora_dirs)).start(model)
    if wait:
        handle.wait_ready()
    return handle


def _check_port_free(host: str, port: int) -> None:
    """Frontends bind their port with SO_REUSEPORT, which would also share it with another server already there:
    bind it plainly first, so that a busy port fails as it does for one frontend."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot bind {host}:{port} ({e.strerror})") from None


def _frontend_main(link: EngineLink, server_kwargs: dict, levels: tuple[int, int], grace: float,
                   switch_interval: float | None, ready=None) -> None:
    """A frontend process after the first: serve the port (shared) through `link` until SIGTERM, then drain.
    ready: set once this frontend serves (the first frontend turns SERVING after every one has)."""
    import sys

    if switch_interval is not None:  # as the first frontend's (run_until_signal)
        sys.setswitchinterval(switch_interval)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the first frontend drains us
    logging.basicConfig(level=levels[0], format=f"%(levelname)s %(name)s (frontend {link.index}): %(message)s",
                        force=True)
    logging.getLogger("jphoton").setLevel(levels[1])
    exit_with_parent()  # (as the engine process does)

    async def run() -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        server = Server(**server_kwargs)
        await server.start()

        async def load_and_tell() -> None:
            await server.load(link)
            if ready is not None:
                ready.set()

        load = asyncio.create_task(load_and_tell())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({stopping, server.engine_failed}, return_when=asyncio.FIRST_COMPLETED)
        failed = server.engine_failed.done()
        await server.stop(FAILED_GRACE_S if failed else grace)
        stopping.cancel()
        _settle(load)
        _ignore_signals(loop, signal.SIGTERM)
        return ENGINE_FAILED_EXIT if failed else 0

    code = asyncio.run(run())
    os._exit(code)  # (the loader thread may still wait for the engine's ready message)


async def run_until_signal(model, *, grace: float = 30.0, switch_interval: float | None = 0.001,
                           **server_kwargs) -> None:
    """`jphoton serve`: open the port, load the model, serve until SIGINT/SIGTERM, then drain for `grace` seconds.

    switch_interval: this process's GIL switch interval. The engine thread waits on the device with the GIL released;
    when the step is done it must win the GIL back from the event loop thread, which under load is busy writing
    messages. Python makes it wait up to the switch interval (5 ms by default, longer than a decode step on a GPU)."""
    import signal
    import sys

    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    # Handlers first: a SIGTERM sent as soon as the startup line appears must drain, not kill the process.
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = Server(**server_kwargs)
    server.drain_grace, server.switch_interval = grace, switch_interval
    port = await server.start()
    failed = server.engine_failed
    print(f"jphoton: gRPC on {server.host}:{port} (jphoton.v1.Engine, grpc.health.v1.Health, reflection)"
          + (f", {server.frontends} frontend processes" if server.frontends > 1 else "")
          + (f", metrics on http://{server.host}:{server.metrics_port}/metrics" if server.metrics_port else ""),
          flush=True)
    load = asyncio.create_task(server.load(model))
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({load, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if load.done() and not stopping.done():
            load.result()  # a load failure ends the process with its error
            if not failed.done():
                print("jphoton: SERVING", flush=True)
            await asyncio.wait({stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
        if failed.done():
            print(f"jphoton: the engine is gone ({failed.result()}); exiting (status {ENGINE_FAILED_EXIT}) so that a "
                  "supervisor restarts the server", file=sys.stderr, flush=True)
        elif load.done():
            print(f"jphoton: shutting down (draining for up to {grace:.0f} s)", flush=True)
        else:
            print("jphoton: shutting down (the model was still loading)", flush=True)
    finally:
        stopping.cancel()
        await server.stop(FAILED_GRACE_S if failed.done() else grace)
        _settle(load)  # interrupted while loading: nothing to serve; the loader thread is a daemon
        _ignore_signals(loop, signal.SIGINT, signal.SIGTERM)
    if failed.done():
        raise EngineDied(failed.result())


def _ignore_signals(loop: asyncio.AbstractEventLoop, *signals: int) -> None:
    """Stopped: later signals are ignored. Python 3.11's loop.close() closes its wake-up pipe before it removes its
    signal handlers, so a SIGTERM in between (a frontend told to stop as it exits) printed a traceback."""
    for sig in signals:
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)


def _settle(load: asyncio.Task) -> None:
    """Cancel the load if it is still running, or take its outcome: stopped while the engine process was building its
    LLM, the load fails with EngineDied, which is no error then (asyncio would log it as never retrieved)."""
    if not load.done():
        load.cancel()
    elif not load.cancelled() and load.exception() is not None:
        log.debug("the load ended with %r at stop", load.exception())


LOADER_THREAD = "jphoton-load"  # the model loader's thread (jphoton serve checks for it at exit)


def _in_daemon_thread(fn: Callable[[], object]) -> asyncio.Future:
    """Run fn in a daemon thread (not asyncio.to_thread: exiting would wait for a model that is still compiling)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def work() -> None:
        try:
            outcome = (True, fn())
        except BaseException as e:
            outcome = (False, e)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: the server stopped while the model was loading
            pass

    threading.Thread(target=work, name=LOADER_THREAD, daemon=True).start()
    return future

