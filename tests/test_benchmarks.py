"""Every benchmark script's main path on a tiny model on the CPU (the numbers themselves come from GPU runs,
benchmarks/RESULTS.md), and gpu_suite.sh's sections against the scripts that exist."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess

import ml_dtypes
import numpy as np
import pytest

from benchmarks.llm_args import parse_llm_args

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = "random:smollm2-135m:layers=2:vocab=512"
# The CPU smoke tests' engine: one decode and one prefill bucket (each step shape costs ~1-2 s to compile here; the
# benchmarks' point, the default engine, is the GPU runs' business)
NARROW = "max_num_seqs=2,max_model_len=64,decode_buckets=(2,),prefill_buckets=((1,16),)"


def test_gpu_suite_sections_name_only_scripts_that_exist():
    suite = (ROOT / "benchmarks" / "gpu_suite.sh").read_text()
    listed = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "list"], capture_output=True, text=True,
                            check=True).stdout.split()
    assert len(listed) >= 8
    labels = {name for pattern in re.findall(r"^\s+([\w|-]+)\)", suite, re.M) for name in pattern.split("|")}
    assert set(listed) <= labels, set(listed) - labels
    scripts = set(re.findall(r"python3 (benchmarks/[\w/]+\.py)", suite))
    assert scripts and all((ROOT / s).is_file() for s in scripts), scripts
    lab = (ROOT / "lab" / "lab_suite.sh").read_text()
    assert all((ROOT / s).is_file() for s in re.findall(r"python3 (lab/[\w/]+\.py)", lab))


def test_throughput(tmp_path):
    from benchmarks.throughput import main

    # one depth, a narrow engine (CI time): the depths share the code path, the defaults are the GPU runs' business
    rows = main(["--model", TINY, "--batch", "2", "--prompt-len", "16", "--new-tokens", "6", "--depths", "2",
                 "--llm-args", NARROW + ",warmup='off'",
                 "--bandwidth-gib", "0.01", "--out", str(tmp_path / "t.json")])
    assert [r["depth"] for r in rows] == [2] and all(r["decode_ms"] > 0 for r in rows)
    assert json.loads((tmp_path / "t.json").read_text())["rows"]
    assert parse_llm_args(NARROW)["prefill_buckets"] == ((1, 16),)  # commas inside a value do not split it


def test_sampling(tmp_path):
    from benchmarks.sampling import main

    rows = main(["--model", TINY, "--batch", "2", "--prompt-len", "8", "--new-tokens", "6", "--rounds", "1",
                 "--settings", "greedy", "top_p 0.9", "one top_p 0.9 row", "--llm-args", NARROW,
                 "--out", str(tmp_path / "s.json")])
    timed = [r for r in rows if "setting" in r]
    assert [r["setting"] for r in timed] == ["greedy", "top_p 0.9", "one top_p 0.9 row"]
    assert all(r["decode_ms"] > 0 for r in timed) and timed[0]["vs_greedy"] == 1.0
    assert rows[-1]["compiles_during_runs"] == 0


def test_prefix_cache(tmp_path):
    from benchmarks.prefix_cache import main

    summary, shared = main(["--model", TINY, "--requests", "3", "--system-len", "40", "--unique-len", "5",
                            "--batch", "2", "--prompt-len", "8", "--new-tokens", "4", "--rounds", "1",
                            "--llm-args", NARROW, "--out", str(tmp_path / "p.json")])
    assert summary["hit_tokens_on"] >= 2 * 32 and summary["compiles"] == 0  # pages of 16: two full ones shared
    off, on = sorted(shared, key=lambda r: r["cache"])
    assert off["hit_tokens"] == 0 and on["token_ids"] == off["token_ids"]
    assert json.loads((tmp_path / "p.json").read_text())["summary"]["prefill_speedup"] > 0


def test_lora(tmp_path):
    from benchmarks.lora import main

    summary = main(["--model", TINY, "--adapters", "2", "--rank", "4", "--batch", "4", "--context", "32", "--steps",
                    "2", "--prompt-len", "8", "--new-tokens", "4", "--rounds", "1", "--out", str(tmp_path / "l.json")])
    assert summary["compiles_while_timed"] == 0 and summary["lora_rows"] == 3
    assert json.loads((tmp_path / "l.json").read_text())["summary"]["step_mixed_over_off"] > 0


def test_tensor_parallel(tmp_path):
    from benchmarks.tensor_parallel import main

    tiny = str(pathlib.Path(__file__).parent / "fixtures" / "tiny" / "llama3")  # 4 heads, 2 KV heads: shards 2 ways
    common = ["--model", tiny, "--tp", "2", "--prompt-len", "8", "--new-tokens", "4"]
    check = main(["check", *common, "--dtypes", "float32", "--batch", "2", "--out", str(tmp_path / "c.json")])
    assert check["float32"]["equal"] and check["float32"]["tokens_compared"] == 8
    big = main(["big", *common, "--batches", "2", "--context", "16", "--steps", "2", "--max-model-len", "64",
                "--out", str(tmp_path / "b.json")])  # ("steps" runs the same calls for TP=1 and TP=N)
    assert big["step_ms"][2] > 0 and all(run["compiles"] == 0 for run in big["served"])


def test_pipeline(tmp_path):
    from benchmarks.pipeline import main

    rows = main(["--models", TINY, "--streams", "2", "--requests-per-stream", "1", "--out", str(tmp_path),
                 "--llm-args", "max_num_seqs=2,max_model_len=256,decode_buckets=(2,),prefill_buckets=((1,64),),"
                 "warmup='off'"])
    (row,) = rows
    assert row["tok_s_blocking"] > 0 and row["tok_s_pipelined"] > 0 and row["fwd_plus_sampling_ms"] > 0
    assert (tmp_path / "pipeline.json").exists() and (tmp_path / "pipeline_timelines.json").exists()


def test_host_overhead():
    from benchmarks.host_overhead import run

    row = run(batch=2, requests_per_stream=2, model=TINY, lengths=(8, 16))
    assert row["decode_ticks"] > 2 and 0 < row["plan_us"] < 1e6 and 0 < row["commit_us"] < 1e6


def test_constrained(tmp_path):
    pytest.importorskip("llguidance")
    from benchmarks.constrained import main

    tok = tmp_path / "tok"  # exported from the embedded model on first use
    rows = main(["--model", "random:smollm2-135m:layers=2", "--tokenizer", str(tok), "--streams", "2",
                 "--requests-per-stream", "1", "--max-tokens", "12", "--max-num-seqs", "2", "--out", str(tmp_path),
                 "--llm-args", "max_model_len=128,decode_buckets=(2,),prefill_buckets=((1,64),),warmup='off'"])
    assert (tok / "tokenizer.json").exists()
    assert [r["constraint"] for r in rows] == ["schema", "coords"]
    for row in rows:
        assert row["requests"] == 2 and row["device_schema_ms"] > 0 and row["paths"] == ["device", "host"]
        assert row["device"]["automaton_steps"] > 0 and row["host"]["constrained_steps"] > 0
        assert row["valid"] + row["truncated"] <= 2


def test_kernel_profile():
    from benchmarks.kernel_profile import main

    (row,) = main(["--smoke"])
    assert row["ms_per_step"] > 0 and "kernels" in row


def test_attention_decode():
    from benchmarks.attention_decode import main

    result = main(["--smoke", "--batch", "1", "--ctx", "16", "--configs", "16:2:2:2"])
    (row,) = result["rows"]
    assert row["paths"]["pallas"]["max_abs_err"] < 1e-3 and row["paths"]["static"]["max_abs_err"] < 1e-3
    assert row["paths"]["pallas 16:2:2:2"]["max_abs_err"] < 1e-3
    mha = main(["--smoke", "--batch", "2", "--ctx", "16", "--heads", "4", "4", "--paths", "pallas", "reference"])
    assert mha["shape"]["Hkv"] == "4" and mha["rows"][0]["paths"]["pallas"]["max_abs_err"] < 1e-3


def test_moe_layer_and_e2e():
    from benchmarks.moe_decode import main

    layer = main(["layer", "--smoke", "--batch", "2"])
    paths = layer["rows"][0]["paths"]
    assert all(paths[p]["max_rel"] < 1e-2 for p in ("warp_decode", "expert_centric", "dense_gather"))
    e2e = main(["e2e", "--smoke", "--batch", "2", "--backends", "expert_centric"])
    assert e2e["rows"][0]["decode_tok_s"] > 0


def test_serving():
    from benchmarks.serving import main

    result = main(["--model", TINY, "--concurrency", "3", "--requests-per-client", "2", "--prompt-len", "16",
                   "--new-tokens", "6", "--client-procs", "2", "--servers", "process",  # (CI time: not "thread")
                   "--frontends", "2",  # two gRPC processes on the port (jphoton serve's default on larger hosts)
                   "--llm-args", "max_num_seqs=4,max_model_len=64,decode_buckets=(4,),prefill_buckets=((1,16),)"])
    assert result["compiles_after_warmup"] == 0 and {r["mode"] for r in result["rows"]} == {"static", "staggered"}
    assert [r["server"] for r in result["rows"]] == ["process", "process"]
    assert [r["frontends"] for r in result["rows"]] == [2, 2]
    assert result["info"]["backend"] == "cpu"  # reported by the engine's process
    for row in result["rows"]:  # 3 streams over 2 client processes, every request's 6 tokens accounted for
        assert row["client"]["processes"] == 2 and 0 < row["client"]["max_core_fraction"] < 2
        assert 1 <= row["tokens_per_message"] <= 6 and row["requests"] == (3 if row["mode"] == "static" else 6)
        assert row["message_gap_ms"]["p50"] > 0 and row["itl_ms"]["p50"] > 0


def _hf_llama_handoff(d: pathlib.Path, agree: int, greedy: int):
    """A tiny HF Llama (config.json text, HF-named float32 arrays) and a made-up HF reference, as vs_pytorch.py's
    parent hands them to its jphoton child (the smoke shape: vocab 512, hidden 64, 2 layers, tied)."""
    from benchmarks.vs_pytorch_handoff import write_handoff
    from benchmarks.vs_pytorch_hf import SHAPES

    s = SHAPES["smoke"]
    config = json.dumps({**s, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                         "rope_scaling": s["rope_parameters"], "rope_theta": s["rope_parameters"]["rope_theta"]})
    rng = np.random.default_rng(0)
    h, f, v, hd = s["hidden_size"], s["intermediate_size"], s["vocab_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    arrays = {"model.embed_tokens.weight": rng.normal(0, 0.02, (v, h)), "model.norm.weight": np.ones(h)}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.o_proj": (h, q), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}
        arrays.update({p + k + ".weight": rng.normal(0, 0.02, shape) for k, shape in shapes.items()})
        arrays.update({p + "input_layernorm.weight": np.ones(h), p + "post_attention_layernorm.weight": np.ones(h)})
    arrays = {k: a.astype(np.float32) for k, a in arrays.items()}
    ref = {"logits": rng.normal(size=(agree, v)).astype(np.float32), "tokens": rng.integers(0, v, (agree, greedy))}
    write_handoff(d, config, arrays, ref, 0.0, dtype="float32", weight_bytes=sum(a.nbytes for a in arrays.values()))


def test_vs_pytorch_jphoton_side_and_report(tmp_path):
    """The jphoton child of vs_pytorch.py (no torch needed), then the parent's table and merge of its rows."""
    from benchmarks.vs_pytorch import main
    from benchmarks.vs_pytorch_hf import SHAPES
    from benchmarks.vs_pytorch_report import add_floor, merge, table

    _hf_llama_handoff(tmp_path, agree=2, greedy=4)
    main(["--smoke", "--rows", "jphoton-blocking", "jphoton-pipelined", "--batch", "1", "2", "--new-tokens", "6",
          "--agree", "2", "--greedy-tokens", "4", "--ctx-prompt", "8", "--jphoton-child", str(tmp_path)])
    child = json.loads((tmp_path / "child.json").read_text())
    rows = child["results"]
    assert {r["row"] for r in rows} == {"jphoton-blocking", "jphoton-pipelined"} and len(rows) == 6, rows
    assert all("ms_step" in r for r in rows), rows
    assert all(r["device_step_ms"] > 0 for r in rows if r["row"] == "jphoton-pipelined")
    agreement = child["agreement"]
    assert len(agreement["logprob_abs_err"]) == 2 and len(agreement["greedy_matching_lead"]) == 2
    for r in rows:
        add_floor(r, 10**6, SHAPES["smoke"], 1e11, 4)
    assert table(rows).count("\n") == len(rows) + 1
    (tmp_path / "vs_pytorch_a.json").write_text(json.dumps({**child, "shape": "smoke", "results": rows}))
    merge([str(tmp_path / "vs_pytorch_a.json")], tmp_path, "all")
    assert (tmp_path / "vs_pytorch_all.json").exists()


def test_vs_pytorch_handoff_round_trips_arrays_config_and_reference(tmp_path):
    from benchmarks.vs_pytorch_handoff import read_handoff, write_handoff

    rng = np.random.default_rng(0)
    w = rng.normal(size=(6, 4)).astype(ml_dtypes.bfloat16)
    arrays = {"a.weight": w, "b.weight": w.T, "norm": rng.normal(size=5).astype(np.float32)}  # .T: a Fortran view
    ref = {"logits": rng.normal(size=(2, 7)).astype(np.float32), "tokens": np.arange(6).reshape(2, 3)}
    write_handoff(tmp_path, '{"hidden_size": 4}', arrays, ref, 12.5, dtype="bfloat16", weight_bytes=123)
    config, got, got_ref, h = read_handoff(tmp_path)
    assert config == '{"hidden_size": 4}' and h["budget_left"] == 12.5 and h["dtype"] == "bfloat16"
    assert h["weight_bytes"] == 123
    for key, a in arrays.items():
        assert got[key].dtype == a.dtype and got[key].shape == a.shape
        np.testing.assert_array_equal(got[key].astype(np.float32), a.astype(np.float32))
    assert got["b.weight"].T.flags.c_contiguous  # the loader's transpose still hands back a contiguous array
    for key in ref:
        np.testing.assert_array_equal(got_ref[key], ref[key])


def test_moondream_rows_variant_and_report(tmp_path):
    """benchmarks/moondream.py --smoke (a tiny random checkpoint, CPU) writes every row kestrel's script writes, a
    variant's decode rows, and --report joins them with kestrel's lines into the side-by-side table."""
    from benchmarks.moondream import main

    out = tmp_path / "moondream_jphoton.jsonl"
    assert main(["--smoke", "--out", str(out), "--variants", '{"matmul": "xla"}']) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by = {}
    for r in rows:
        by.setdefault(r["m"], []).append(r)
    assert {"startup", "ttft_text_1req", "decode_b1", "throughput_text", "image_query", "caption", "serving",
            "vision_attention_check"} <= set(by)
    assert [r["engine"] for r in by["decode_b1"]] == ["jphoton", 'jphoton {"matmul": "xla"}']
    assert all(r["ms_per_token_p50"] > 0 for r in by["decode_b1"])
    steps = by["throughput_text"][0]["steps"]
    assert steps["count"]["decode"] > 0 and steps["prefill_phase_s"] > 0 and steps["host_ms_p50"]["launch"] > 0, steps
    image = by["image_query"][0]
    assert image["repeat_image"]["ttft_ms"] > 0 and image["image_cache_hits"] >= 1 and image["prefix_hit_tokens"] > 0
    assert by["serving"][0]["kv_pages_leaked"] == 0  # (compiles_while_serving: the smoke engine compiles on use)
    for skill, limit in (("point", 8), ("detect", 5)):
        [r] = by[skill]
        assert r["cold"]["wall_ms"] > 0 and r["cached"]["wall_ms"] > 0 and 0 <= r["cold"]["objects"] <= limit
        assert r["cached"]["objects"] == r["cold"]["objects"]  # (greedy: the same answer)
    kestrel = [{**r, "engine": "kestrel"} for r in rows if r["m"] in ("decode_b1", "image_query")][:2]
    kestrel.append({"m": "image_skills", "engine": "kestrel", "point": {"wall_ms": 98.4}, "detect": {"wall_ms": 14.1}})
    (tmp_path / "moondream_kestrel.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kestrel))
    m3 = {"m": "decode_b1", "engine": "jphoton", "ms_per_token_p50": 2.5, "device_step_ms": {"1": 2.1, "32": 3.4}}
    (tmp_path / "moondream3_jphoton.jsonl").write_text(json.dumps(m3) + "\n")
    table = subprocess.run(["python3", str(ROOT / "benchmarks" / "moondream.py"), "--report", str(tmp_path)],
                           capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "| decode at batch 1, ms/token (p50) |" in table and "<= 0.8x" in table, table
    assert "| point 378x378 (cached;" in table and "| detect 378x378 (cold;" in table and "| 98.4 |" in table, table
    assert "| Moondream 3 (random bf16), decode at batch 32: device step, ms | -; step 3.4 | not run" in table, table


def test_startup(tmp_path):
    """A fresh child process per run, cold then warm caches; --wait-ready decodes until every shape is ready."""
    from benchmarks.startup import main

    # the cold run only, fewer step shapes than the defaults and no logprobs (3 second samplers, not 7: a shorter
    # background compile, fewer requests decoded meanwhile) (CI time): a warm run is the same child with the
    # persistent cache filled
    result = main(["--models", TINY, "--runs", "cold", "--wait-ready", "--llm-args",
                   "max_num_seqs=2,max_model_len=256,decode_buckets=(2,),prefill_buckets=((1,64),),max_logprobs=0",
                   "--out", str(tmp_path / "s.json")])
    cold = result["models"][TINY]["cold"]
    assert 0 < cold["import_s"] < cold["llm_s"] < cold["first_token_s"]
    assert cold["shapes_at_first_token"] >= 2 and cold["shapes_total"] > cold["shapes_at_first_token"]
    assert cold["all_shapes_ready"] and cold["compiles_after_ready"] == 0 and cold["decode_b1"]["after_tok_s"]
    assert json.loads((tmp_path / "s.json").read_text())["models"][TINY]["cold"]


def test_startup_decode_during_is_tokens_over_time():
    """Decode during the compile is what a decode loop gets, tokens over time: one 64-token request stalled to 1 tok/s
    among nine at 100 weighs by its 64 s, not as one request in ten."""
    from benchmarks.startup import time_weighted

    rates = [100.0] * 9 + [1.0]
    assert time_weighted(rates) == pytest.approx(10 * 64 / (9 * 0.64 + 64))
    assert time_weighted(rates) < 10 < sum(rates) / len(rates)  # (the mean of the rates: 90.1)
