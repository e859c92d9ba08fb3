"""HF PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors`, read into numpy (engine: models/lora.py).

Plain LoRA only: q/k/v/o/gate/up/down projections of the decoder layers, any rank (capped by max_lora_rank), scaling
lora_alpha / r (or / sqrt(r) with use_rslora); anything more (DoRA, modules_to_save, embedding or LM-head targets,
biases, per-module ranks) is refused with a clear error, never loaded half-way. A file is treated as hostile: the
config is size-capped, `target_modules` matched literally (never compiled as a pattern), weights not finite in the
engine's dtype refused, and errors never echo the file's values. With `allowed_dirs` (the server's `--lora-dir`) a
file is opened only if its real path (symlinks resolved) lies inside one of them, and any other path gets one
message whatever it names (`ADAPTER_PATH_REFUSED`), so a caller learns nothing of the file system.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re

import numpy as np
from safetensors import SafetensorError, safe_open

from jphoton.models.config import ModelConfig
from jphoton.models.lora import TARGETS, target_dims

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?"
                  r"\.weight$")
MAX_CONFIG_BYTES = 64 * 2**10  # adapter_config.json (real ones are ~1 KB)
ADAPTER_PATH_REFUSED = ("LoRA adapter path refused: it must name a PEFT adapter directory (adapter_config.json + "
                        "adapter_model.safetensors) inside a directory the server allows (--lora-dir)")


@dataclasses.dataclass
class PeftAdapter:
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]  # (layer, target) -> (lora_A [r, in], lora_B [out, r])
    source: str = ""


def _fail(path, why: str) -> ValueError:
    shown = str(path)
    return ValueError(f"LoRA adapter {shown if len(shown) <= 200 else shown[:200] + '...'!r}: {why}")


def _kind(value) -> str:
    """A value from the file, described without echoing it (a hostile file may be a secret symlinked into place)."""
    return f"a {type(value).__name__}" if not isinstance(value, (bool, int, float)) or isinstance(value, bool) \
        else repr(value)


def _inside(real: str, roots: list[str]) -> bool:
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def resolve_adapter_dir(path: str | os.PathLike, allowed_dirs) -> pathlib.Path:
    """The real directory `path` names (relative paths: under the first of `allowed_dirs`), if it lies inside one of
    `allowed_dirs` (symlinks resolved). ValueError(ADAPTER_PATH_REFUSED) otherwise, the same for every path: missing,
    a file, outside, unreadable, or no directories allowed."""
    roots = [os.path.realpath(d) for d in (allowed_dirs or ())]
    try:
        text = os.fspath(path)
        if not roots or not text or "\0" in text or len(text) > 4096:
            raise ValueError
        real = os.path.realpath(text if os.path.isabs(text) else os.path.join(roots[0], text))
        if not _inside(real, roots) or not os.path.isdir(real):
            raise ValueError
    except (ValueError, TypeError, OSError):
        raise ValueError(ADAPTER_PATH_REFUSED) from None
    return pathlib.Path(real)


def _adapter_file(path: pathlib.Path, name: str, roots: list[str] | None, missing: str, label) -> pathlib.Path:
    """path/name as a regular file (inside `roots` once symlinks are resolved, when given), else ValueError: `missing`
    without roots, the one refusal with them."""
    file = path / name
    if roots is not None:
        real = os.path.realpath(file)
        if not _inside(real, roots) or not os.path.isfile(real):
            raise ValueError(ADAPTER_PATH_REFUSED)
        return pathlib.Path(real)
    if not file.is_file():
        raise _fail(label, missing)
    return file


def read_peft_config(path: pathlib.Path, roots: list[str] | None = None, label=None) -> dict:
    label = path if label is None else label
    file = _adapter_file(path, "adapter_config.json", roots,
                         "no adapter_config.json (expected a HF PEFT adapter directory)", label)
    try:
        with open(file, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError:
        raise (ValueError(ADAPTER_PATH_REFUSED) if roots is not None
               else _fail(label, "adapter_config.json cannot be read")) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise _fail(label, f"adapter_config.json is over {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError):  # (a JSON error's text quotes no file content, but say nothing more)
        raise _fail(label, "adapter_config.json is not valid JSON") from None
    if not isinstance(config, dict):
        raise _fail(label, "adapter_config.json is not a JSON object")
    return config


def _check_config(path, config: dict, max_rank: int) -> tuple[int, float, set[str]]:
    """(rank, scaling, targets) of a plain-LoRA config; ValueError for anything else."""
    kind = config.get("peft_type", "LORA")
    if not isinstance(kind, str) or kind.upper() != "LORA":
        raise _fail(path, "peft_type is not LORA (plain LoRA only)")
    unsupported = {
        "use_dora": "DoRA", "modules_to_save": "modules_to_save", "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)", "layers_to_transform": "layers_to_transform",
        "trainable_token_indices": "trainable tokens", "lora_bias": "LoRA biases", "use_qalora": "QA-LoRA",
        "megatron_config": "Megatron LoRA", "layer_replication": "layer replication",
        "alora_invocation_tokens": "activated LoRA (aLoRA)", "arrow_config": "Arrow routing",
        "kasa_config": "KaSA", "monteclora_config": "MonteCLoRA", "velora_config": "VeLoRA",
        "use_bdlora": "block-diagonal LoRA", "target_parameters": "target_parameters",
        "fan_in_fan_out": "fan_in_fan_out (transposed weights)",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise _fail(path, f"{what} is not supported (plain LoRA only)")
    if config.get("bias", "none") != "none":
        raise _fail(path, "bias is not 'none' (LoRA biases are not supported)")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _fail(path, f"r must be a positive integer, got {_kind(r)}")
    if r > max_rank:
        raise _fail(path, f"rank {r} exceeds max_lora_rank={max_rank} (start the engine with a larger max_lora_rank)")
    alpha = config.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _fail(path, f"lora_alpha must be a finite number, got {_kind(alpha)}")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    targets = config.get("target_modules")
    if isinstance(targets, str):
        # PEFT reads a string as a regular expression; one from a downloaded file is never compiled here (a
        # catastrophic pattern would spin the reader): the module names themselves, or "all-linear"
        if targets == "all-linear":
            targets = list(TARGETS)
        elif targets.rsplit(".", 1)[-1] in TARGETS:
            targets = [targets]
        else:
            raise _fail(path, "target_modules as a pattern is not supported: list the module names "
                              f"({', '.join(TARGETS)}) or use 'all-linear'")
    if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) for t in targets):
        raise _fail(path, "target_modules must be a non-empty list of module names")
    names = {t.rsplit(".", 1)[-1] for t in targets}
    bad = sorted(names - set(TARGETS))
    if bad:
        shown = "[" + ", ".join(repr(b[:40]) for b in bad[:4]) + (", ...]" if len(bad) > 4 else "]")
        raise _fail(path, f"target modules {shown} are not supported (supported: {', '.join(TARGETS)})")
    return r, float(scaling), names


def load_peft_adapter(path: str | pathlib.Path, cfg: ModelConfig, max_rank: int, *, allowed_dirs=None,
                      max_abs: float = float(np.finfo(np.float32).max)) -> PeftAdapter:
    """Read and check a PEFT LoRA adapter for a model of config `cfg`; ValueError names what does not fit.
    allowed_dirs: open nothing outside these directories (`resolve_adapter_dir`). max_abs: the largest magnitude the
    engine's dtype holds; a weight (B times the scaling) beyond it, or not finite, is refused."""
    label = path  # what errors and list_loras() name: the caller's path, never what a symlink resolved to
    roots = None
    if allowed_dirs is not None:
        path = resolve_adapter_dir(path, allowed_dirs)
        roots = [os.path.realpath(d) for d in allowed_dirs]
    path = pathlib.Path(path)
    if roots is None and not path.is_dir():
        raise _fail(label, "not a directory")
    if cfg.num_experts:
        raise _fail(label, "LoRA is supported for dense Llama-family models only, not MoE")
    rank, scaling, targets = _check_config(label, read_peft_config(path, roots, label), max_rank)
    file = _adapter_file(path, "adapter_model.safetensors", roots,
                         "no adapter_model.safetensors (pickled adapter_model.bin is not loaded, by design)", label)
    dims = target_dims(cfg)
    # the largest file a rank-`rank` adapter of this model can be (every target of every layer, float32), plus its
    # header: a bigger one is refused before it is read
    most = cfg.num_layers * rank * sum(d_in + d_out for d_in, d_out in dims.values()) * 4 + 2**20
    try:
        size = os.path.getsize(file)
    except OSError:
        raise (ValueError(ADAPTER_PATH_REFUSED) if roots is not None
               else _fail(label, "adapter_model.safetensors cannot be read")) from None
    if size > most:
        raise _fail(label, f"adapter_model.safetensors is {size} bytes; a rank-{rank} adapter of this model is at "
                          f"most {most}")
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    try:
        with safe_open(str(file), framework="numpy") as f:
            for key in f.keys():
                m = _KEY.match(key)
                shown = repr(key if len(key) <= 80 else key[:80] + "...")
                if m is None:
                    raise _fail(label, f"tensor {shown} is not a LoRA A/B weight of a decoder projection")
                layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
                if target not in TARGETS:
                    raise _fail(label, f"tensor {shown}: target {target[:40]!r} is not supported")
                if layer >= cfg.num_layers:
                    raise _fail(label, f"tensor {shown}: the model has {cfg.num_layers} layers")
                parts.setdefault((layer, target), {})[ab] = np.asarray(f.get_tensor(key), np.float32)
    except (SafetensorError, OSError) as e:
        raise _fail(label, f"corrupt or truncated adapter_model.safetensors ({str(e)[:200]})") from None
    weights = {}
    for (layer, target), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise _fail(label, f"layer {layer} {target}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        d_in, d_out = dims[target]
        if a.shape != (rank, d_in) or b.shape != (d_out, rank):
            raise _fail(label, f"layer {layer} {target}: lora_A {a.shape}, lora_B {b.shape}; expected "
                              f"{(rank, d_in)} and {(d_out, rank)} for rank {rank} on this model")
        if target not in targets:
            raise _fail(label, f"layer {layer} {target}: weights for a module not in target_modules")
        # One tenant's adapter must never reach another's rows: a NaN or inf weight (or one the engine's dtype
        # overflows to inf) is refused here; models/lora.py keeps other rows exact even so.
        for which, w, scale in (("lora_A", a, 1.0), ("lora_B", b, abs(scaling))):
            if not np.isfinite(w).all():
                raise _fail(label, f"layer {layer} {target}: {which} holds values that are not finite (NaN or inf)")
            if w.size and float(np.abs(w).max()) * scale > max_abs:
                raise _fail(label, f"layer {layer} {target}: {which} (times the scaling) exceeds {max_abs:.3g}, the "
                                  "largest value the engine's dtype holds")
        weights[(layer, target)] = (a, b)
    if not weights:
        raise _fail(label, "adapter_model.safetensors holds no LoRA weights")
    return PeftAdapter(rank, scaling, weights, str(label))
