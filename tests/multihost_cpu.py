"""The engine over two processes (`jax.distributed`), one CPU device each, tensor parallel over both: the multi-host
layout of docs/tensor-parallel.md on one machine. Each process builds the same LLM, runs the same requests (every
process plans the same ticks), and reports its tokens; `main` checks them against HF's greedy tokens
(tests/test_tensor_parallel.py runs it).

    python tests/multihost_cpu.py            # starts the two processes
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAMILY = ROOT / "tests" / "fixtures" / "tiny" / "llama3"


def child(process_id: int, port: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    import numpy as np

    from jphoton import LLM, SamplingParams

    ref = np.load(FAMILY / "reference.npz")
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(4)]
    # warm-up off: each process compiles the shapes its ticks use, in the same order (every process plans alike)
    llm = LLM(FAMILY, tensor_parallel_size=2, dtype="float32", warmup="off", max_num_seqs=4,
              max_num_batched_tokens=64, decode_buckets=(4,), prefill_buckets=((2, 32),), progress=False)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    print("TOKENS", json.dumps([o.token_ids for o in out]), flush=True)
    jax.distributed.shutdown()


def main() -> list[str]:
    """Runs both processes; returns a line per process saying what went wrong (empty: both gave HF's tokens)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JPHOTON_XLA_CACHE": "0",
           "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(i), str(port)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    import numpy as np

    ref = np.load(FAMILY / "reference.npz")
    want = [ref[f"tokens_{i}"].tolist() for i in range(4)]
    problems = []
    for i, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        lines = [line for line in text.splitlines() if line.startswith("TOKENS ")]
        got = json.loads(lines[0][7:]) if lines else None
        print(f"process {i}: exit {p.returncode}, tokens == HF greedy: {got == want}")
        if got != want or p.returncode:
            problems.append(f"process {i} (exit {p.returncode}): {text[-2000:]}")
    return problems


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]))
    else:
        sys.exit(1 if main() else 0)
