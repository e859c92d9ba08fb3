"""Compiling the engine's step shapes so that the first request is served in seconds and nothing compiles once warm.

Modes (`EngineConfig.warmup`): "background" (the default: the shapes a first request needs, the smallest decode step
and one prefill step, compile before `LLM()` returns; every other shape and second sampler compiles in the background,
one XLA compile at a time, while the scheduler plans only with ready shapes, `Scheduler.ready`, and a shape a plan
could not use goes to the front of the queue, `Scheduler.wanted`); "full" (every shape before `LLM()` returns); "off"
(a shape compiles when a step first needs it: tests, probes). Background compiles run in a second process on a GPU with
one device (engine/compile_worker.py), else, and if it fails (logged), on this process's threads, where tracing one
program (holds the GIL) overlaps the XLA compile of the previous one (releases it). Why: docs/step-shapes.md, items 4-9.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import itertools
import logging
import queue
import sys
import threading
import time
import weakref

from jphoton.engine import compile_worker
from jphoton.engine.config import WARMUP, EngineConfig
from jphoton.engine.plan import StepShape
from jphoton.engine.scheduler import Scheduler

log = logging.getLogger("jphoton.engine")

MODES = WARMUP
FIRST_PREFILL_TOKENS = 128  # the first tier's prefill bucket: the largest one-row bucket up to this many tokens
FIRST_CONTEXT_TOKENS = 512  # ... over the smallest context bucket of at least this many tokens
YIELD_EVERY_S = 0.0002  # the tracing thread hands the GIL over at least this often (`polite_profile`)
# LLM.run_programs_once on the CPU backend too (tests): there a program's first run costs nothing extra, and it is real
# compute (an interpret-mode Pallas step: seconds), so by default it is skipped
FIRST_RUNS_ON_CPU = False


def first_shapes(shapes: list[StepShape], scheduler: Scheduler) -> list[StepShape]:
    """The shapes a first request needs: a prefill-only step (the fewest rows, <= 128 tokens a row if there is such a
    bucket, the smallest context bucket) and the smallest decode-only step (static attention: at the largest context
    bucket, which serves any context)."""
    cfg = scheduler.config
    decode_ctx = cfg.context_buckets[-1] if cfg.context_buckets else 0
    decode = min((s for s in shapes if not s.prefill_rows and s.ctx_pages == decode_ctx), key=lambda s: s.decode_rows)
    prefill_only = [s for s in shapes if s.prefill_rows and not s.decode_rows]
    # The smallest context bucket that holds FIRST_CONTEXT_TOKENS: a first prompt of up to that many tokens runs (in
    # chunks) without waiting for another compile; smaller buckets come first in the background.
    ctxs = sorted({s.ctx_pages for s in prefill_only})
    ctx = next((c for c in ctxs if c * cfg.page_size >= FIRST_CONTEXT_TOKENS), ctxs[-1])
    rows = min(s.prefill_rows for s in prefill_only)
    small = sorted((s for s in prefill_only if (s.ctx_pages, s.prefill_rows) == (ctx, rows)),
                   key=lambda s: s.prefill_tokens)
    prefill = max((s for s in small if s.prefill_tokens <= FIRST_PREFILL_TOKENS), default=small[0],
                  key=lambda s: s.prefill_tokens)
    return [prefill, decode]


def background_order(shapes: list[StepShape], first: list[StepShape], scheduler: Scheduler) -> list[StepShape]:
    """The rest, most useful first: the first prefill bucket at longer contexts (long prompts), decode buckets
    ascending (more requests at once), prefill mixed with decode, then everything else by context and size."""
    cfg = scheduler.config
    prefill = first[0]
    rest = [s for s in shapes if s not in first]

    def rank(s: StepShape):
        if not s.decode_rows and (s.prefill_rows, s.prefill_tokens) == (prefill.prefill_rows, prefill.prefill_tokens):
            return (0, s.ctx_pages, 0)
        if not s.prefill_rows:
            return (1, s.decode_rows, s.ctx_pages)
        if s.decode_rows == cfg.mixed_decode_rows and s.prefill_tokens == prefill.prefill_tokens:
            return (2, s.ctx_pages, s.prefill_rows)
        return (3, s.ctx_pages, s.tokens)

    return sorted(rest, key=rank)


class Warmup:
    """Owns the compile of every step shape and second sampler for one engine (module docstring)."""

    def __init__(self, runner, scheduler: Scheduler, mode: str = "background", progress: bool = False,
                 worker: EngineConfig | None = None):
        """worker: the engine's config, to compile the background shapes in a second process (module docstring)."""
        if mode not in MODES:
            raise ValueError(f"warmup must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        self.runner, self.scheduler, self.mode, self.progress = runner, scheduler, mode, progress
        self.shapes = scheduler.config.all_shapes()
        self.samplers = runner.sampler_variants()
        self.filtered = runner.filtered_shapes()  # the filtered variants (top-k / top-p, automata), compiled last
        self.compiled: set[StepShape] = set()
        self.samplers_compiled = 0
        self.first_token_s: float | None = None  # seconds until the first tier was ready
        self.all_ready_s: float | None = None  # seconds until every shape and sampler was ready
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.worker_config = worker
        self._worker: compile_worker.CompileWorker | None = None
        self.path = "in-process"  # where the background compiles ran: "worker" or "in-process" (stats())
        self._atexit = None
        self._t0 = time.perf_counter()

    # ---- public ----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Compile what the mode says must exist before serving; in "background" start the thread for the rest."""
        self._t0 = time.perf_counter()
        if self.mode == "off":
            self._done.set()
            return
        self.runner.filtered_ready = set()  # until a variant is compiled, its steps sample through the second sampler
        if self.mode == "full":
            self.runner.warmup(self.shapes, progress=self.progress)
            self.compiled.update(self.shapes)
            self.samplers_compiled = len(self.samplers)
            self._finish()
            return
        first = first_shapes(self.shapes, self.scheduler)
        jobs = [functools.partial(self.runner.compile_step, s) for s in first]
        vision = getattr(self.runner, "vision", None)
        if vision is not None:  # an image model: the vision step at its largest crop bucket (serves every image)
            jobs.append(functools.partial(self.runner.compile_vision, vision.crop_buckets[-1]))
        with concurrent.futures.ThreadPoolExecutor(len(jobs), thread_name_prefix="jphoton-compile") as pool:
            list(pool.map(lambda job: job(), jobs))
        self.compiled.update(first)
        self.first_token_s = time.perf_counter() - self._t0
        self.scheduler.ready = frozenset(self.compiled)
        log.info("first step shapes compiled in %.1fs (%d of %d): serving; the rest compile in the background",
                 self.first_token_s, len(first), len(self.shapes))
        tasks = self._tasks(background_order(self.shapes, first, self.scheduler))
        self._thread = threading.Thread(target=self._run, args=(tasks,),
                                        name="jphoton-warmup", daemon=True)
        # Never leave the interpreter while this thread is inside XLA: at exit, stop after the compile in progress. A
        # weak reference, so that the hook does not keep a dropped engine's device buffers alive.
        self._atexit = functools.partial(_stop_at_exit, weakref.ref(self))
        atexit.register(self._atexit)
        self._thread.start()

    @property
    def all_ready(self) -> bool:
        """Every shape compiled (or warmup="off": nothing to wait for); False after a failure or an early stop."""
        return self._done.is_set() and self.error is None and (self.mode == "off" or self.all_ready_s is not None)

    @property
    def running(self) -> bool:
        """The background thread is still compiling."""
        return self._thread is not None and not self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every shape is ready (True) or the timeout passes (False). Raises what the thread raised."""
        done = self._done.wait(timeout)
        if self.error is not None:
            raise RuntimeError("compiling the step shapes failed") from self.error
        return done

    def stop(self) -> None:
        """Let the thread finish the compile it is in, then end it (process exit; the engine's shapes stay partial)."""
        self._stop.set()
        if self._worker is not None:
            self._worker.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def ready_programs(self) -> list[tuple]:
        """The programs compiled so far, as `Runner.install` keys: every one once all are ready, before that the
        ready shapes' base steps (warmup="off": none; they compile at first use)."""
        if self.mode == "off":
            return []
        if self.all_ready:
            tasks = ([("step", s, False) for s in self.shapes] + [("step", s, True) for s in self.filtered]
                     + [("sampler", v) for v in self.samplers])
        else:  # (scheduler.ready is a frozenset the warm-up thread replaces whole: safe to read here)
            tasks = [("step", s, False) for s in self.scheduler.ready or ()]
        return [key for t in tasks for key in compile_worker.program_keys(t, self.runner.lora_enabled)]

    def stats(self) -> dict:
        filtered = len(self.runner.filtered_ready or ()) if self.mode != "off" else 0
        return {"shapes_compiled": len(self.compiled) + filtered,
                "shapes_total": len(self.shapes) + (len(self.filtered) if self.mode != "off" else 0),
                "all_shapes_ready": self.all_ready, "compile_path": self.path,
                "programs_run_once": len(self.runner.first_ran)}

    # ---- the background thread -------------------------------------------------------------------------------------
    def _tasks(self, queue: list[StepShape]) -> list[tuple]:
        """Every background task in compile order (compile_worker.py's tasks): the queue's shapes, the second samplers
        once the decode buckets are in, the filtered variants (top-k / top-p, device automata) last."""
        tasks, samplers = [], [("sampler", v) for v in self.samplers]
        decode_left = sum(1 for s in queue if not s.prefill_rows)
        for shape in queue:
            tasks.append(("step", shape, False))
            decode_left -= not shape.prefill_rows
            if decode_left <= 0:
                tasks += samplers
                samplers = []
        # an image model's vision step at each crop bucket: right after the first tier
        vision = getattr(self.runner, "vision", None)
        buckets = [("vision", b) for b in (vision.crop_buckets if vision is not None else ()) if b not in
                   self.runner.vision_ready]
        return buckets + tasks + samplers + [("step", s, True) for s in self.filtered]

    def _wanted(self, tasks: list[tuple]) -> tuple | None:
        """The task of the shape a plan could not use (`Scheduler.wanted`), if it is still to do."""
        wanted, self.scheduler.wanted = self.scheduler.wanted, None
        task = ("step", wanted, False)
        return task if wanted is not None and task in tasks else None

    def _run(self, tasks: list[tuple]) -> None:
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(tasks), desc="compiling step shapes (serving meanwhile)", unit="shape", leave=False)
        try:
            if self.worker_config is not None:
                try:
                    self._run_worker(tasks, bar)
                except Exception as e:  # noqa: BLE001 -- logged; this process compiles the rest
                    if not self._stop.is_set():
                        log.warning("compile worker failed (%s): compiling the remaining %d programs in this "
                                    "process", e, len(tasks))
            if tasks and not self._stop.is_set():
                self.path = "in-process"
                self._run_here(tasks, bar)
        except BaseException as e:  # noqa: BLE001 -- reported by stats() and wait(), logged here
            self.error = e
            log.exception("background compile failed: the engine keeps serving with the %d ready shapes",
                          len(self.compiled))
        finally:
            if bar is not None:
                bar.close()
        if not self._stop.is_set() and self.error is None:
            self._finish()
        else:
            self._done.set()
        atexit.unregister(self._atexit)

    def _run_worker(self, tasks: list[tuple], bar) -> None:
        """The tasks in a second process: load each program it sends, mark a task ready when all of its programs are
        in. Raises if the process fails; `tasks` keeps what is left."""
        import jax

        r, cfg = self.runner, self.worker_config
        spec = compile_worker.Spec(
            model_config=r.model.config, recipe=r.model.recipe,
            params=jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), r.params),
            engine_config=cfg, num_pages=cfg.num_kv_pages, tasks=list(tasks), jax_options=compile_worker.jax_options())
        self.path = "worker"
        self._worker = worker = compile_worker.CompileWorker(spec)
        log.info("compiling %d background programs in a second process (pid %d)", len(tasks), worker.proc.pid)
        try:
            for msg in worker.messages():
                if self._stop.is_set():  # (also when stop() came before the worker existed)
                    worker.stop()
                if msg is None:
                    if self._stop.is_set():
                        return
                    raise RuntimeError("the compile worker exited early (its output above says why)")
                if msg[0] == "program":
                    _, key, payload, in_tree, out_tree = msg
                    r.install(key, compile_worker.load(payload, in_tree, out_tree, r.device))
                elif msg[0] == "done":
                    tasks.remove(msg[1])
                    self._mark_ready(msg[1])
                    if bar is not None:
                        bar.update()
                elif msg[0] == "error":
                    raise RuntimeError(msg[1])
                if (wanted := self._wanted(tasks)) is not None:
                    worker.want(wanted)
        finally:
            worker.close()

    def _run_here(self, tasks: list[tuple], bar) -> None:
        """Two stages: this thread traces the next program (Python, holds the GIL; `polite_profile` hands it to the
        engine often) while a compile thread compiles the previous one (XLA, releases it); one XLA compile at a time
        (docs/step-shapes.md)."""
        pending = None  # (the compile in progress, its task)
        compiler = _CompileThread()
        profiler = sys.getprofile()  # (a profiler's hook, if one was installed for new threads: restored at the end)
        sys.setprofile(polite_profile())  # this thread only
        try:
            for lowered, task in itertools.chain(self._lowered(tasks), [(None, None)]):  # lazily: one ahead
                if pending is not None:
                    pending[0].result()
                    self._mark_ready(pending[1])
                    if bar is not None:
                        bar.update()
                pending = None if lowered is None else (compiler.submit(_compile_all, lowered), task)
        finally:
            sys.setprofile(profiler)
            compiler.shutdown()  # never leave a compile running (process exit)

    def _lowered(self, tasks: list[tuple]):
        """Yields (lowered programs, task) in order, a wanted shape first, taking each task out of `tasks` (the caller
        marks it ready once compiled)."""
        while tasks and not self._stop.is_set():
            task = self._wanted(tasks) or tasks[0]
            tasks.remove(task)
            if task[0] == "sampler":
                yield [self.runner.lower_sampler(task[1])], task
            elif task[0] == "vision":
                yield [self.runner.lower_vision(task[1])], task
            else:
                yield self.runner.lower_step(task[1], filtered=task[2]), task

    def _mark_ready(self, task: tuple) -> None:
        if task[0] == "sampler":
            self._sampler_ready()
        elif task[0] == "vision":
            self.runner.vision_ready.add(task[1])
        elif task[2]:
            self.runner.filtered_ready.add(task[1])
        else:
            self._shape_ready(task[1])

    def _shape_ready(self, shape: StepShape) -> None:
        self.compiled.add(shape)
        self.scheduler.ready = frozenset(self.compiled)

    def _sampler_ready(self) -> None:
        self.samplers_compiled += 1

    def _finish(self) -> None:
        self.all_ready_s = time.perf_counter() - self._t0
        self.scheduler.ready = None  # every shape: the scheduler's unrestricted path
        self._done.set()
        log.info("all %d step shapes ready (%d second samplers, %d filtered variants) in %.1fs",
                 len(self.shapes), len(self.samplers), len(self.filtered), self.all_ready_s)


def polite_profile(every_s: float = YIELD_EVERY_S):
    """A profile hook (`sys.setprofile`) for a thread that traces step shapes while the engine serves. Tracing is
    pure Python and holds the GIL; the engine thread releases the GIL at every wait on the device and would then wait
    up to the interpreter's switch interval (5 ms) to get it back, for every handoff: a B=1 decode ran at 0.05x while
    shapes were traced (docs/decisions.md, 2026-11-27). With the hook the tracing thread sleeps briefly at the first
    call after every `every_s` of tracing, so the engine gets the GIL back within ~0.2 ms; tracing takes 2-3x longer,
    hidden behind the previous shape's XLA compile. (A short switch interval instead shares the GIL evenly and
    slowed the engine's own host work: docs/decisions.md.)"""
    clock, sleep = time.perf_counter, time.sleep
    last = clock()

    def hook(frame, event, arg):
        nonlocal last
        if event == "call" and clock() - last > every_s:
            sleep(1e-6)  # (sleep(0) may take the GIL straight back before a waiting thread wakes)
            last = clock()

    return hook


def _compile_all(lowered: list) -> None:
    for program in lowered:
        program.compile()


class _CompileThread:
    """`_run_here`'s compiles, one at a time, on a daemon thread of its own. Not a ThreadPoolExecutor: at interpreter
    exit concurrent.futures refuses new work before the atexit hook that stops the warm-up has run, and a script that
    ended while shapes were compiling logged "background compile failed" with a traceback."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="jphoton-compile", daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Finish the submitted compiles, then end the thread."""
        self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 -- raised by the waiter's result()
                    future.set_exception(e)


def _stop_at_exit(ref: weakref.ref) -> None:
    warmup = ref()
    if warmup is not None:
        warmup.stop()
