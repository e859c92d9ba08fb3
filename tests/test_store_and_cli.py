"""`jphoton convert` (orbax store) round trips; random presets have real shapes; `jphoton generate`'s flags (the README's
commands run in test_readme.py)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jphoton.cli import main
from jphoton.models.llama import param_shapes
from jphoton.weights import load_model
from jphoton.weights.random_init import PRESETS

from conftest import FIXTURES


def test_convert_then_load_store(tmp_path, tiny_models, capsys):
    dest = tmp_path / "store"
    assert main(["convert", str(FIXTURES / "tiny" / "llama3"), str(dest)]) == 0
    src = tiny_models("llama3")
    m = load_model(dest, "float32")
    assert m.loaded_from == "jphoton store" and m.config == src.config.replace(name=m.config.name)
    for name, a in src.params["layers"].items():
        assert np.array_equal(np.asarray(a), np.asarray(m.params["layers"][name])), name
    ref = json.loads((FIXTURES / "tiny" / "llama3" / "tokenizer_reference.json").read_text())
    assert m.tokenizer.encode(ref["texts"][0]) == ref["text_ids"][0]
    assert m.tokenizer.encode_chat(ref["conversation"]) == ref["chat_ids"]
    bf16 = load_model(dest, "bfloat16")
    assert bf16.params["embed"].dtype == jnp.bfloat16
    capsys.readouterr()
    assert main(["convert", str(FIXTURES / "tiny" / "llama3"), str(dest)]) == 2  # never overwrites
    assert "exists and is not empty" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_random_presets_have_real_shapes(name):
    cfg = PRESETS[name]
    n_params = sum(int(np.prod(s)) for s in _leaves(param_shapes(cfg)))
    expected = {"smollm2-135m": 134.5e6, "llama3.2-1b": 1.236e9, "llama3-8b": 8.03e9, "llama3-70b": 70.55e9,
                "qwen3-30b-a3b": 30.53e9}[name]
    assert abs(n_params - expected) / expected < 0.01, n_params


def test_random_model_with_fewer_layers():
    m = load_model("random:llama3.2-1b:layers=1:vocab=1024", "float32")
    assert m.config.num_layers == 1 and m.params["layers"]["wq"].shape == (1, 2048, 2048)
    assert m.params["embed"].shape == (1024, 2048) and m.tokenizer is None


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree


ROOT = pathlib.Path(__file__).parent.parent


def _jphoton(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "jphoton", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_generate_with_a_regex_a_stop_and_logprobs():
    proc = _jphoton("generate", "--temperature", "0", "--max-tokens", "12", "--regex", "[0-9]{3}-[0-9]{2}", "--stop",
                    "-", "--logprobs", "2", "Make up a code.")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.fullmatch(r"[0-9]{3}", proc.stdout.strip()), proc.stdout  # the regex's digits, cut at the stop string
    lines = [ln for ln in proc.stderr.splitlines() if "\t" in ln]
    assert lines and all(ln.count("top: ") == 1 and ln.count("  ") >= 1 for ln in lines), proc.stderr[-2000:]
    summary = re.search(r"jphoton: (\d+) tokens in [\d.]+ s \(first after [\d.]+ s, [\d.]+ tok/s after it\); "
                        r"finish_reason=stop", proc.stderr)
    assert summary and int(summary.group(1)) == len(lines), proc.stderr[-2000:]


def test_generate_flags_are_checked_before_the_model_loads(tmp_path):
    from jphoton.cli import _constraint

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object"}))
    args = type("Args", (), {"json_schema": str(schema), "grammar": None, "regex": None, "choice": None})()
    assert _constraint(args) == {"json_schema": {"type": "object"}}
    schema.write_text("{not json")
    assert main(["generate", "--json-schema", str(schema), "x"]) == 2
    assert main(["generate", "--json-schema", str(tmp_path / "missing.json"), "x"]) == 2
    assert main(["generate", "--logprobs", "-1", "x"]) == 2
    with pytest.raises(SystemExit) as e:
        main(["generate", "--regex", "a", "--choice", "b", "x"])
    assert e.value.code == 2


def test_version():
    proc = _jphoton("--version", timeout=60)
    assert proc.returncode == 0 and re.fullmatch(r"jphoton \d+\.\d+\.\d+", proc.stdout.strip()), proc
