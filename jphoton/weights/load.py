"""One entry point for every model source: HF dir, GGUF file, jphoton store, `random:NAME`, or None (embedded)."""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import time

import jax
import jax.numpy as jnp

from jphoton.models.config import ModelConfig
from jphoton.models.llama import check_params
from jphoton.text.tokenizer import Tokenizer
from jphoton.weights import hf, store
from jphoton.weights.embedded import embedded_model_path
from jphoton.weights.random_init import parse_random_spec, random_params

log = logging.getLogger("jphoton.weights")

_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
           "float16": jnp.float16, "fp16": jnp.float16}


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict
    tokenizer: Tokenizer | None
    source: str
    dtype: jnp.dtype
    loaded_from: str = ""  # how it was read: "random", "HF safetensors", "GGUF", "GGUF (cached ...)", "jphoton store"


def resolve_dtype(dtype) -> jnp.dtype:
    """None -> float32 on CPU, bfloat16 on accelerators."""
    if dtype is None:
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(sorted(_DTYPES))}")
        return jnp.dtype(_DTYPES[dtype])
    try:
        d = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"unknown dtype {dtype!r}") from None
    if d not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {d}")
    return d


def load_model(source: str | pathlib.Path | None = None, dtype=None, *, cache: bool | None = None,
               progress: bool = False, mesh=None, serving_layout: bool = False, per_layer: bool = False
               ) -> LoadedModel:
    """Load a model. `cache` (default: on for GGUF) keeps an orbax copy of the converted params, keyed by the source
    file's path, size and mtime and the dtype, so a second load skips dequantization. `None` or "embedded": the
    embedded SmolLM2-135M-Instruct. mesh: place the weights on their tensor-parallel shards as they load
    (models/tensor_parallel.py; a jphoton store or cached conversion loads onto one device and is placed after).
    serving_layout, per_layer: random weights only, built directly in the engine's layout (weights/random_init.py)."""
    dt = resolve_dtype(dtype)
    t0 = time.perf_counter()
    if source is None or source == "embedded":
        path = embedded_model_path()
        name = f"embedded:{path.name}"
    elif isinstance(source, str) and source.startswith("random:"):
        cfg = parse_random_spec(source)
        _check_mesh(cfg, mesh)
        params = random_params(cfg, dt, fused=serving_layout, per_layer=per_layer, mesh=mesh)
        where = f"{mesh.size} {jax.default_backend()} devices" if mesh is not None else jax.default_backend()
        log.info("random weights %s (%s) built on %s", source, dt.name, where)
        return LoadedModel(cfg, params, None, source, dt, "random")
    else:
        path = pathlib.Path(source).expanduser()
        name = str(path)
        if not path.exists():
            raise ValueError(f"model path does not exist: {path}")

    if store.is_store(path):
        cfg, params, tok = store.load_store(path, dt)
        kind = "jphoton store"
    elif hf.is_hf_dir(path):
        cfg, params = hf.load_hf_dir(path, dt, progress=progress, mesh=mesh)
        cfg = _with_generation_eos(cfg, path)
        tok = Tokenizer.from_hf_dir(path)
        kind = "HF safetensors"
    elif path.is_file() and _is_gguf(path):
        use_cache = True if cache is None else cache
        cached = store.cache_dir() / store.cache_key(path, dt) if use_cache else None
        if cached is not None and store.is_store(cached):
            cfg, params, tok = store.load_store(cached, dt)
            kind = f"GGUF (cached conversion {cached})"
        else:
            from jphoton.weights import gguf_file  # gguf-py is only needed for GGUF sources

            cfg, params, tok = gguf_file.load_gguf(path, dt, progress=progress, mesh=mesh)
            kind = "GGUF"
            if cached is not None:
                try:
                    store.save_store(cached, cfg, params, tok)
                    log.info("cached converted params at %s", cached)
                except (OSError, ValueError) as e:
                    log.warning("could not cache converted params at %s: %s", cached, e)
    elif path.is_dir():
        raise ValueError(f"{path}: not a model directory (no config.json, no {store.MARKER})")
    else:
        raise ValueError(f"{path}: unrecognised model file (expected a .gguf file, a HF directory or a jphoton store)")
    if mesh is None:  # (placed leaves were checked one by one: replicated KV heads widen wk / wv on the mesh)
        check_params(cfg, params)
    log.info("loaded %s from %s as %s in %.2fs", cfg.name or name, kind, dt.name, time.perf_counter() - t0)
    return LoadedModel(cfg, params, tok, name, dt, kind)


def load_tokenizer(source: str | pathlib.Path | None = None) -> Tokenizer | None:
    """A model source's tokenizer without its weights (None for `random:` sources and models without one): from a
    cached conversion of a GGUF file if there is one (any dtype), else from the file's metadata."""
    if isinstance(source, str) and source.startswith("random:"):
        return None
    path = embedded_model_path() if source is None or source == "embedded" else pathlib.Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"model path does not exist: {path}")
    if store.is_store(path) or (path.is_file() and _is_gguf(path)):
        stores = [path] if store.is_store(path) else [store.cache_dir() / store.cache_key(path, d)
                                                       for d in ("float32", "bfloat16", "float16")]
        for s in stores:
            if store.is_store(s):
                return Tokenizer.from_hf_dir(s / "tokenizer") if (s / "tokenizer").is_dir() else None
        from jphoton.weights import gguf_file

        return gguf_file.read_tokenizer(gguf_file.open_gguf(path))
    if hf.is_hf_dir(path):
        return Tokenizer.from_hf_dir(path)
    raise ValueError(f"{path}: unrecognised model source (expected a .gguf file, a HF directory or a jphoton store)")


def _check_mesh(cfg: ModelConfig, mesh) -> None:
    """A clear error before any weight is made if the model does not shard over the mesh."""
    if mesh is not None:
        from jphoton.models import tensor_parallel

        tensor_parallel.check(cfg, mesh.size)


def _is_gguf(path: pathlib.Path) -> bool:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return True
    if path.suffix == ".gguf":
        raise ValueError(f"{path}: corrupt or truncated GGUF file (bad magic {magic!r})")
    return False


def _with_generation_eos(cfg: ModelConfig, path: pathlib.Path) -> ModelConfig:
    """Instruct checkpoints often list extra end-of-turn ids in generation_config.json; stop on all of them."""
    import json

    gen = path / "generation_config.json"
    if not gen.is_file():
        return cfg
    try:
        eos = json.loads(gen.read_text()).get("eos_token_id")
    except json.JSONDecodeError:
        log.warning("%s is not valid JSON; ignored", gen)
        return cfg
    extra = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return cfg.replace(eos_token_ids=tuple(sorted(set(cfg.eos_token_ids) | {int(e) for e in extra})))
