"""Converted-model store (orbax-checkpoint): `jphoton convert SRC DEST` writes one; loads of slow sources are cached.

Layout of a store directory:
    jphoton_model.json   {"format": 1, "config": ModelConfig, "dtype": ...}
    params/              orbax checkpoint of the params pytree
    tokenizer/           tokenizer.json + tokenizer_config.json (when the model has a tokenizer)
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jphoton.models.config import ModelConfig
from jphoton.models.llama import param_shapes
from jphoton.text.tokenizer import Tokenizer

MARKER = "jphoton_model.json"
FORMAT = 1


def is_store(path: pathlib.Path) -> bool:
    return path.is_dir() and (path / MARKER).is_file()


def check_store_dest(dest: pathlib.Path) -> pathlib.Path:
    """The resolved destination of a store, or ValueError if it cannot be one (checked before converting anything)."""
    dest = pathlib.Path(dest).resolve()
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"{dest} exists and is not a directory")
    if dest.exists() and any(dest.iterdir()):
        raise ValueError(f"{dest} exists and is not empty")
    parent = next((p for p in dest.parents if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {dest}: {parent} is not a writable directory")
    return dest


def save_store(dest: pathlib.Path, cfg: ModelConfig, params: dict, tokenizer: Tokenizer | None) -> None:
    """Write atomically: into a sibling temp dir, renamed into place once complete."""
    dest = check_store_dest(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
    except OSError as e:
        raise ValueError(f"cannot write {dest}: {e.strerror or e}") from None
    try:
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(tmp / "params", params)
        ckpt.wait_until_finished()
        if tokenizer is not None:
            tokenizer.save(tmp / "tokenizer")
        dtype = str(jax.tree_util.tree_leaves(params)[0].dtype)
        (tmp / MARKER).write_text(json.dumps({"format": FORMAT, "dtype": dtype,
                                              "config": json.loads(cfg.to_json())}, indent=1))
        if dest.exists():
            dest.rmdir()
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_store(path: pathlib.Path, dtype) -> tuple[ModelConfig, dict, Tokenizer | None]:
    try:
        meta = json.loads((path / MARKER).read_text())
        cfg = ModelConfig.from_json(json.dumps(meta["config"]))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: damaged jphoton store metadata ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: store format {meta.get('format')!r}, this jphoton reads {FORMAT}")
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    saved = jnp.dtype(meta["dtype"])
    target = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, saved, sharding=sharding), param_shapes(cfg),
                                    is_leaf=lambda x: isinstance(x, tuple))
    try:
        params = ocp.StandardCheckpointer().restore((path / "params").resolve(), target)
    except Exception as e:  # orbax/tensorstore raise many types on damaged data
        raise ValueError(f"{path}: cannot restore params ({type(e).__name__}: {e})") from None
    if saved != jnp.dtype(dtype):
        params = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
    tok = Tokenizer.from_hf_dir(path / "tokenizer") if (path / "tokenizer").is_dir() else None
    return cfg, params, tok


def cache_dir() -> pathlib.Path:
    """Where converted models are cached: `converted/` in jphoton's cache directory ($JPHOTON_CACHE_DIR, else
    $XDG_CACHE_HOME/jphoton or ~/.cache/jphoton), which is made private (mode 0700: it also holds the XLA cache, whose
    programs embed the model's shapes, and a shared home must not expose either)."""
    root = pathlib.Path(os.environ.get("JPHOTON_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jphoton"))
    private_dir(root)
    return root / "converted"


def private_dir(path: pathlib.Path) -> None:
    """Make `path` (and missing parents) a directory only its owner can read (0700). An existing directory of ours that
    others can read is narrowed to 0700; one we do not own, or cannot change, is left as it is."""
    path = pathlib.Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            path.chmod(0o700)
    except OSError:  # (unwritable: loading a cached conversion or compile fails later with its own message)
        pass


def cache_key(source: pathlib.Path, dtype) -> str:
    """Changes whenever the source file changes (size, mtime) or another dtype is asked for."""
    st = source.stat()
    raw = f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}|{jnp.dtype(dtype).name}|{FORMAT}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]
