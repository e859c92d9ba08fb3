"""Moondream 3 served by the engine (tests/test_moondream_engine.py's helpers; its own module, so that its engine is
not alive beside that module's: CI's memory peak): MoE layers (warp decode for decode steps, the expert-centric path
for the image prefill), tau attention; the greedy ids of make_fixtures.py --md3 (md3.json); point / detect rows
against the plain-JAX loop with the linear region decoders."""

from __future__ import annotations

import json

import jax.numpy as jnp
from test_moondream_engine import ENGINE, HERE, IMAGES, _requests, _run_batch, _run_spatial, mf

from conftest import shared_llm

MD3 = json.loads((HERE / "md3.json").read_text())


def test_moondream3_greedy_ids_equal_the_reference_and_spatial_rows_the_plain_loop(tmp_path):
    """Every query / caption / text-only fixture in one mixed batch, then again with the images cached (nothing
    compiles); a point and a detect request beside two queries give generate_spatial_reference's bins."""
    from jphoton.image.crops import overlap_crops, pool_weights
    from jphoton.image.skills import skill_prompt
    from jphoton.models.moondream import generate_spatial_reference
    from jphoton.models.moondream_vision import vision_encode, vision_project
    from jphoton.weights.moondream import read_checkpoint, to_device

    f = mf.write_checkpoint(tmp_path, "m3")
    cfg, host = read_checkpoint(f)
    params = to_device(host, jnp.float32)  # (the reference's copy: the engine donates its own)
    crops, tiling = overlap_crops(IMAGES["wide"])
    rows, cols = pool_weights(tiling)
    emb = vision_project(params, cfg, vision_encode(params, cfg, jnp.asarray(crops)), jnp.asarray(rows),
                         jnp.asarray(cols))
    requests = _requests("m3", MD3)
    want = [r[3] for r in requests]
    with shared_llm(str(tmp_path), **ENGINE) as llm:
        assert _run_batch(llm, requests) == want
        compiles = llm.stats()["num_compiles"]
        assert _run_batch(llm, requests[::-1]) == want[::-1]
        assert llm.stats()["num_compiles"] == compiles, "compiled while serving after the warm-up"
        runs = []
        for skill in ("point", "detect"):
            prompt, _ = skill_prompt(skill, llm.requests.encode_within, 729, with_image=True, obj="w42")
            runs.append((skill, IMAGES["wide"], "w42", [list(b) for b in generate_spatial_reference(
                params, cfg, prompt[730:], emb, include_size=skill == "detect", max_objects=3)]))
        bins, answers = _run_spatial(llm, runs, 3, requests[:2])
    assert bins == [r[3] for r in runs] and answers == want[:2]
    assert {len(b) for b in bins} != {0}
