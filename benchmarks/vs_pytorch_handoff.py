"""The hand-off from benchmarks/vs_pytorch.py's parent process (torch, the HF rows) to its jphoton child: the weights
as raw .npy files (bf16 as uint16 words), HF's config.json and the agreement reference, in /dev/shm when it has room."""

from __future__ import annotations

import json
import pathlib
import shutil
import tempfile

import numpy as np


def handoff_dir(nbytes: int) -> pathlib.Path:
    """/dev/shm (memory) when it has room for the weights twice over, else the default temp dir."""
    shm = pathlib.Path("/dev/shm")
    roomy = shm.is_dir() and shutil.disk_usage(shm).free > 2 * nbytes
    return pathlib.Path(tempfile.mkdtemp(prefix="vs_pytorch_", dir=shm if roomy else None))


def write_handoff(d: pathlib.Path, config_json: str, arrays: dict, ref: dict | None, budget_left: float, *,
                  dtype: str, weight_bytes: int) -> None:
    """The weights (raw .npy, bf16 as uint16 words), HF's config.json and the agreement reference, for the child."""
    manifest = {}
    for i, (key, a) in enumerate(arrays.items()):
        kind = str(a.dtype)
        np.save(d / f"{i}.npy", a.view(np.uint16) if kind == "bfloat16" else a)
        manifest[key] = [f"{i}.npy", kind]
    if ref is not None:
        np.savez(d / "ref.npz", **ref)
    (d / "handoff.json").write_text(json.dumps({"config": config_json, "arrays": manifest, "budget_left": budget_left,
                                               "dtype": dtype, "weight_bytes": weight_bytes}))


def read_handoff(d: pathlib.Path) -> tuple[str, dict, dict | None, dict]:
    import ml_dtypes

    h = json.loads((d / "handoff.json").read_text())
    arrays = {}
    for key, (name, dtype) in h["arrays"].items():
        a = np.load(d / name)  # a transposed view was saved in Fortran order and comes back as one
        arrays[key] = a.view(ml_dtypes.bfloat16) if dtype == "bfloat16" else a
    ref = dict(np.load(d / "ref.npz")) if (d / "ref.npz").exists() else None
    return h["config"], arrays, ref, h
