"""Moondream 2 served by the engine (`LLM.query` / `LLM.caption`: paged KV, image prefill in the pipeline, the image
cache, continuous batching) against the official reference's greedy ids (tests/fixtures/moondream, made by its
make_fixtures.py with the reference implementation): every image and question of a config in one mixed batch of
image and text-only requests, then again with every image cached; nothing compiles after the warm-up and every page
is free after each test (conftest's no_leaked_pages)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from jphoton import SamplingParams

from conftest import shared_llm

HERE = pathlib.Path(__file__).parent / "fixtures" / "moondream"
_spec = importlib.util.spec_from_file_location("moondream_make_fixtures", HERE / "make_fixtures.py")
mf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mf)
FIX = json.loads((HERE / "fixtures.json").read_text())
SPATIAL = json.loads((HERE / "spatial.json").read_text())  # the reference's point / detect (make_fixtures.py --spatial)
IMAGES = mf.make_images()
GREEDY = SamplingParams(temperature=0, max_tokens=FIX["max_tokens"])
# an image run (BOS + 729) is prefilled in one chunk: one 1024-token row, beside the tests' small buckets
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=1024, decode_buckets=(1, 8), prefill_buckets=((2, 64), (1, 1024)))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """config name -> LLM over its rebuilt checkpoint (made on first use; configs share their step shapes)."""
    made, stack = {}, []

    def get(name):
        if name not in made:
            d = tmp_path_factory.mktemp(f"moondream_engine_{name}")
            mf.write_checkpoint(d, name)
            cm = shared_llm(str(d), **ENGINE)
            made[name] = cm.__enter__()
            stack.append(cm)
        return made[name]

    yield get
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


def _requests(config: str, fixtures: dict | None = None) -> list[tuple[str, object, str, list[int]]]:
    """(skill, image or None, question or caption length, the reference's ids) of every fixture case of a config
    (of fixtures.json, or of `fixtures`: md3.json)."""
    entry, out = (fixtures or FIX)["configs"][config], []
    for name, item in entry["images"].items():
        out += [("query", IMAGES[name], g["question"], g["ids"]) for g in item["query"]]
        out += [("caption", IMAGES[name], g["length"], g["ids"]) for g in item["caption"]]
    out += [("query", None, g["question"], g["ids"]) for g in entry["text_only"]]
    return out


def _answer(token_ids: list[int], finish_reason: str) -> list[int]:
    """The answer's ids as the reference returns them: without the end-of-sequence token that stopped it."""
    if finish_reason == "stop":
        assert token_ids[-1] == 0, f"stopped without eos: {token_ids}"
        return token_ids[:-1]
    assert finish_reason == "length" and len(token_ids) == GREEDY.max_tokens
    return token_ids


def _drive(llm, seqs) -> tuple[list[int], dict, dict]:
    """Queue the prepared requests at once and step the engine until all end: (ids, tokens by id, finish reasons)."""
    ids = [llm.add_request(s) for s in seqs]
    tokens, reasons = {i: [] for i in ids}, {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            tokens[out.request_id] += out.delta.token_ids
            reasons[out.request_id] = out.delta.finish_reason
    return ids, tokens, reasons


def _run_batch(llm, requests) -> list[list[int]]:
    """All requests in flight at once (the engine batches them as it can), in the order given."""
    ids, tokens, reasons = _drive(llm, [llm.prepare_skill(skill, image, text, GREEDY)
                                        for skill, image, text, _ in requests])
    return [_answer(tokens[i], reasons[i]) for i in ids]


@pytest.mark.parametrize("config", ["a", "c"])
def test_greedy_ids_equal_the_reference_in_one_mixed_batch_then_cached(engines, config):
    llm = engines(config)
    requests = _requests(config)
    want = [r[3] for r in requests]
    compiles = llm.stats()["num_compiles"]
    assert _run_batch(llm, requests) == want
    stats = llm.stats()
    images = len({id(r[1]) for r in requests if r[1] is not None})
    assert stats["image_encodes"] >= images
    # again in another order: every image is in the image cache and its prefix pages in the prefix cache
    assert _run_batch(llm, requests[::-1]) == want[::-1]
    after = llm.stats()
    assert after["image_encodes"] == stats["image_encodes"] and after["image_cache_hits"] > stats["image_cache_hits"]
    assert after["prefix_hit_tokens"] - stats["prefix_hit_tokens"] >= images * 729
    assert after["num_compiles"] == compiles, "compiled while serving after the warm-up"


def test_one_request_at_a_time_and_a_stream_aborted_mid_answer(engines):
    llm = engines("a")
    skill, image, text, want = _requests("a")[2]  # (a caption of the small image)
    out = llm.caption(image, text, GREEDY)
    assert _answer(out.token_ids, out.finish_reason) == want
    with llm.caption(image, text, GREEDY, stream=True) as stream:  # leaving early aborts: its pages are freed
        first = next(stream)
    assert first.token_ids == want[:len(first.token_ids)]
    wide = FIX["configs"]["a"]["images"]["wide"]["query"][0]
    out = llm.query(IMAGES["wide"], wide["question"], GREEDY)
    assert _answer(out.token_ids, out.finish_reason) == wide["ids"]


def test_background_warm_up_serves_images_at_the_largest_bucket_first(tmp_path):
    """warmup="background": `LLM()` returns with the vision step compiled at the largest crop bucket only (it serves
    any image: padding crops weigh nothing), the smaller buckets compile in the background; an image answered before
    and after they are in gets the reference's ids both times, and nothing compiles once all is ready."""
    from conftest import make_llm

    mf.write_checkpoint(tmp_path, "a")
    llm = make_llm(str(tmp_path), **{**ENGINE, "warmup": "background"})
    runner = llm.engine.runner
    buckets = runner.vision.crop_buckets
    assert runner.vision_ready >= {buckets[-1]}
    skill, image, text, want = _requests("a")[2]
    out = llm.caption(image, text, GREEDY)
    assert _answer(out.token_ids, out.finish_reason) == want
    llm.wait_until_ready()
    assert runner.vision_ready == set(buckets)
    compiles = llm.stats()["num_compiles"]
    wide = FIX["configs"]["a"]["images"]["wide"]["query"][0]
    out = llm.query(IMAGES["wide"], wide["question"], GREEDY)
    assert _answer(out.token_ids, out.finish_reason) == wide["ids"]
    assert llm.stats()["num_compiles"] == compiles


def _spatial(case: str) -> list[tuple[str, object, str, list[list[int]]]]:
    """(skill, image, object, the reference's bins per object) of every spatial fixture run of a case."""
    entry = SPATIAL["cases"][case]
    return [(r["skill"], IMAGES[name], r["object"], r["bins"]) for name, runs in entry["images"].items() for r in runs]


def _run_spatial(llm, runs, max_objects, extra=()) -> tuple[list[list[list[int]]], list]:
    """Spatial requests (and `extra` query requests) in flight at once: each spatial request's bins per object, and
    each extra request's reference-style answer ids."""
    from jphoton import SpatialParams

    seqs = [llm.prepare_skill(skill, image, obj, SpatialParams(max_objects)) for skill, image, obj, _ in runs]
    seqs += [llm.prepare_skill(skill, image, text, GREEDY) for skill, image, text, _ in extra]
    ids, tokens, reasons = _drive(llm, seqs)
    bins = [[list(o) for o in s.completion().objects] for s in seqs[:len(runs)]]
    for i in ids[:len(runs)]:  # every value came back as a spatial id, eos aside
        assert all(t <= -2**24 for t in tokens[i][:len(tokens[i]) - (reasons[i] == "stop")]), tokens[i]
    return bins, [_answer(tokens[i], reasons[i]) for i in ids[len(runs):]]


def test_point_and_detect_equal_the_reference_beside_queries_at_any_batch(engines):
    """Every point / detect fixture run of config "a" with two image queries in one batch, then each alone: the
    reference's bins object by object whatever the batch; LLM.point / detect normalize them as the reference does;
    nothing compiles after the warm-up (the spatial rows ride the text steps' programs); no implicit host->device
    transfer in the steady loop (the values stay on the device between steps)."""
    import jax
    import numpy as np

    llm = engines("a")
    runs, entry = _spatial("a"), SPATIAL["cases"]["a"]
    queries = [r for r in _requests("a") if r[0] == "query" and r[1] is not None][:2]
    compiles = llm.stats()["num_compiles"]
    bins, answers = _run_spatial(llm, runs, entry["max_objects"], queries)
    assert bins == [r[3] for r in runs]
    assert answers == [q[3] for q in queries]
    with jax.transfer_guard_host_to_device("disallow"):
        alone = [_run_spatial(llm, [r], entry["max_objects"])[0][0] for r in runs[::5]]
    assert alone == [r[3] for r in runs[::5]]
    assert llm.stats()["num_compiles"] == compiles, "compiled while serving after the warm-up"
    first = entry["images"]["wide"][2]  # a detect run
    boxes = llm.detect(IMAGES["wide"], first["object"], max_objects=entry["max_objects"])
    np.testing.assert_allclose(np.asarray(boxes), np.asarray(first["answer"]), rtol=0, atol=1e-6)
    assert llm.point([IMAGES["small"], IMAGES["tall"]], "w42", max_objects=2) == [
        [tuple(p) for p in entry["images"][name][0]["answer"][:2]] for name in ("small", "tall")]


@pytest.mark.parametrize("depth", [1, 3])
def test_eos_ends_an_answer_early_or_at_once_at_every_depth(tmp_path, depth):
    """Case "a-eos" (eos biased): one object then eos, no object at all, or max_objects, at pipeline depths 1 and 3;
    a zombie's extra step (launched before eos was committed) adds nothing."""
    entry = SPATIAL["cases"]["a-eos"]
    d = tmp_path / "a-eos"
    mf.write_checkpoint(d, "a", {int(k): v for k, v in entry["lm_head_bias"].items()})
    runs = _spatial("a-eos")
    with shared_llm(str(d), pipeline_depth=depth, **ENGINE) as llm:  # (released after the test: CI's memory peak)
        bins, _ = _run_spatial(llm, runs, entry["max_objects"])
    assert bins == [r[3] for r in runs]
    assert {len(b) for b in bins} >= {0, 1, entry["max_objects"]}


def test_spatial_requests_refuse_bad_input_at_submission(engines):
    from jphoton import SpatialParams

    llm = engines("a")
    image = IMAGES["small"]
    for skill, obj, params, says in [
        ("point", "", SpatialParams(3), "non-empty"),
        ("detect", "   ", SpatialParams(3), "non-empty"),
        ("point", 7, SpatialParams(3), "must be a string"),
        ("point", "w42", SpatialParams(0), "max_objects"),
        ("detect", "w42", SpatialParams(10**9), "max_objects"),
        ("point", "w42", SpatialParams(True), "max_objects"),
        ("point", "w " * 5000, SpatialParams(3), "the context holds"),  # a 10 kB object
        ("point", "w42", GREEDY, None),  # text params: the default max_objects
    ]:
        if says is None:
            assert llm.prepare_skill(skill, image, obj, params).spatial.max_objects == 50
            continue
        with pytest.raises(ValueError, match=says):
            llm.prepare_skill(skill, image, obj, params)
    with pytest.raises(ValueError, match="an image is required"):
        llm.point(None, "w42")
    with pytest.raises(ValueError, match="SpatialParams are for point"):
        llm.prepare_skill("query", image, "w42", SpatialParams(3))
    assert not llm.has_unfinished_requests()


def test_spatial_rows_preempted_and_recomputed_give_the_same_bins(tmp_path):
    """A pool too small for the batch: rows are preempted mid-answer and prefilled again from their committed spatial
    ids (embedded by the region encoders, attended causally, not as an image prefix), with the same bins."""
    mf.write_checkpoint(tmp_path, "a")
    entry = SPATIAL["cases"]["a"]
    runs = [r for r in _spatial("a") if r[1] is IMAGES["small"]]  # one image: its 92 prompt pages shared
    with shared_llm(str(tmp_path), **{**ENGINE, "num_kv_pages": 96, "page_size": 8, "warmup": "off"}) as llm:
        bins, _ = _run_spatial(llm, runs, entry["max_objects"])
        assert llm.stats()["preemptions"] > 0  # (here: 3, after 0, 7 and 14 committed spatial ids)
    assert bins == [r[3] for r in runs]


@pytest.mark.parametrize("filtered, masked", [(True, False), (False, True)])
def test_the_second_sampler_keeps_spatial_ids(filtered, masked):
    """A step with top-k / top-p or grammar rows re-samples every row in the second sampler (engine/step.py
    `resample`): a spatial row's id (image/spatial.py) is its value, not a sample, and stays; NONFINITE stays too."""
    import jax.numpy as jnp
    import numpy as np

    from jphoton.engine.slots import NONFINITE
    from jphoton.engine.step import SAMPLER_ROW_FIELDS, SamplerColumns, resample
    from jphoton.image import spatial

    R, V = 4, 64
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(R, V)), jnp.float32)
    tokens = jnp.asarray([spatial.x_id(17), 5, spatial.size_id(3, 900), NONFINITE], jnp.int32)
    rows = np.zeros((R, SAMPLER_ROW_FIELDS), np.int32)
    rows[:, SamplerColumns.TOP_P] = np.float32(1.0).view(np.int32)
    mask = np.full((R, V // 32), -1, np.int32) if masked else np.zeros((0,), np.int32)
    inputs = jnp.asarray(np.concatenate([mask.reshape(-1), rows.reshape(-1)]))
    out, *_ = resample(filtered, 0, masked, logits, tokens, None, None, jnp.zeros((0,), jnp.int32), inputs)
    out = np.asarray(out)
    assert out[0] == spatial.x_id(17) and out[2] == spatial.size_id(3, 900) and out[3] == NONFINITE
    assert out[1] == int(np.argmax(np.asarray(logits[1])))  # (temperature 0: the text row re-sampled greedily)
