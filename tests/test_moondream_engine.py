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


def _requests(config: str) -> list[tuple[str, object, str, list[int]]]:
    """(skill, image or None, question or caption length, the reference's ids) of every fixture case of a config."""
    entry, out = FIX["configs"][config], []
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


def _run_batch(llm, requests) -> list[list[int]]:
    """All requests in flight at once (the engine batches them as it can), in the order given."""
    seqs = [llm.prepare_skill(skill, image, text, GREEDY) for skill, image, text, _ in requests]
    ids = [llm.add_request(s) for s in seqs]
    tokens, reasons = {i: [] for i in ids}, {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            tokens[out.request_id] += out.delta.token_ids
            reasons[out.request_id] = out.delta.finish_reason
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
