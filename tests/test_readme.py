"""README.md runs as written.

Conventions of the README's fenced blocks:
- Every ```python block of README.md (and of docs/own-model.md, which it links) runs, in order, in one namespace, in
  one subprocess per file whose cwd is the repository root (no engine state leaks into the pytest process). Each block
  must print something.
- Every line of a ```bash block is a `jphoton ...` (or `.venv/bin/jphoton ...`) command, a comment or blank; each command
  runs as `python -m jphoton ...`, in order, in one fresh temporary directory (relative paths land there), and must exit
  0 within a timeout. `jphoton serve` is the exception: it is started with its `--port`/`--metrics-port` values replaced
  by free ports, must print its startup line and open its port, and is then stopped with SIGTERM.
- A block whose fence is preceded by the line `<!-- not run: REASON -->` is not run (bootstrap.sh, GPU-only commands).
The parse must find at least MIN_PYTHON_BLOCKS python blocks and MIN_CLI_COMMANDS commands, so that a changed
convention cannot make this test pass on nothing.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
OWN_MODEL = ROOT / "docs" / "own-model.md"  # the README's longer example, linked from it
MIN_PYTHON_BLOCKS = 4
MIN_CLI_COMMANDS = 4
MAX_LINES = 160  # (Bazel got a section of its own: issue 61)
NOT_RUN = re.compile(r"^<!--\s*not run:.*-->$")


def parse_blocks(text: str) -> list[tuple[str, str, bool]]:
    """(language, body, runs) for every fenced block, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        previous = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        blocks.append((m.group(1), "\n".join(lines[i + 1:end]) + "\n", not NOT_RUN.match(previous)))
        i = end + 1
    return blocks


def python_blocks(path: pathlib.Path = README) -> list[str]:
    return [body for lang, body, runs in parse_blocks(path.read_text()) if lang == "python" and runs]


def cli_commands() -> list[list[str]]:
    """The argv after `jphoton` of each command in the bash blocks that run."""
    commands = []
    for lang, body, runs in parse_blocks(README.read_text()):
        if lang != "bash" or not runs:
            continue
        for line in body.splitlines():
            argv = shlex.split(line, comments=True)
            if not argv:
                continue
            assert argv[0] in ("jphoton", ".venv/bin/jphoton"), f"a README bash line that is not a jphoton command: " \
                f"{line!r} (mark its block <!-- not run: REASON --> if it should not run)"
            assert not {"&&", "||", ";", "|"} & set(argv), f"one command per line, please: {line!r}"
            commands.append(argv[1:])
    return commands


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "PYTHONUNBUFFERED": "1"}


def test_the_readme_parses_into_enough_blocks():
    assert len(python_blocks()) >= MIN_PYTHON_BLOCKS
    assert len(python_blocks(OWN_MODEL)) == 1
    commands = cli_commands()
    assert len(commands) >= MIN_CLI_COMMANDS
    assert {c[0] for c in commands} >= {"generate", "convert", "serve"}


RUNNER = textwrap.dedent("""
    import contextlib, io, json, sys, time
    blocks = json.load(open(sys.argv[1]))
    namespace = {"__name__": "__main__"}
    for i, block in enumerate(blocks):
        out, t0 = io.StringIO(), time.perf_counter()
        with contextlib.redirect_stdout(out):
            exec(compile(block, f"README python block {i}", "exec"), namespace)
        print(f"--- block {i} ({time.perf_counter() - t0:.1f} s):\\n{out.getvalue()}", flush=True)
        if not out.getvalue().strip():
            sys.exit(f"README python block {i} printed nothing:\\n{block}")
    """)


@pytest.mark.parametrize("path", [README, OWN_MODEL], ids=lambda p: p.name)
def test_the_python_blocks_run(path, tmp_path):
    import json

    (tmp_path / "blocks.json").write_text(json.dumps(python_blocks(path)))
    (tmp_path / "runner.py").write_text(RUNNER)
    proc = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json")], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_free_ports(argv: list[str]) -> list[str]:
    argv = list(argv)
    for flag in ("--port", "--metrics-port"):
        if flag in argv:
            argv[argv.index(flag) + 1] = str(_free_port())
    if "--port" not in argv:
        argv += ["--port", str(_free_port())]
    return argv


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _run_serve(argv: list[str], cwd: pathlib.Path) -> None:
    argv = _with_free_ports(argv)
    port = int(argv[argv.index("--port") + 1])
    proc = subprocess.Popen([sys.executable, "-m", "jphoton", *argv], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # the startup line comes as soon as the port is open, before the model loads
        assert line.startswith(f"jphoton: gRPC on 127.0.0.1:{port}"), f"jphoton {shlex.join(argv)}: {line!r}"
        assert _port_open(port)
        if "--metrics-port" in argv:
            assert _port_open(int(argv[argv.index("--metrics-port") + 1]))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, f"jphoton {shlex.join(argv)} exited {proc.returncode} on SIGTERM: {rest}"


def test_the_readme_cli_commands_run(tmp_path):
    for argv in cli_commands():
        if argv[0] == "serve" and "--help" not in argv:
            _run_serve(argv, tmp_path)
            continue
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "jphoton", *argv], cwd=tmp_path, env=_env(), capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, f"jphoton {shlex.join(argv)}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
        if argv[0] == "generate":
            assert proc.stdout.strip(), f"jphoton {shlex.join(argv)} printed no text ({time.perf_counter() - t0:.0f} s)"


def test_python_m_jphoton_help_lists_the_commands():
    proc = subprocess.run([sys.executable, "-m", "jphoton", "--help"], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and all(c in proc.stdout for c in ("generate", "convert", "serve"))


def test_every_engine_option_is_in_the_readme_table():
    from jphoton.engine.config import _GROUPED, EngineConfig

    text = README.read_text()
    section = text.split("## Options", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", section, re.M))
    assert sorted(rows) == sorted(EngineConfig.option_names()), "README option table vs EngineConfig.option_names()"
    assert "`tokenizer=`" in section and "`config=`" in section
    config = EngineConfig()
    for name, default in rows.items():
        group, field = _GROUPED.get(name, (None, name))
        actual = getattr(getattr(config, group) if group else config, field)
        assert default == (f'"{actual}"' if isinstance(actual, str) else repr(actual)), f"README default of {name}"


def test_the_readme_stays_short_and_wrapped():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines"
    long = [line for line in lines if len(line) > 120 and not line.startswith("|")]  # table rows may be longer
    assert not long, f"README.md lines over 120 columns: {long}"
