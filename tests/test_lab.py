"""Every lab probe's main path on a tiny model on the CPU (lab/README.md; their numbers come from device runs): a probe
that no longer runs against today's code fails here, not on the device. Most run in this process (runpy, as
`python lab/...` would); the ones that are processes by design (a server, child trees, a pytest plugin) run as one."""

from __future__ import annotations

import gc
import json
import os
import pathlib
import re
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = "random:smollm2-135m:layers=2:vocab=512"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def run_probe(capsys, path: str, *args: str) -> str:
    """Runs lab/<path> as __main__ with argv `args` in this process; returns its stdout. Restores what probes change
    process-wide (sys.argv, sys.path, GC callbacks and thresholds)."""
    argv, path_, callbacks, threshold = sys.argv, list(sys.path), list(gc.callbacks), gc.get_threshold()
    sys.argv = [str(ROOT / path), *args]
    try:
        runpy.run_path(str(ROOT / path), run_name="__main__")
    finally:
        sys.argv, sys.path[:], gc.callbacks[:] = argv, path_, callbacks
        gc.set_threshold(*threshold)
    return capsys.readouterr().out


def _lab_files() -> list[str]:
    """lab/'s files: git's where this is a checkout (a probe still being written is no one's smoke test yet)."""
    try:
        return subprocess.run(["git", "ls-files", "lab"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(ROOT)) for p in (ROOT / "lab").rglob("*") if p.is_file()]


def test_every_probe_has_a_smoke_test():
    files = _lab_files()
    probes = {f for f in files if f.endswith(".py") and not f.endswith("__init__.py")}
    here = set(re.findall(r'"(lab/[\w/]+\.py)"', pathlib.Path(__file__).read_text()))
    untested = {p for p in probes - here if (ROOT / p).read_text().find("__main__") >= 0}
    assert not untested, f"lab probes without a smoke test here: {sorted(untested)}"
    stray = [f for f in files if f.endswith(".diff") or re.search(r"/issue\d", f)]
    assert not stray, f"no patches or per-issue scripts in lab/ (docs/decisions.md cites the commit instead): {stray}"
    # the lab stays a small room: ~2,500 lines of probes, and only results that docs/decisions.md cites (<= 1 MB)
    assert sum(len((ROOT / f).read_text().splitlines()) for f in probes) <= 2600
    assert sum((ROOT / f).stat().st_size for f in files if f.startswith("lab/results/")) <= 2**20


def test_host_sim(capsys):
    out = run_probe(capsys, "lab/probes/host_sim.py", "--concurrency", "4", "--prompt-len", "16", "--new-tokens", "8",
                    "--rounds", "1", "--requests-per-client", "2")
    assert [ln.split('"scenario": "')[1].split('"')[0] for ln in out.splitlines()] == ["static", "staggered"]
    assert '"tick_us"' in out


def test_choice_cost(capsys):  # (the embedded model: options are text)
    out = run_probe(capsys, "lab/probes/choice_cost.py", "--grid", "2x1", "--stream-tokens", "16")
    assert "N=    2 T=  1" in out and "choice" in out


def test_leaf_dispatch(capsys):
    assert "RESULT" in run_probe(capsys, "lab/probes/leaf_dispatch.py", "--leaves", "2", "--calls", "10")


def test_append_cost(capsys):
    assert "us a 2-row commit" in run_probe(capsys, "lab/probes/append_cost.py", "--rows", "2", "--tokens", "8")


def test_mask_fill(capsys):
    assert "32 rows, executor default" in run_probe(capsys, "lab/probes/mask_fill.py")


def test_compact_cost(capsys):
    out = run_probe(capsys, "lab/probes/compact_cost.py", "--rows", "1", "--vocab", "4096", "--settings", "50,0.9",
                    "--iters", "2")
    assert "top_k   50 top_p 0.9: cap" in out


def test_greedy_tokens(capsys):
    out = run_probe(capsys, "lab/probes/greedy_tokens.py", "--model", TINY, "--concurrency", "2", "--prompt-len", "16",
                    "--new-tokens", "6", "--llm-args", "warmup='off'")
    assert '"digest"' in out


def test_staggered_ticks(capsys):
    out = run_probe(capsys, "lab/probes/staggered_ticks.py", "--model", TINY, "--concurrency", "2", "--prompt-len",
                    "16", "--new-tokens", "8", "--requests-per-client", "2", "--llm-args", "warmup='off'")
    assert '"bubbles"' in out and '"staggered_tok_s"' in out


def test_prefill_cost(capsys):
    assert "ms to the first token" in run_probe(capsys, "lab/probes/prefill_cost.py", "--model", TINY, "--lengths",
                                                "16", "--runs", "1")


def test_lower_profile(capsys):
    assert '"lower_s"' in run_probe(capsys, "lab/probes/lower_profile.py", TINY, "--top", "3")


def test_decode_matmul(capsys):
    out = run_probe(capsys, "lab/decode_matmul.py", "--smoke", "--shapes", "down", "--m", "1")
    assert "best per shape and M" in out


def test_thread_cpu(capsys):
    child = subprocess.Popen([sys.executable, "-c", "import time; t = time.time()\nwhile time.time() < t + 1: pass"])
    reaper = threading.Thread(target=child.wait)  # the probe samples until /proc/PID is gone: a zombie stays there
    reaper.start()
    out = run_probe(capsys, "lab/probes/thread_cpu.py", str(child.pid), "--interval", "0.2")
    reaper.join()
    assert "samples with the main thread busy" in out


def test_pytest_compile_count(tmp_path):
    (tmp_path / "test_one.py").write_text("import jax\n\ndef test_jit():\n    jax.jit(lambda x: x + 1)(1)\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "pytest_compile_count", "-p", "no:cacheprovider",
                           "-c", str(tmp_path / "pytest.ini"), str(tmp_path / "test_one.py")], cwd=tmp_path,
                          env={**ENV, "PYTHONPATH": str(ROOT / "lab")}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"XLA compiles in this run: [1-9]", proc.stdout), proc.stdout


def test_ab_trees(tmp_path):
    proc = subprocess.run([sys.executable, "lab/ab_trees.py", "--trees", f"here={ROOT}", "--rounds", "1", "--model",
                           TINY, "--cases", "b1-ctx512", "--new-tokens", "8", "--out", str(tmp_path / "ab.json")],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "b1-ctx512: median of rounds here" in proc.stdout and (tmp_path / "ab.json").is_file()


def test_serve_tree():
    grpc = pytest.importorskip("grpc")
    try:
        from jphoton.server import jphoton_pb2 as pb
        from jphoton.server import jphoton_pb2_grpc as pb_grpc
    except ImportError:
        from jphoton.server import jphoton_pb2 as pb
        from jphoton.server import jphoton_pb2_grpc as pb_grpc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "lab/serve_tree.py", "--model", TINY, "--concurrency", "2",
                               "--prompt-len", "16", "--new-tokens", "8", "--port", str(port)], cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 240
        while not any("SERVING" in ln for ln in lines):
            line = server.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)[-4000:]
            lines.append(line)
        stub = pb_grpc.EngineStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(1, 17))),
                                     sampling=pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert sum(len(m.token_ids) for m in stub.Generate(request, timeout=60)) == 4
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.communicate(timeout=60)
        finally:
            server.kill()


def test_program_memory(capsys):
    out = run_probe(capsys, "lab/probes/program_memory.py", "--model", TINY, "--steps", "1", "--options",
                    '{"max_num_seqs": 2, "max_model_len": 64, "dtype": "float32"}')
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert rows[0]["shapes"] >= 1 and rows[1]["program"].startswith("step ") and rows[1]["args_gib"] > 0, rows


def test_image_latency(capsys):
    out = run_probe(capsys, "lab/probes/image_latency.py", "--smoke")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert rows[0]["prepare_ms"] > 0 and rows[0]["steps"][0]["kind"] == "prefill", rows[0]
    assert rows[-1]["run"] == "profiled" and rows[-1]["kernels"] > 0, rows[-1]
