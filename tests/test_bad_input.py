"""Bad input gets a clear ValueError (and a clean non-zero CLI exit), never a crash or a traceback wall."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

from jphoton import SamplingParams
from jphoton.cli import main
from jphoton.weights import load_model

from conftest import FIXTURES, make_llm

TINY = FIXTURES / "tiny"


def test_missing_path():
    with pytest.raises(ValueError, match="does not exist"):
        load_model("/no/such/model", "float32")


def test_unknown_architecture(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(TINY / "llama2", d)
    conf = json.loads((d / "config.json").read_text())
    conf["architectures"] = ["FalconForCausalLM"]
    (d / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="unknown architecture 'FalconForCausalLM'"):
        load_model(d, "float32")


def test_unknown_gguf_architecture(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unknown architecture 'mamba'"):
        load_model(tmp_path / "x.gguf", "float32")


def test_truncated_safetensors(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(TINY / "llama2", d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match="corrupt or truncated safetensors"):
        load_model(d, "float32")


def test_missing_shard(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(TINY / "mistral", d)
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="shards listed in the index are missing"):
        load_model(d, "float32")


def test_checkpoint_with_tensors_the_config_does_not_explain(tmp_path):
    """A loader that silently ignored Qwen2's biases would pass a Llama config; ours refuses."""
    d = tmp_path / "m"
    shutil.copytree(TINY / "qwen2", d)
    conf = json.loads((d / "config.json").read_text())
    conf["architectures"], conf["model_type"] = ["LlamaForCausalLM"], "llama"
    (d / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="missing|unexpected"):
        load_model(d, "float32")


@pytest.mark.parametrize("cut", [10, 1000, -5000])
def test_truncated_gguf(tmp_path, tiny_models, cut):
    from gguf_writer import write_llama_gguf

    m = tiny_models("llama2")
    good = tmp_path / "good.gguf"
    write_llama_gguf(good, m.config, m.params)
    bad = tmp_path / "bad.gguf"
    data = good.read_bytes()
    bad.write_bytes(data[:cut])
    with pytest.raises(ValueError, match="corrupt or truncated GGUF"):
        load_model(bad, "float32", cache=False)


def test_not_a_model_file(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="unrecognised model file"):
        load_model(tmp_path / "notes.txt", "float32")
    with pytest.raises(ValueError, match="not a model directory"):
        load_model(tmp_path, "float32")


def test_unknown_random_model_and_dtype():
    with pytest.raises(ValueError, match="unknown random model"):
        load_model("random:gpt5", "float32")
    with pytest.raises(ValueError, match="bad option"):
        load_model("random:smollm2-135m:layers=x", "float32")
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model("random:smollm2-135m:layers=1", "float64x")


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(seed=-3), "seed"),
    (dict(stop=("",)), "stop"),
    (dict(top_p=1e-45), "top_p"),  # issue 24: a denormal the device flushes to 0
    (dict(json_schema="[" * 100_000 + "]" * 100_000), "nested too deeply"),  # issue 24: was RecursionError
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_errors_quote_at_most_a_short_prefix_of_the_input(embedded_llm):
    """Issue 24: a 40-640 KB regex or grammar came back whole inside its error (over gRPC, past the header limit)."""
    with pytest.raises(ValueError) as e:
        SamplingParams(stop=("x" * 100_000, ""))
    assert len(str(e.value)) < 300
    with pytest.raises(ValueError) as e:
        embedded_llm.generate("hi", SamplingParams(regex="(" + "a" * 100_000))
    assert "invalid regex" in str(e.value) and len(str(e.value)) < 500
    with pytest.raises(ValueError, match="nested too deeply"):
        deep: dict = {}
        for _ in range(100_000):
            deep = {"a": deep}
        SamplingParams(json_schema=deep)


def test_unknown_sampling_field():
    with pytest.raises(ValueError, match="unknown sampling fields"):
        SamplingParams.from_dict({"temperature": 0.5, "temprature": 1})
    with pytest.raises(ValueError, match="unknown sampling fields"):
        SamplingParams(temperature=0.5, max_new_tokens=3)


def test_bad_prompts_and_the_engine_keeps_serving(embedded_llm):
    llm = embedded_llm
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate("")
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 49152]})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [-1]})
    with pytest.raises(ValueError, match="list of integers"):
        llm.generate({"prompt_token_ids": ["a"]})
    for ids in ([1, True], [2, 3.0], (4, None)):  # (bools are not token ids)
        with pytest.raises(ValueError, match="list of integers"):
            llm.prepare_request({"prompt_token_ids": ids})
    for ids in ((5, 6), np.array([5, 6]), [np.int64(5), 6], [5, 6]):  # the plain list takes a fast path, the rest not
        assert llm.prepare_request({"prompt_token_ids": ids}).prompt_ids == [5, 6]
    with pytest.raises(ValueError, match="exceeds the context"):
        llm.generate("Hello", SamplingParams(max_tokens=llm.max_model_len))
    with pytest.raises(ValueError, match="SamplingParams for"):
        llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(ValueError, match="a prompt is a str"):
        llm.generate([3])
    # Issue 24: blank prompts were accepted although empty ones are errors.
    with pytest.raises(ValueError, match="only whitespace"):
        llm.generate(" \n\t ")
    with pytest.raises(ValueError, match="last chat message is blank"):
        llm.chat([{"role": "user", "content": "  "}])
    with pytest.raises(ValueError, match="no messages"):
        llm.chat([[]])
    with pytest.raises(ValueError, match="string 'content'"):
        llm.chat([{"role": "user"}])
    out = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].token_ids) == 3


def test_text_prompt_to_a_model_without_tokenizer():
    # a checkpoint without tokenizer files (the CLI tests below: a random model, which has none either); tiny smollm2's
    # shapes are those of test_families (their programs come from the run's XLA cache)
    assert not list((TINY / "smollm2").glob("tokenizer*"))
    llm = make_llm(str(TINY / "smollm2"), warmup=False)
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4 and out[0].text is None


@pytest.mark.parametrize("argv, match", [
    (["generate", "hi", "--model", "/no/such/dir"], "does not exist"),
    (["generate", "hi", "--temperature", "-1", "--model", "random:smollm2-135m:layers=1"], "temperature"),
    (["generate", "hi", "--top-p", "2", "--model", "random:smollm2-135m:layers=1"], "top_p"),
    (["generate", "hi", "--model", "random:smollm2-135m:layers=1"], "no tokenizer"),
])
def test_cli_errors_are_one_line_and_nonzero(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "jphoton: error:" in err and match in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag, value", [("--port", "99999"), ("--port", "-1"), ("--max-message-mb", "-1"),
                                         ("--max-queue", "0"), ("--metrics-port", "70000"), ("--grace", "-5")])
def test_serve_flags_out_of_range_are_usage_errors(capsys, flag, value):
    """Issue 24: --max-message-mb -1 removed the size limit, --port 99999 bound some other port."""
    with pytest.raises(SystemExit) as e:
        main(["serve", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


def test_serve_on_a_taken_port_or_a_foreign_host_is_one_line(capsys):
    """Issue 24: a traceback and exit 1 (grpcio raises RuntimeError where it used to return 0)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert "jphoton: error: cannot bind" in err and "Traceback" not in err
    assert main(["serve", "--host", "999.1.1.1", "--port", "0"]) == 2
    assert "jphoton: error: cannot bind" in capsys.readouterr().err


def test_limits_are_checked_at_submission_before_any_work(embedded_llm):
    """Issue 24 items 1 and 3: 1.5 million stop strings were accepted (and scanned every token); a 15 MB prompt was
    tokenized (~20 s) before anything looked at its size. The limits live in EngineConfig.limits."""
    import time

    from jphoton.engine.config import EngineConfig, Limits

    llm = embedded_llm
    limits = llm.engine_config.limits
    assert limits == Limits()  # the documented defaults
    cases = [
        (SamplingParams(stop=tuple(f"s{i}" for i in range(limits.max_stop_strings + 1))), "max_stop_strings"),
        (SamplingParams(stop=("x" * (limits.max_stop_bytes + 1),)), "max_stop_bytes"),
        (SamplingParams(regex="a" * (limits.max_constraint_bytes + 1)), "max_constraint_bytes"),
        (SamplingParams(choice=tuple(f"c{i}" for i in range(limits.max_choices + 1))), "max_choices"),
    ]
    for params, limit in cases:
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match=limit) as e:
            llm.generate("hi", params)
        assert time.perf_counter() - t0 < 0.5 and len(str(e.value)) < 200
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="max_prompt_bytes"):
        llm.generate("a" * (limits.max_prompt_bytes + 1))
    with pytest.raises(ValueError, match="max_prompt_bytes"):
        llm.chat([{"role": "user", "content": "é" * (limits.max_prompt_bytes // 2 + 1)}])  # 2 UTF-8 bytes each
    with pytest.raises(ValueError, match=r"at least \d+ tokens .* the context holds"):  # admitted, cannot fit
        llm.generate("word " * (limits.max_prompt_bytes // 5))
    assert time.perf_counter() - t0 < 2.0  # nothing was tokenized
    ok = SamplingParams(max_tokens=2, temperature=0, stop=tuple(f"s{i}" for i in range(limits.max_stop_strings)))
    assert len(llm.generate("Hello", ok)[0].token_ids) == 2  # at the limit: accepted
    custom = EngineConfig.from_kwargs(max_stop_strings=2, max_prompt_bytes=10, max_choices=5).limits
    assert (custom.max_stop_strings, custom.max_prompt_bytes, custom.max_choices) == (2, 10, 5)
    with pytest.raises(ValueError, match="max_stop_strings must be a positive integer"):
        Limits(max_stop_strings=0)


@pytest.mark.parametrize("params", [
    SamplingParams(regex="a{1000000}"),
    SamplingParams(regex="(a|aa){5000}b"),
])
def test_constraints_past_llguidance_limits_fail_at_submission(embedded_llm, params):
    """Issue 24 item 6: accepted, then ABORTED mid-flight with "grammar rejected token". A short walk of the compiled
    matcher at submission finds the limit (GrammarCompiler._probe)."""
    with pytest.raises(ValueError, match="cannot be served: lexer error") as e:
        embedded_llm.generate("hi", params)
    assert len(str(e.value)) < 300
    out = embedded_llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0, regex="[a-z]{3}"))[0]
    assert out.finish_reason in ("stop", "length") and len(out.text) == 3


def test_an_empty_grammar_is_refused(embedded_llm):
    """Issue 24 item 12: an empty grammar (one that matches only the empty output) was accepted."""
    for grammar in ("", "   \n"):
        with pytest.raises(ValueError, match="grammar"):
            embedded_llm.generate("hi", SamplingParams(grammar=grammar))
    for params in (SamplingParams(grammar="start:"), SamplingParams(grammar='start: ""'),
                   SamplingParams(grammar='root ::= ""'), SamplingParams(regex="()")):
        with pytest.raises(ValueError, match="matches only the empty output"):
            embedded_llm.generate("hi", params)
    out = embedded_llm.generate("hi", SamplingParams(regex="a?", max_tokens=4, temperature=0))[0]  # may be empty: fine
    assert out.finish_reason in ("stop", "length")


def test_cli_convert_and_undecodable_prompt_are_one_line_errors(capsys, tmp_path):
    """Issue 24 item 12: tracebacks (exit 1) for convert onto an existing file or into an unwritable place, and for a
    prompt with invalid UTF-8 bytes (Python hands argv's undecodable bytes over as lone surrogates)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for dest, match in [(afile, "is not a directory"), (afile / "sub", "cannot write"),
                        (pathlib.Path("/proc/no-such-dir/store"), "cannot write")]:
        assert main(["convert", "random:smollm2-135m:layers=1", str(dest)]) == 2
        err = capsys.readouterr().err
        assert "jphoton: error:" in err and match in err and "Traceback" not in err, err
    argv_prompt = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")
    assert main(["generate", argv_prompt, "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "not valid UTF-8" in err and "Traceback" not in err
