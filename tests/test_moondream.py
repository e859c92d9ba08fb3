"""Moondream 2 against the official reference implementation (vikhyat/moondream at 44146f1, torch, float32 on CPU),
token for token, without torch: tests/fixtures/moondream/fixtures.json + features.npz, made by
tests/fixtures/moondream/make_fixtures.py from checkpoints that `write_random_checkpoint` rebuilds here bit for bit
(same seeds). Checked: the crops (tiling and the uint8 pixels' sha256), the projected image features, the prompt ids
of every skill, and the greedy ids of `generate_reference` for image queries, captions and text-only queries (config
"c" raises lm_head biases: answer_id wins the unmasked first step, later steps mask it, eos ends early). Also
`pool_weights` against a direct stitch + adaptive-average-pool for every tiling of at most 12 crops. Moondream 3
(md3.json, `make_fixtures.py --md3`: its text model from M87's first plain-torch port, the vision reference above):
image queries, captions and text-only queries, greedy, token for token."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer

from jphoton.engine import compiles
from jphoton.image.crops import overlap_crops, pool_weights
from jphoton.image.skills import skill_prompt
from jphoton.image.spatial import normalize
from jphoton.models.moondream import generate_reference, generate_spatial_reference
from jphoton.models.moondream_vision import vision_encode, vision_project
from jphoton.weights.moondream import read_checkpoint, to_device
from jphoton.weights.store import cache_dir

HERE = pathlib.Path(__file__).parent / "fixtures" / "moondream"
_spec = importlib.util.spec_from_file_location("moondream_make_fixtures", HERE / "make_fixtures.py")
mf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mf)

FIX = json.loads((HERE / "fixtures.json").read_text())
SPATIAL = json.loads((HERE / "spatial.json").read_text())  # point / detect (make_fixtures.py --spatial)
FEATURES = np.load(HERE / "features.npz")
MD3 = json.loads((HERE / "md3.json").read_text())  # Moondream 3 (make_fixtures.py --md3)
IMAGES = mf.make_images()
CASES = [(c, i) for c, entry in FIX["configs"].items() for i in entry["images"]]
# features: float32 torch vs float32 XLA after 27 encoder layers; the largest difference seen is 2.5e-6 (abs;
# values up to 2.5)
FEATURE_TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """config name -> (cfg, float32 params, tokenizer) of the rebuilt checkpoints."""
    # generate_reference jits a fresh closure per call: the on-disk XLA cache (as every LLM of the session turns on)
    # makes its repeated compiles loads, ~2 s -> ~0.5 s a generation
    if os.environ.get("JPHOTON_XLA_CACHE", "1") != "0":
        compiles.enable_persistent_cache(str(cache_dir().parent / "xla"))
    out = {}
    for name, entry in FIX["configs"].items():
        d = tmp_path_factory.mktemp(f"moondream_{name}")
        assert entry["seed"] == mf.CONFIGS[name]["seed"]
        f = mf.write_checkpoint(d, name)  # write_random_checkpoint (+ config c's lm_head biases)
        cfg, host = read_checkpoint(f)
        want = mf.jphoton_config(name)
        assert (cfg.text, cfg.vision, cfg.region) == (want.text, want.vision, want.region)
        out[name] = (cfg, to_device(host, jnp.float32), Tokenizer.from_file(str(d / "tokenizer.json")))
    return out


@pytest.fixture(scope="module")
def embeds(models):
    """(config, image) -> projected image features [729, D] computed by jphoton."""
    encode = jax.jit(vision_encode, static_argnums=1)
    project = jax.jit(vision_project, static_argnums=1)
    out = {}
    for c, i in CASES:
        cfg, params, _ = models[c]
        crops, tiling = overlap_crops(IMAGES[i])
        rows, cols = pool_weights(tiling)
        feats = encode(params, cfg, jnp.asarray(crops))
        out[(c, i)] = np.asarray(project(params, cfg, feats, jnp.asarray(rows), jnp.asarray(cols)))
    return out


def test_images_are_the_fixtures_images():
    assert {k: list(v.shape[:2]) for k, v in IMAGES.items()} == FIX["image_sizes"]


@pytest.mark.parametrize("image", sorted({i for _, i in CASES}))
def test_crops_match_reference(image):
    ref = next(e["images"][image] for e in FIX["configs"].values() if image in e["images"])
    crops, tiling = overlap_crops(IMAGES[image])
    assert list(tiling) == ref["tiling"]
    assert crops.shape == (ref["n_crops"], 378, 378, 3)
    assert hashlib.sha256(crops.tobytes()).hexdigest() == ref["crops_sha256"]


@pytest.mark.parametrize(("config", "image"), CASES)
def test_features_match_reference(embeds, config, image):
    ref_item = FIX["configs"][config]["images"][image]
    got = embeds[(config, image)]
    ref = FEATURES[f"{config}/{image}"]
    np.testing.assert_allclose(got[:: FIX["feature_stride"]], ref, **FEATURE_TOL)
    assert abs(float(got.mean()) - ref_item["features_mean"]) < 1e-5
    assert abs(float(got.std()) - ref_item["features_std"]) < 1e-5


def _check_generation(models, config, gen, image_embeds, **prompt_kw):
    cfg, params, tok = models[config]
    with_image = image_embeds is not None
    prompt, run = skill_prompt(prompt_kw.pop("skill"), lambda s: tok.encode(s).ids, 729, with_image=with_image,
                               **prompt_kw)
    if with_image:  # BOS + the image run come from the image; the reference prefills the template from pos 730
        assert run == (1, 729) and prompt[:730] == [cfg.bos_id] * 730 and gen["pos"] == 730
        body = prompt[730:]
    else:
        assert run == (0, 0) and gen["pos"] == 0
        body = prompt
    assert body == gen["prompt"]
    ids = generate_reference(params, cfg, body, image_embeds, max_tokens=FIX["max_tokens"])
    assert ids == gen["ids"], f"min top-2 margin in the reference {gen['min_margin']:.3g}"


@pytest.mark.parametrize(("config", "image"), CASES)
def test_image_generation_matches_reference(models, embeds, config, image):
    item = FIX["configs"][config]["images"][image]
    emb = embeds[(config, image)]
    for gen in item["query"]:
        _check_generation(models, config, gen, emb, skill="query", question=gen["question"])
    for gen in item["caption"]:
        _check_generation(models, config, gen, emb, skill="caption", length=gen["length"])


@pytest.mark.parametrize("config", sorted(FIX["configs"]))
def test_text_only_query_matches_reference(models, config):
    for gen in FIX["configs"][config]["text_only"]:
        _check_generation(models, config, gen, None, skill="query", question=gen["question"])


@pytest.mark.parametrize("config", sorted(MD3["configs"]))
def test_moondream3_generation_matches_reference(tmp_path, config):
    """Moondream 3's file (MoE from layer moe_start, tau attention, linear region decoders) read back into its
    config, and generate_reference's greedy ids equal the reference's for image queries (one answer token in the
    template), captions and text-only queries."""
    entry = MD3["configs"][config]
    f = mf.write_checkpoint(tmp_path, config)
    cfg, host = read_checkpoint(f)
    want = mf.jphoton_config(config)
    assert (cfg.text, cfg.vision, cfg.region, cfg.answer_suffixes, cfg.decode_banned) == (
        want.text, want.vision, want.region, 1, ())
    params = to_device(host, jnp.float32)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    gens = [(None, g, dict(skill="query", question=g["question"])) for g in entry["text_only"]]
    for image, item in entry["images"].items():
        crops, tiling = overlap_crops(IMAGES[image])
        rows, cols = pool_weights(tiling)
        feats = vision_project(params, cfg, vision_encode(params, cfg, jnp.asarray(crops)), jnp.asarray(rows),
                               jnp.asarray(cols))
        gens += [(feats, g, dict(skill="query", question=g["question"])) for g in item["query"]]
        gens += [(feats, g, dict(skill="caption", length=g["length"])) for g in item["caption"]]
    for emb, gen, kw in gens:
        prompt, _ = skill_prompt(kw.pop("skill"), lambda s: tok.encode(s).ids, 729, with_image=emb is not None,
                                 answer_suffixes=cfg.answer_suffixes, **kw)
        body = prompt[730:] if emb is not None else prompt  # (the fixture's image prompts: BOS + the template)
        assert ([cfg.bos_id, *body] if emb is not None else body) == gen["prompt"]
        ids = generate_reference(params, cfg, body, emb, max_tokens=MD3["max_tokens"])
        assert ids == gen["ids"], f"min top-2 margin in the reference {gen['min_margin']:.3g}"


def test_moondream3_shards_read_as_one_file_and_bad_ones_are_refused(tmp_path):
    """The same Moondream 3 checkpoint as one file and as two shards under model.safetensors.index.json: the same
    config and params; an index naming a missing tensor or a shard outside its folder is a ValueError."""
    from safetensors.numpy import load_file, save_file

    from jphoton.weights.moondream import INDEX, checkpoint_file

    one = mf.write_checkpoint(tmp_path / "one", "m3")
    tensors = load_file(str(one))
    keys = sorted(tensors)
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((tmp_path / "one" / "tokenizer.json").read_bytes())
    (d / "config.json").write_bytes((tmp_path / "one" / "config.json").read_bytes())
    weight_map = {}
    for i, part in enumerate((keys[::2], keys[1::2])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(d / name))
        weight_map.update(dict.fromkeys(part, name))
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert checkpoint_file(d) == d / INDEX
    (cfg_a, host_a), (cfg_b, host_b) = read_checkpoint(one), read_checkpoint(checkpoint_file(d))
    assert cfg_a == cfg_b and cfg_a.text.n_experts == 8 and cfg_a.text.experts_per_token == 2
    flat_a, flat_b = jax.tree.leaves(host_a), jax.tree.leaves(host_b)
    assert len(flat_a) == len(flat_b) and all(np.array_equal(np.asarray(a), np.asarray(b))
                                              for a, b in zip(flat_a, flat_b, strict=True))
    (d / INDEX).write_text(json.dumps({"weight_map": {**weight_map, "model.text.extra": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="not in their shards"):
        read_checkpoint(d / INDEX)
    (d / INDEX).write_text(json.dumps({"weight_map": {k: "../one/model.safetensors" for k in weight_map}}))
    with pytest.raises(ValueError, match="beside the index"):
        read_checkpoint(d / INDEX)


@pytest.mark.parametrize(("case", "image"), [(c, i) for c, e in SPATIAL["cases"].items() for i in e["images"]])
def test_point_and_detect_match_reference(models, embeds, case, image):
    """The reference's point / detect: its prompt ids, its region heads' bins object by object (to the bin), the
    number of objects (max_objects, or eos: one object, none), its normalized points and boxes."""
    entry = SPATIAL["cases"][case]
    cfg, params, tok = models[entry["config"]]
    bias = params["text"]["lm_head_b"]
    for t, add in entry["lm_head_bias"].items():  # (the fixture's checkpoint: the config's plus these, float32)
        bias = bias.at[int(t)].add(np.float32(add))
    params = {**params, "text": {**params["text"], "lm_head_b": bias}}
    emb = embeds[(entry["config"], image)]
    for run in entry["images"][image]:
        prompt, span = skill_prompt(run["skill"], lambda s: tok.encode(s).ids, 729, with_image=True, obj=run["object"])
        assert span == (1, 729) and run["pos"] == 730 and prompt[730:] == run["prompt"]
        bins = generate_spatial_reference(params, cfg, run["prompt"], emb, include_size=run["skill"] == "detect",
                                          max_objects=entry["max_objects"])
        assert [list(b) for b in bins] == run["bins"], (run["skill"], run["object"], entry["min_margin"])
        got = normalize(bins, cfg.region.coord_out_dim, cfg.region.size_out_dim // 2)
        assert len(got) == len(run["answer"]) and all(len(g) == (2 if run["skill"] == "point" else 4) for g in got)
        np.testing.assert_allclose(np.asarray(got).reshape(-1), np.asarray(run["answer"]).reshape(-1), rtol=0,
                                   atol=1e-6)
    counts = {len(r["bins"]) for r in entry["images"][image]}
    assert counts <= set(range(entry["max_objects"] + 1))


def _adaptive_avg_pool(x: np.ndarray, out: int) -> np.ndarray:
    """[H, W, E] -> [out, out, E], torch's adaptive_avg_pool2d windows: floor(i*n/out) .. ceil((i+1)*n/out)."""
    H, W = x.shape[:2]
    y = np.zeros((out, out, x.shape[2]))
    for i in range(out):
        r0, r1 = (i * H) // out, -(-((i + 1) * H) // out)
        for j in range(out):
            c0, c1 = (j * W) // out, -(-((j + 1) * W) // out)
            y[i, j] = x[r0:r1, c0:c1].mean(axis=(0, 1))
    return y


def _stitch(feats: np.ndarray, th: int, tw: int, margin: int) -> np.ndarray:
    """[th*tw, g, g, E] local crops' features -> the stitched grid, each crop keeping its margins only at the
    image's border."""
    g = feats.shape[1]
    step = g - 2 * margin
    out = np.full((step * th + 2 * margin, step * tw + 2 * margin, feats.shape[3]), np.nan)
    for c in range(th * tw):
        i, j = divmod(c, tw)
        r0, r1 = (0 if i == 0 else margin), (g if i == th - 1 else g - margin)
        c0, c1 = (0 if j == 0 else margin), (g if j == tw - 1 else g - margin)
        out[i * step + r0: i * step + r1, j * step + c0: j * step + c1] = feats[c, r0:r1, c0:c1]
    assert not np.isnan(out).any()
    return out


@pytest.mark.parametrize("tiling", [(h, w) for h in range(1, 13) for w in range(1, 13) if h * w <= 12])
def test_pool_weights_are_stitch_and_pool(tiling):
    th, tw = tiling
    g, margin, E = 27, 4, 3
    rng = np.random.default_rng(th * 100 + tw)
    feats = rng.standard_normal((th * tw, g, g, E))
    want = _adaptive_avg_pool(_stitch(feats, th, tw, margin), g)
    rows, cols = pool_weights(tiling, g, margin, num_crops=13)
    assert rows.shape == cols.shape == (13, g, g) and rows.dtype == np.float32
    assert not rows[th * tw:].any() and not cols[th * tw:].any()
    padded = np.concatenate([feats, rng.standard_normal((13 - th * tw, g, g, E))])  # padding crops weigh nothing
    got = np.einsum("cij,cjkd,clk->ild", rows.astype(np.float64), padded, cols.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend, want", [("cpu", jnp.float32), ("gpu", jnp.bfloat16)])
def test_default_dtype_is_the_engines(monkeypatch, tmp_path, backend, want):
    """dtype None loads as every model does (weights/load.py resolve_dtype): bfloat16 on an accelerator. It once became
    numpy's float64, truncated to float32: a Moondream 2 served from its checkpoint in float32 by default on the GPU
    (decode 2.4x slower)."""
    from jphoton.weights import load as load_lib
    from jphoton.weights.moondream import load

    monkeypatch.setattr(load_lib.jax, "default_backend", lambda: backend)
    f = mf.write_checkpoint(tmp_path, "a")
    _, params, _, _ = load(str(f.parent), None)
    assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(want)}


@pytest.mark.parametrize("n", [1, 5, 40])
def test_gemv_products_match_xla(models, n):
    """The GPU default for Moondream ("fused": each text-layer product of <= 32 tokens through the Pallas GEMV,
    interpret mode here; per-layer params) equals the plain XLA forward over the stacked layers, at 1, 5 and 40
    tokens (40: XLA dots again)."""
    from jphoton.models.matmul import XlaMatmul
    from jphoton.models.moondream import dense_attend, serving_layout, text_forward

    cfg, params, _ = models["a"]
    t = cfg.text
    tokens = jnp.asarray(np.random.default_rng(n).integers(0, t.vocab_size, n), jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32)
    cache = jnp.zeros((t.n_layers, 64, t.n_heads, t.head_dim), jnp.float32)

    def hidden(p, mm):
        return np.asarray(text_forward(p, cfg, tokens, pos, (cache, cache, pos, n), dense_attend(0), matmul=mm)[0])

    want = hidden(params, None)
    serving = serving_layout(params)
    assert "wqkv_fc1" in serving["text"]["layers"][0] and "wqkv" not in serving["text"]["layers"][0]
    got = hidden(serving, XlaMatmul(dense_gemv=True, interpret=True))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_serving_layout_vision_matches_stacked(models):
    """The serving layout's vision encoder (per-layer params, unrolled) equals the scan over the stacked layers."""
    from jphoton.models.moondream import serving_layout
    from jphoton.models.moondream_vision import vision_encode

    cfg, params, _ = models["a"]
    S = cfg.vision.crop_size
    crops = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, S, S, 3)), jnp.uint8)
    serving = serving_layout(params)
    assert isinstance(serving["vision"]["layers"], tuple) and len(serving["vision"]["layers"]) == cfg.vision.n_layers
    np.testing.assert_allclose(np.asarray(vision_encode(serving, cfg, crops)), np.asarray(vision_encode(params, cfg, crops)),
                               rtol=2e-5, atol=2e-5)
