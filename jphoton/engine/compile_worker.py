"""A second process that compiles the engine's background step programs and sends them to the serving process, so that
tracing (Python, holds the GIL) and writing the persistent cache (serializes with the GIL held) never stall its decode:
the serving process only loads each program (`deserialize_and_load`) and calls it (`Runner.install`). The worker
rebuilds the model from its recipe (`models/protocol.py rebuild`) over abstract params of the serving layout and an
abstract runner (`Runner(abstract=True)`): no weights, no KV pool, no preallocated GPU memory (docs/step-shapes.md, 9).
Protocol, frames of a little-endian u64 length + a pickle. serving -> worker (stdin): a `Spec`, then ("want", task)
puts a task first; EOF: stop after the compile in progress. worker -> serving (stdout): ("program", key, payload,
in_tree, out_tree) per program of a task, then ("done", task); ("error", text) on a failure (and exit); ("end",) after
the last task. Tasks: ("step", shape, filtered), ("sampler", variant); keys: ("step", shape, filtered, lora), ("sampler",
variant)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
from typing import Any, BinaryIO

import jphoton

log = logging.getLogger("jphoton.engine")

_LEN = struct.Struct("<Q")
# XLA:CPU programs compiled in one process and loaded in another failed to run for some shapes here (jax 0.10.2: "NOT_FOUND:
# Function wrapped_iota not found", a 135M model's 512-token prefill), so the option is GPU-only; the tests turn this on
# for the tiny models, whose programs load and run.
ALLOW_CPU = False
# JAX options that change what a step lowers to: the worker takes the serving process's values (a notebook may have set
# them at runtime, where the worker's environment would not say so).
LOWERING_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                    "jax_threefry_partitionable", "jax_numpy_rank_promotion", "jax_numpy_dtype_promotion",
                    "jax_enable_compilation_cache", "jax_compilation_cache_dir",
                    "jax_persistent_cache_min_compile_time_secs",
                    "jax_persistent_cache_min_entry_size_bytes")


@dataclasses.dataclass
class Spec:
    """What the worker needs to build the serving process's programs: the model's config, recipe and serving-layout
    param shapes, the engine config, the pool size, the tasks in order and the JAX options that shape a lowering."""

    model_config: Any
    recipe: dict
    params: Any  # jax.ShapeDtypeStruct leaves (no sharding: the worker places them on its device)
    engine_config: Any
    num_pages: int
    tasks: list
    jax_options: dict  # LOWERING_OPTIONS' values in the serving process (`jax_options()`)


def wanted(cfg, model) -> bool:
    """`EngineConfig.compile_worker` for this engine: None (auto) is on for a one-device GPU engine whose model jphoton
    built (its recipe rebuilds the functions); True where that is impossible is a ValueError."""
    import jax

    possible = model.recipe is not None and cfg.tensor_parallel_size == 1
    if cfg.compile_worker and not possible:
        raise ValueError("compile_worker=True needs a model jphoton loads (a path or random:NAME, not a JaxModel) on "
                         "one device (tensor_parallel_size=1)")
    if cfg.compile_worker and jax.default_backend() == "cpu" and not ALLOW_CPU:
        raise ValueError("compile_worker=True needs a GPU (XLA:CPU programs do not always load in another process)")
    if cfg.compile_worker is None:
        return possible and cfg.warmup == "background" and jax.default_backend() == "gpu"
    return cfg.compile_worker and cfg.warmup == "background"


def jax_options() -> dict:
    import jax

    return {name: jax.config.values[name] for name in LOWERING_OPTIONS if name in jax.config.values}


def apply_jax_options(options: dict) -> None:
    import jax

    for name, value in options.items():
        if name in jax.config.values and jax.config.values[name] != value:
            jax.config.update(name, value)


def write_frame(f: BinaryIO, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def read_frame(f: BinaryIO):
    """The next frame's object, or None at EOF."""
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    size = _LEN.unpack(head)[0]
    data = f.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def program_keys(task: tuple, lora_enabled: bool) -> list[tuple]:
    if task[0] == "sampler":
        return [task]
    return [(*task, lora) for lora in ((False, True) if lora_enabled else (False,))]


class CompileWorker:
    """The serving process's handle on the worker (engine/warmup.py drives it)."""

    def __init__(self, spec: Spec):
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        # this jphoton first, wherever it was imported from (a notebook's sys.path, a source tree)
        root = os.path.dirname(os.path.dirname(os.path.abspath(jphoton.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        # (stderr is the serving process's: the worker's log lines and tracebacks show up there). -P: no working
        # directory at the front of sys.path, where a different jphoton source tree would shadow this one.
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "jphoton.engine.compile_worker"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._lock = threading.Lock()
        self._send(spec)

    def _send(self, obj) -> None:
        with self._lock:
            try:
                write_frame(self.proc.stdin, obj)
            except (BrokenPipeError, ValueError, OSError):  # the worker is gone: its messages() end says why
                pass

    def want(self, task: tuple) -> None:
        """Compile `task` next (a step the scheduler could not plan without it)."""
        self._send(("want", task))

    def messages(self):
        """The worker's frames until it ends (None at an EOF without "end": the worker died)."""
        while True:
            msg = read_frame(self.proc.stdout)
            yield msg
            if msg is None or msg[0] in ("end", "error"):
                return

    def stop(self) -> None:
        """Ask the worker to stop: it sends the program it is compiling and exits (`messages()` then ends)."""
        with self._lock:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop the worker and wait for it (a minute at most: it finishes the compile in progress)."""
        self.stop()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def load(payload: bytes, in_tree, out_tree, device):
    """A program the worker sent, loaded on `device` (the engine's one device)."""
    from jax.experimental.serialize_executable import deserialize_and_load

    return deserialize_and_load(payload, in_tree, out_tree, backend=device.client, execution_devices=[device])


# ---- the worker process ---------------------------------------------------------------------------------------------
def _serve(spec: Spec, stdin: BinaryIO, out: BinaryIO) -> None:
    from jax.experimental.serialize_executable import serialize

    from jphoton.engine.runner import Runner
    from jphoton.models import protocol

    apply_jax_options(spec.jax_options)  # (the persistent cache's directory among them)
    model = protocol.rebuild(spec.model_config, spec.params, spec.recipe)
    runner = Runner(model, spec.engine_config, spec.num_pages, abstract=True)
    tasks = list(spec.tasks)
    wanted: list[tuple] = []
    stop = threading.Event()

    def listen():  # "want" frames; EOF: the serving process stopped (or exits)
        while (msg := read_frame(stdin)) is not None:
            if msg[0] == "want":
                wanted.append(msg[1])
        stop.set()

    threading.Thread(target=listen, daemon=True).start()

    def lower(task):
        if task[0] == "sampler":
            return [runner.lower_sampler(task[1])]
        return runner.lower_step(task[1], filtered=task[2])

    def compile_and_send(task, lowered):
        for key, program in zip(program_keys(task, runner.lora_enabled), lowered, strict=True):
            payload, in_tree, out_tree = serialize(program.compile())
            write_frame(out, ("program", key, payload, in_tree, out_tree))
        write_frame(out, ("done", task))

    # Two stages, as in the serving process's own warm-up: trace task n+1 while task n compiles (one XLA compile at
    # a time: concurrent compiles on one GPU ran ~5x slower each, docs/step-shapes.md).
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jphoton-compile") as compiler:
        pending = None
        while tasks and not stop.is_set():
            while wanted:
                w = wanted.pop(0)
                if w in tasks:
                    tasks.remove(w)
                    tasks.insert(0, w)
            task = tasks.pop(0)
            lowered = lower(task)
            if pending is not None:
                pending.result()
            pending = compiler.submit(compile_and_send, task, lowered)
        if pending is not None:
            pending.result()
    if not stop.is_set():
        write_frame(out, ("end",))


def main() -> None:
    # The protocol owns the real stdout; anything else this process prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    logging.basicConfig(level=logging.WARNING, format="jphoton compile worker: %(message)s")
    stdin = sys.stdin.buffer
    spec = read_frame(stdin)
    if spec is None:
        return
    code = 0
    try:
        _serve(spec, stdin, out)
    except BaseException as e:  # noqa: BLE001 -- reported to the serving process, which compiles the rest itself
        import traceback

        traceback.print_exc()
        code = 1
        try:
            write_frame(out, ("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
    # Every program is sent and in the persistent cache: skip the interpreter's teardown, which aborted now and then
    # with the stdin listener still blocked in a read and XLA's clients being destroyed.
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
