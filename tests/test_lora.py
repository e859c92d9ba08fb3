"""Multi-LoRA: adapters per request in one batch (models/lora.py, engine/loras.py, weights/peft.py).

Reference: three random HF PEFT adapters on the tiny llama3 checkpoint, greedy tokens from PEFT (tests/fixtures/tiny/lora,
made by tests/fixtures/make_lora_fixture.py)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from jphoton import NoFreeLoraSlot, SamplingParams

from conftest import FIXTURES, make_llm, shared_llm

BASE = FIXTURES / "tiny" / "llama3"
ADAPTERS = FIXTURES / "tiny" / "lora"
NAMES = ("a", "b", "c")
NEW = 24


def _reference():
    ref = np.load(ADAPTERS / "reference.npz")
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(4)]
    tokens = {name: [ref[f"tokens_{name}_{i}"].tolist() for i in range(4)] for name in ("base", *NAMES)}
    return prompts, tokens


def _greedy(lora=None, n=NEW):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, lora=lora)


@pytest.fixture(scope="module")
def lora_llm():
    # one decode bucket (8 rows; a request alone runs in it padded); programs compiled on first use (CI time: the
    # module's greedy requests take 6 of the 12 step programs and none of the 7 second samplers that "full" compiles)
    with shared_llm(str(BASE), max_loras=3, max_lora_rank=16, decode_buckets=(8,), warmup="off") as llm:
        for name in NAMES:
            llm.load_lora(name, ADAPTERS / name)
        yield llm


def test_the_slot_update_matches_a_per_row_gather():
    """The update of every slot at once (two GEMMs and a mask) against each row's own slot gathered row by row."""
    import jax
    import jax.numpy as jnp

    from jphoton.models import lora

    rng = np.random.default_rng(0)
    S, R, D, O = 3, 4, 16, 24
    for group in ("qkv", "o"):
        n = len(lora.GROUPS[group])
        a = jnp.asarray(rng.standard_normal((D, S * n * R)), jnp.float32)
        b = jnp.asarray(rng.standard_normal((S * n * R, O)), jnp.float32)
        x = jnp.asarray(rng.standard_normal((7, D)), jnp.float32)
        slots = jnp.asarray([0, -1, 2, 1, -1, 2, 0], jnp.int32)
        got = lora.delta(x, a, b, lora.slot_mask(slots, S * n * R, lora.group_width(group, R), jnp.float32))
        want = jax.jit(lora.delta_reference, static_argnums=(4, 5))(x, a, b, slots, group, R)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
        assert not np.asarray(got)[[1, 4]].any() and np.asarray(got)[0].any()  # no adapter: no update


def test_the_gemv_residual_path_reads_the_lora_columns_like_xla():
    """O / down with the LoRA shrink in the weight's extra columns (lora.INLINE): the GEMV + add-RMSNorm kernels
    (interpret mode) against the XLA path, with LoRA rows (shrink used) and without (extra columns unread)."""
    import jax.numpy as jnp

    from jphoton.models import lora
    from jphoton.models.matmul import PlainMatmul, XlaMatmul

    rng = np.random.default_rng(2)
    M, K, D, C = 5, 96, 48, 16  # 2 slots x rank 8
    w = jnp.asarray(rng.standard_normal((K, D + C)) * 0.1, jnp.float32)
    b = jnp.asarray(rng.standard_normal((C, D)) * 0.1, jnp.float32)
    y = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    h = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
    norm = jnp.asarray(rng.standard_normal(D), jnp.float32)
    slots = jnp.asarray([1, -1, 0, 1, 0], jnp.int32)

    def update(h, shrunk):
        return PlainMatmul().lora_expand(h, shrunk, b, slots, 8)

    kernels = XlaMatmul(residual_gemv=True, residual_min_rows=1, interpret=True)
    for fn in (update, None):
        got = kernels.residual(h, y, w, w[None], 0, norm, norm[None], 1e-5, lora=fn)
        want = PlainMatmul().residual(h, y, w, w[None], 0, norm, norm[None], 1e-5, lora=fn)
        for g, x in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(x), rtol=1e-4, atol=1e-4)
    base = PlainMatmul().residual(h, y, w[:, :D], None, 0, norm, None, 1e-5)
    np.testing.assert_allclose(np.asarray(kernels.residual(h, y, w, w[None], 0, norm, norm[None], 1e-5)[0]),
                               np.asarray(base[0]), rtol=1e-4, atol=1e-4)
    assert lora.group_width("o", 8) == 8


def test_greedy_tokens_equal_hf_peft_in_one_mixed_batch_and_alone(lora_llm):
    prompts, ref = _reference()
    for name in NAMES:  # each adapter changes the base model's output (else this test could not fail)
        assert all(ref[name][i] != ref["base"][i] for i in range(4))
    # every prompt with the base model and each adapter: 16 requests in the same batches
    variants = [None, *NAMES]
    outs = lora_llm.generate([{"prompt_token_ids": p} for _ in variants for p in prompts],
                             [_greedy(v) for v in variants for _ in prompts])
    got = [o.token_ids for o in outs]
    for k, v in enumerate(variants):
        assert got[4 * k:4 * k + 4] == ref[v or "base"], f"adapter {v}"
    for name in NAMES:  # alone: one request in the engine
        [alone] = lora_llm.generate({"prompt_token_ids": prompts[3]}, _greedy(name))
        assert alone.token_ids == ref[name][3]


def test_adapters_do_not_share_cached_prefixes(lora_llm):
    prompts, ref = _reference()
    prompt = {"prompt_token_ids": prompts[3]}  # 40 tokens: two full pages of 16
    lora_llm.reset_prefix_cache()
    assert lora_llm.generate(prompt, _greedy(None, 4))[0].token_ids == ref["base"][3][:4]
    hits = lora_llm.stats()["prefix_hit_tokens"]
    assert lora_llm.generate(prompt, _greedy("a", 4))[0].token_ids == ref["a"][3][:4]
    assert lora_llm.stats()["prefix_hit_tokens"] == hits  # base KV never serves an adapter
    assert lora_llm.generate(prompt, _greedy("a", 4))[0].token_ids == ref["a"][3][:4]
    assert lora_llm.stats()["prefix_hit_tokens"] == hits + 32  # but the adapter's own pages do


def _two_streams(llm, prompts):
    """Adapter a's and b's streams, b admitted while a decodes; their first deltas."""
    streams = [llm.stream({"prompt_token_ids": prompts[i]}, _greedy(name)) for i, name in ((0, "a"), (1, "b"))]
    return streams, [next(iter(s)) for s in streams]


def test_unload_and_replace_while_serving_wait_for_the_requests_in_flight(lora_llm, tmp_path):
    prompts, ref = _reference()
    # the module's engine compiles on first use: this test's requests once before counting (their step programs), so
    # that a compile below can only come from loading, unloading or replacing adapters
    for s in _two_streams(lora_llm, prompts)[0]:
        list(s)
    lora_llm.generate({"prompt_token_ids": prompts[2]}, _greedy("b"))
    compiles = lora_llm.stats()["num_compiles"]
    streams, firsts = _two_streams(lora_llm, prompts)  # both running now
    assert lora_llm.unload_lora("a") and not lora_llm.unload_lora("a")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        lora_llm.generate({"prompt_token_ids": prompts[0]}, _greedy("a"))
    st = lora_llm.stats()
    assert (st["lora_slots_loaded"], st["lora_slots_draining"], st["lora_slots_free"]) == (2, 1, 0)
    # replace "b" (still in use) with "c"'s weights: the running "b" request finishes on the old ones; the load waits
    # for a free slot (the draining one, released as the "a" request finishes)
    copy = tmp_path / "c-copy"
    shutil.copytree(ADAPTERS / "c", copy)
    lora_llm.load_lora("b", copy)
    rest = [[t for d in s for t in d.token_ids] for s in streams]
    assert firsts[0].token_ids + rest[0] == ref["a"][0]
    assert firsts[1].token_ids + rest[1] == ref["b"][1]
    assert lora_llm.generate({"prompt_token_ids": prompts[2]}, _greedy("b"))[0].token_ids == ref["c"][2]
    # put things back for the other tests
    lora_llm.unload_lora("b")
    lora_llm.load_lora("a", ADAPTERS / "a")
    lora_llm.load_lora("b", ADAPTERS / "b")
    st = lora_llm.stats()
    assert (st["lora_slots_loaded"], st["lora_slots_draining"], st["lora_slots_free"]) == (3, 0, 0)
    assert {e["name"]: e["running"] for e in lora_llm.list_loras()} == {"a": 0, "b": 0, "c": 0}
    with pytest.raises(NoFreeLoraSlot, match="all 3 LoRA slots"):
        lora_llm.load_lora("d", ADAPTERS / "a")
    assert lora_llm.stats()["num_compiles"] == compiles  # loading, unloading and serving compiled nothing


def test_an_aborted_request_gives_its_slot_reference_back(lora_llm):
    prompts, _ = _reference()
    with lora_llm.stream({"prompt_token_ids": prompts[1]}, _greedy("c")) as s:
        next(iter(s))
        assert {e["name"]: e["running"] for e in lora_llm.list_loras()}["c"] == 1
    assert {e["name"]: e["running"] for e in lora_llm.list_loras()}["c"] == 0


def _adapter_with(tmp_path, **changes):
    out = tmp_path / "adapter"
    shutil.copytree(ADAPTERS / "a", out)
    config = json.loads((out / "adapter_config.json").read_text())
    config.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("changes, message", [
    (dict(use_dora=True), "DoRA is not supported"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save is not supported"),
    (dict(r=32), "rank 32 exceeds max_lora_rank=16"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "target modules \\['embed_tokens'\\] are not supported"),
    (dict(peft_type="IA3"), "peft_type is not LORA"),
    (dict(target_modules="(a+)+$"), "target_modules as a pattern is not supported"),  # never compiled: no spin
    (dict(r=4), "down_proj: lora_A \\(8, 128\\), lora_B \\(64, 8\\); expected \\(4, 128\\)"),
])
def test_adapters_that_are_not_plain_lora_of_this_model_are_refused(lora_llm, tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        lora_llm.load_lora("bad", _adapter_with(tmp_path, **changes))
    assert "bad" not in {e["name"] for e in lora_llm.list_loras()}


def test_bad_names_and_paths_are_clear_errors(lora_llm, tmp_path):
    with pytest.raises(ValueError, match="no adapter_config.json"):
        lora_llm.load_lora("x", tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        lora_llm.load_lora("x", tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope' \\(loaded: 'a', 'b', 'c'\\)"):
        lora_llm.generate({"prompt_token_ids": [5, 6, 7]}, _greedy("nope"))
    with pytest.raises(ValueError, match="lora must be an adapter name"):
        SamplingParams(lora="")


def test_lora_off_and_unsupported_models_say_so():
    llm = make_llm(str(BASE), warmup="off")
    with pytest.raises(ValueError, match="LoRA is off"):
        llm.load_lora("a", ADAPTERS / "a")
    with pytest.raises(ValueError, match="LoRA is off"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, _greedy("a"))
    assert llm.stats()["lora_slots_total"] == 0
    with pytest.raises(ValueError, match="does not support LoRA"):
        make_llm(str(FIXTURES / "tiny" / "qwen3_moe"), warmup="off", max_loras=1)


def test_cli_generate_with_an_adapter_prints_what_the_api_returns(lora_llm, capsys):
    from jphoton.cli import main

    argv = ["generate", "the lazy dog", "--raw", "--model", str(BASE), "--dtype", "float32", "--temperature", "0",
            "--max-tokens", "6"]
    assert main([*argv, "--lora", f"a={ADAPTERS / 'a'}"]) == 0
    printed = capsys.readouterr().out
    [want] = lora_llm.generate("the lazy dog", SamplingParams(max_tokens=6, temperature=0, lora="a"))
    [base] = lora_llm.generate("the lazy dog", SamplingParams(max_tokens=6, temperature=0))
    assert printed == want.text + "\n" and want.token_ids != base.token_ids
    with pytest.raises(SystemExit):
        main([*argv, "--lora", "a=/no/such/adapter"])
    assert "is not a directory" in capsys.readouterr().err
    assert main(["serve", "--model", str(BASE), "--max-loras", "0", "--lora", f"a={ADAPTERS / 'a'}"]) == 2
    assert "1 --lora adapters but --max-loras 0" in capsys.readouterr().err


# ---- hostile adapters: one tenant's adapter never reaches another's rows ------------------------------------------
def _poisoned_adapter(lora_llm, value):
    """Adapter "a" with every weight set to `value`, read past the load checks (as if they had a hole)."""
    adapter = lora_llm.read_lora(ADAPTERS / "a")
    for la, lb in adapter.weights.values():
        la[:] = value
        lb[:] = value
    return adapter


def _write_adapter(tmp_path, value):
    from safetensors.numpy import load_file, save_file

    out = _adapter_with(tmp_path)
    tensors = load_file(out / "adapter_model.safetensors")
    first = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[first] = tensors[first].copy()
    tensors[first].flat[3] = value
    save_file(tensors, out / "adapter_model.safetensors")
    return out


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 3e38])
def test_an_adapter_whose_weights_are_not_finite_in_the_engine_dtype_is_refused_at_load(lora_llm, tmp_path, value):
    # 3e38 is finite in float32, but times the scaling (lora_alpha / r = 2 for this adapter) it is not
    with pytest.raises(ValueError, match="not finite|exceeds 3.4"):
        lora_llm.load_lora("bad", _write_adapter(tmp_path, value))
    assert "bad" not in {e["name"] for e in lora_llm.list_loras()}


@pytest.mark.parametrize("value", [np.nan, 1e30])  # NaN weights; finite weights whose products overflow to inf
def test_a_poisoned_adapter_leaves_base_rows_and_other_adapters_exact_and_poisons_no_cached_page(lora_llm, value):
    prompts, want = _reference()
    pages = lora_llm.engine.pages
    lora_llm.unload_lora("c")
    lora_llm.install_lora("bad", _poisoned_adapter(lora_llm, value))
    try:
        # one batch: base rows, a good adapter and the bad one side by side (the same prompt as a base row, too)
        batch = [(prompts[0], None), (prompts[1], "bad"), (prompts[2], "a"), (prompts[1], None), (prompts[3], "bad")]
        out = lora_llm.generate([{"prompt_token_ids": p} for p, _ in batch], [_greedy(name) for _, name in batch])
        assert out[0].token_ids == want["base"][0] and out[3].token_ids == want["base"][1]
        if np.isfinite(value):  # (NaN weights are refused at load; had they been written, B's NaN rows would reach
            assert out[2].token_ids == want["a"][2]  # other adapters' rows through 0 * NaN, but never a base row's)
        for o in (out[1], out[4]):  # the adapter's own rows end with an error, not silent token-0 output
            assert o.finish_reason == "error" and "not finite" in o.error, (o.finish_reason, o.error)
        bad_key = next(s.key for s in lora_llm.engine.loras.slots if s.name == "bad")
        assert not [k for k in pages._page_of if k[2] == bad_key], "a poisoned page is in the prefix cache"
        # its freed pages (NaN KV) are handed out again: the next requests must not read what is left in them
        again = lora_llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
        assert [o.token_ids for o in again] == want["base"]
        assert lora_llm.generate({"prompt_token_ids": prompts[1]}, _greedy("bad"))[0].finish_reason == "error"
    finally:
        lora_llm.unload_lora("bad")
        lora_llm.load_lora("c", ADAPTERS / "c")
    assert [o.token_ids for o in lora_llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy("c"))] \
        == want["c"]


def test_a_config_that_is_too_big_is_refused_before_it_is_parsed(lora_llm, tmp_path):
    out = _adapter_with(tmp_path)
    (out / "adapter_config.json").write_text(json.dumps({"r": 8, "pad": "x" * 100_000}))
    with pytest.raises(ValueError, match="adapter_config.json is over 65536 bytes"):
        lora_llm.read_lora(out)


def test_target_modules_are_matched_literally(lora_llm, tmp_path):
    assert lora_llm.read_lora(_adapter_with(tmp_path, target_modules="all-linear")).rank == 8
    with pytest.raises(ValueError, match="as a pattern is not supported"):
        lora_llm.read_lora(_adapter_with(tmp_path / "x", target_modules=".*_proj"))


def test_allowed_dirs_refuse_every_path_outside_with_one_message(lora_llm, tmp_path):
    from jphoton.weights.peft import ADAPTER_PATH_REFUSED

    allowed = tmp_path / "loras"
    allowed.mkdir()
    shutil.copytree(ADAPTERS / "a", allowed / "a")
    outside = tmp_path / "outside"
    shutil.copytree(ADAPTERS / "a", outside)
    (allowed / "link_out").symlink_to(outside)
    (allowed / "afile").write_text("x")
    sneaky = allowed / "sneaky"  # inside, but its config is a symlink to a file outside (a secret, say)
    shutil.copytree(ADAPTERS / "a", sneaky)
    (tmp_path / "secret.json").write_text(json.dumps({"r": "token-abc123"}))
    (sneaky / "adapter_config.json").unlink()
    (sneaky / "adapter_config.json").symlink_to(tmp_path / "secret.json")
    refused = [outside, tmp_path / "missing", allowed / "missing", allowed / "afile", allowed / "link_out",
               "link_out", "../outside", sneaky, "", "a\0b"]
    for path in refused:
        with pytest.raises(ValueError) as e:
            lora_llm.read_lora(path, allowed_dirs=[allowed])
        assert str(e.value) == ADAPTER_PATH_REFUSED, (path, str(e.value))
    with pytest.raises(ValueError, match=f"^{ADAPTER_PATH_REFUSED[:30]}"):
        lora_llm.read_lora(allowed / "a", allowed_dirs=[])  # no directory allowed: nothing is
    ok = lora_llm.read_lora("a", allowed_dirs=[allowed])  # relative: under the first allowed directory
    assert ok.rank == 8 and ok.source == "a"
    assert lora_llm.read_lora(allowed / "a", allowed_dirs=[tmp_path / "elsewhere", allowed]).rank == 8
