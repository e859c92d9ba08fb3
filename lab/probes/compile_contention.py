"""What slows a running decode while step shapes compile in the background (issue 22): the Python trace (GIL), XLA's
compile (CPU threads, GPU autotuning), or plain CPU load.
    python lab/probes/compile_contention.py [--model random:llama3.2-1b] [--shapes 8] [--seconds 8]
A B=1 decode loop (64-token requests back to back) runs in the main thread through the phases; a second thread does:
idle; trace (lower) 3N shapes without compiling; N more with the warm-up's `polite_profile` hook; compile N of the
first programs one at a time (the persistent cache on, as `LLM()` sets it); N more with the persistent cache off; N
more from a thread at nice 10; serialize the compiled programs (what the persistent cache writes, and what a compile
worker process would send); load them back (`deserialize_and_load`: a worker process's programs arriving); a numpy
matmul on every core (CPU load without the GIL and the GPU); N compiles in a second process (a compile worker: no
GIL shared), with XLA's defaults, with GPU autotuning off, and with one LLVM compile thread; idle again.
Prints tok/s per phase (mean, median, p10) and mean / idle."""

import argparse
import json
import os
import statistics
import threading
import time

import numpy as np

from jphoton import LLM, SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="random:llama3.2-1b")
ap.add_argument("--shapes", type=int, default=8)
ap.add_argument("--seconds", type=float, default=8.0)
ap.add_argument("--phases", nargs="+", default=None, help="a subset of the phases, in order")
ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)  # the second process
args = ap.parse_args()
if args.compile_only:
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    llm = LLM(args.model, warmup="off", progress=False, num_kv_pages=256)
    programs = [p for s in llm.engine.runner.sched.all_shapes()[-args.shapes:] for p in llm.engine.runner.lower_step(s)]
    print("COMPILING", flush=True)
    for p in programs:
        p.compile()
    print("DONE", flush=True)
    raise SystemExit(0)
llm = LLM(args.model, warmup="off", progress=False)
runner = llm.engine.runner
prompt = {"prompt_token_ids": list(range(1, 65))}
params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
for _ in range(10):
    llm.generate(prompt, params)  # compiles what B=1 uses
shapes = [s for s in runner.sched.all_shapes() if s.prefill_rows][-4 * args.shapes:]  # (the largest: not used above)


def decode_while(work) -> dict:
    done = threading.Event()
    rates, t_work, busy = [], [0.0], []  # busy: request seconds while the work ran

    def background():
        t = time.perf_counter()
        work()
        t_work[0] = time.perf_counter() - t
        done.set()

    th = threading.Thread(target=background, daemon=True)
    t0 = time.perf_counter()
    th.start()
    while not done.is_set() or time.perf_counter() - t0 < args.seconds:
        t, working = time.perf_counter(), not done.is_set()
        llm.generate(prompt, params)
        rates.append(64 / (time.perf_counter() - t))
        if working:
            busy.append(time.perf_counter() - t)
        if done.is_set() and time.perf_counter() - t0 >= args.seconds:
            break
    th.join()
    return {"tok_s": statistics.mean(rates), "median": statistics.median(rates),
            "p10": float(np.percentile(rates, 10)), "requests": len(rates), "work_s": round(t_work[0], 2),
            "tok_s_while_working": 64 * len(busy) / sum(busy) if busy else None}


def _until(seconds, fn):
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        fn()


def _compile(programs, cache=True, nice=0):
    import jax

    jax.config.update("jax_enable_compilation_cache", cache)
    if nice:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)  # this thread (and threads it starts)
    out = [p.compile() for p in programs]
    jax.config.update("jax_enable_compilation_cache", True)
    return out


compiled, serialized, costs = [], [], {"serialize_s": [], "load_s": [], "bytes": []}


def _compile_keep(programs, **kw):
    compiled.extend(_compile(programs, **kw))


def _serialize():
    from jax.experimental.serialize_executable import serialize

    for c in compiled:
        t = time.perf_counter()
        serialized.append(serialize(c))
        costs["serialize_s"].append(time.perf_counter() - t)
        costs["bytes"].append(len(serialized[-1][0]))


def _load():
    from jax.experimental.serialize_executable import deserialize_and_load

    for payload, in_tree, out_tree in serialized:
        t = time.perf_counter()
        deserialize_and_load(payload, in_tree, out_tree)
        costs["load_s"].append(time.perf_counter() - t)


def _in_process(flags: str):
    """Compile N shapes in a second process; returns once it starts compiling, the work ends when it is done."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
    proc = subprocess.Popen([sys.executable, __file__, "--compile-only", "--model", args.model,
                             "--shapes", str(args.shapes)], env=env, stdout=subprocess.PIPE, text=True)
    started = threading.Event()

    def read():
        for line in proc.stdout:
            if line.startswith("COMPILING"):
                started.set()
        started.set()

    threading.Thread(target=read, daemon=True).start()
    started.wait()
    return proc


def _polite(fn):
    import sys

    from jphoton.engine.warmup import polite_profile

    sys.setprofile(polite_profile())
    try:
        fn()
    finally:
        sys.setprofile(None)


lowered = []
a = np.random.rand(2048, 2048).astype(np.float32)
phases = {
    "idle": lambda: time.sleep(args.seconds),
    "trace": lambda: lowered.extend(runner.lower_step(s)[0] for s in shapes[:3 * args.shapes]),
    "trace_polite": lambda: _polite(lambda: [runner.lower_step(s) for s in shapes[3 * args.shapes:]]),
    "compile": lambda: _compile_keep(lowered[:args.shapes]),
    "compile_no_cache": lambda: _compile(lowered[args.shapes:2 * args.shapes], cache=False),
    "compile_nice10": lambda: _compile(lowered[2 * args.shapes:], nice=10),
    "serialize": _serialize,
    "load": _load,
    "cpu_load": lambda: _until(args.seconds, lambda: a @ a),
    "compile_process": "",
    "compile_process_autotune0": "--xla_gpu_autotune_level=0",
    "compile_process_par1": "--xla_gpu_force_compilation_parallelism=1",
    "idle_after": lambda: time.sleep(args.seconds),
}
out = {}
for name, work in phases.items():
    if args.phases and name not in args.phases:
        continue
    if isinstance(work, str):  # a second process: decode measured from its first compile to its last
        work = _in_process(work).wait
    out[name] = decode_while(work)
    print(name, out[name], flush=True)
base = statistics.mean(out[k]["tok_s"] for k in ("idle", "idle_after") if k in out)
costs = {k: [round(x, 4) for x in v] for k, v in costs.items()}
print(json.dumps({"model": args.model, "shapes": len(shapes), "costs": costs,
                  "ratio_to_idle": {k: round(v["tok_s"] / base, 3) for k, v in out.items()}, "phases": out}))
