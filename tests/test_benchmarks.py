"""The benchmark harnesses' own plumbing (the numbers themselves come from GPU runs, benchmarks/RESULTS.md)."""

from __future__ import annotations

import ml_dtypes
import numpy as np


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


def test_host_overhead_runs_the_real_scheduler_without_a_device():
    from benchmarks.host_overhead import run

    row = run(batch=4, ticks=40, seed=0)
    assert row["decode_ticks"] > 10  # full decode steps happened between the replacements' prefills
    assert 0 < row["plan_us"] < 1e5 and 0 < row["commit_us"] < 1e5


def test_sampler_noise_benchmark_times_both_noise_sources():
    from benchmarks.sampler_noise import run

    (row,) = run([4], vocab=300, reps=2, rounds=1)
    assert row["hash_us"] > 0 and row["threefry_us"] > 0 and row["hash_over_threefry"] > 0


def test_sampler_noise_variants_really_swap_the_noise():
    """The hash variant is the engine's sampler; the threefry one draws other tokens (one trace per variant)."""
    import jax.numpy as jnp

    from benchmarks.sampler_noise import NOISE, sampler
    from jphoton.sampling import sample_plain, seed_key_data

    n = 64
    args = (jnp.zeros((n, 1000)), jnp.ones(n), jnp.asarray(seed_key_data(np.arange(n))), jnp.arange(n, dtype=jnp.int32))
    hashed, threefry = (np.asarray(sampler(NOISE[k], args)(*args)) for k in ("hash", "threefry"))
    np.testing.assert_array_equal(hashed, np.asarray(sample_plain(*args)))
    assert (hashed != threefry).mean() > 0.9
