"""Moondream 2 and 3 checkpoints in the official layout: `model.safetensors` (or shards listed by
`model.safetensors.index.json`) with `model.text.*`, `model.vision.*`, `model.region.*` keys (torch [out, in]
matrices) and `tokenizer.json` beside it; the files Photon's engine loads too.

`read_checkpoint` maps them to models/moondream.py's params (x @ w layout, layers stacked), taking the sizes from the
tensors' shapes (head counts: 64-wide text heads, 72-wide vision heads, as the releases have). A Moondream 3 file is
told by its `attn.tau` tensors; its experts are 3-D `mlp.fc1` [E, 2F, D] (the GELU half first) and `mlp.fc2` [E, D, F]
with a `mlp.router`; what the shapes do not say (RoPE theta, experts per token, the context) is the release's
(`MOONDREAM3`). `write_random_checkpoint` writes a small seeded one in the same layout (tests, fixtures);
`random_params` builds the real shape on the device.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from jphoton.models.moondream import MoondreamConfig, RegionConfig, TextConfig, VisionConfig, param_shapes

TEXT_HEAD_DIM, VISION_HEAD_DIM = 64, 72
# Moondream 3 (moondream3-preview) where the tensors do not say: 64 experts, 8 a token, from layer 4 on; RoPE theta
MOONDREAM3 = MoondreamConfig(
    text=TextConfig(rope_theta=1_500_000.0, max_context=4096, n_experts=64, experts_per_token=8, expert_dim=1024,
                    moe_start=4, tau=True),
    region=RegionConfig(linear_decoders=True), name="moondream3", answer_suffixes=1, decode_banned=())

# official key (after "model.") -> (group, our key, transpose); "{i}" = a block index
_TOP = {
    "text.wte": ("text", "embed", False), "text.post_ln.weight": ("text", "post_ln_w", False),
    "text.post_ln.bias": ("text", "post_ln_b", False), "text.lm_head.weight": ("text", "lm_head", True),
    "text.lm_head.bias": ("text", "lm_head_b", False),
    "vision.patch_emb.weight": ("vision", "patch_w", True), "vision.patch_emb.bias": ("vision", "patch_b", False),
    "vision.pos_emb": ("vision", "pos", False), "vision.post_ln.weight": ("vision", "post_ln_w", False),
    "vision.post_ln.bias": ("vision", "post_ln_b", False),
    "vision.proj_mlp.fc1.weight": ("vision", "proj_fc1", True), "vision.proj_mlp.fc1.bias": ("vision", "proj_b1", False),
    "vision.proj_mlp.fc2.weight": ("vision", "proj_fc2", True), "vision.proj_mlp.fc2.bias": ("vision", "proj_b2", False),
    "region.coord_features": ("region", "coord_features", False),
    "region.size_features": ("region", "size_features", False),
    "region.coord_encoder.weight": ("region", "coord_enc_w", True),
    "region.coord_encoder.bias": ("region", "coord_enc_b", False),
    "region.coord_decoder.fc1.weight": ("region", "coord_dec_fc1", True),
    "region.coord_decoder.fc1.bias": ("region", "coord_dec_b1", False),
    "region.coord_decoder.fc2.weight": ("region", "coord_dec_fc2", True),
    "region.coord_decoder.fc2.bias": ("region", "coord_dec_b2", False),
    "region.size_encoder.weight": ("region", "size_enc_w", True),
    "region.size_encoder.bias": ("region", "size_enc_b", False),
    "region.size_decoder.fc1.weight": ("region", "size_dec_fc1", True),
    "region.size_decoder.fc1.bias": ("region", "size_dec_b1", False),
    "region.size_decoder.fc2.weight": ("region", "size_dec_fc2", True),
    "region.size_decoder.fc2.bias": ("region", "size_dec_b2", False),
    # Moondream 3's region decoders: one LayerNorm, then a linear layer each
    "region.ln.weight": ("region", "ln_w", False), "region.ln.bias": ("region", "ln_b", False),
    "region.coord_decoder.weight": ("region", "coord_dec_w", True),
    "region.coord_decoder.bias": ("region", "coord_dec_b", False),
    "region.size_decoder.weight": ("region", "size_dec_w", True),
    "region.size_decoder.bias": ("region", "size_dec_b", False),
}
_TEXT_BLOCK = {"ln.weight": ("ln_w", False), "ln.bias": ("ln_b", False), "attn.qkv.weight": ("wqkv", True),
               "attn.qkv.bias": ("bqkv", False), "attn.proj.weight": ("wo", True), "attn.proj.bias": ("bo", False),
               "mlp.fc1.weight": ("fc1", True), "mlp.fc1.bias": ("b1", False), "mlp.fc2.weight": ("fc2", True),
               "mlp.fc2.bias": ("b2", False),
               # Moondream 3: tau attention (every layer), the router of a MoE layer (its experts: 3-D fc1 / fc2)
               "attn.tau.wq": ("tau_wq", True), "attn.tau.wv": ("tau_wv", True), "attn.tau.alpha": ("tau_alpha", False),
               "mlp.router.weight": ("router", True), "mlp.router.bias": ("router_b", False)}
_DENSE = ("fc1", "b1", "fc2", "b2")
_MOE = ("router", "router_b")
_VISION_BLOCK = {"ln1.weight": ("ln1_w", False), "ln1.bias": ("ln1_b", False), "ln2.weight": ("ln2_w", False),
                 "ln2.bias": ("ln2_b", False), "attn.qkv.weight": ("wqkv", True), "attn.qkv.bias": ("bqkv", False),
                 "attn.proj.weight": ("wo", True), "attn.proj.bias": ("bo", False), "mlp.fc1.weight": ("fc1", True),
                 "mlp.fc1.bias": ("b1", False), "mlp.fc2.weight": ("fc2", True), "mlp.fc2.bias": ("b2", False)}
_BLOCK = re.compile(r"^(text|vision)\.blocks\.(\d+)\.(.+)$")


def checkpoint_file(source: str | pathlib.Path) -> pathlib.Path | None:
    """The model.safetensors (or model.safetensors.index.json, for shards) of a Moondream checkpoint (a directory or
    the file itself), or None if `source` is not one (its keys are not `model.text.*` / `model.vision.*`)."""
    p = pathlib.Path(source)
    if p.is_dir():
        p = p / "model.safetensors" if (p / "model.safetensors").is_file() else p / INDEX
    if not p.is_file():
        return None
    try:
        if p.name.endswith(".index.json"):
            keys = list(json.loads(p.read_text())["weight_map"])
        elif p.suffix == ".safetensors":
            with safe_open(str(p), framework="numpy") as st:
                keys = list(st.keys())
        else:
            return None
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return p if any(k.startswith("model.vision.") for k in keys) and "model.text.wte" in keys else None


INDEX = "model.safetensors.index.json"


def _checkpoint_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint file, or of the shards an index names (mapped, not read)."""
    if not path.name.endswith(".index.json"):
        return _mapped_tensors(path)
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a safetensors index ({e})") from None
    out = {}
    for shard in shards:
        if pathlib.Path(shard).name != shard:
            raise ValueError(f"{path}: shard {shard!r} is not a file beside the index")
        tensors = _mapped_tensors(path.parent / shard)
        out.update({k: t for k, t in tensors.items() if weight_map.get(k) == shard})
    if missing := sorted(set(weight_map) - set(out))[:8]:
        raise ValueError(f"{path}: tensors the index names are not in their shards: {missing}")
    return out


class Tensor:
    """A params leaf as the checkpoint holds it, not yet read: the file's tensors (one, or one per layer: zero-copy
    views of the mapped file, torch layout), to be transposed ([out, in] -> [in, out]), stacked and reshaped where
    they land (`to_device`: on the device, where that is a copy at memory speed; `np.asarray`: on the host)."""

    __slots__ = ("parts", "transpose", "stack", "shape")

    def __init__(self, parts: list[np.ndarray], transpose: bool, stack: bool, shape: tuple[int, ...] | None = None):
        self.parts, self.transpose, self.stack = parts, transpose, stack
        one = parts[0].shape[::-1] if transpose else parts[0].shape
        self.shape = shape or ((len(parts), *one) if stack else tuple(one))

    @property
    def dtype(self):
        return self.parts[0].dtype

    def __array__(self, dtype=None, copy=None):
        parts = [p.T if self.transpose else p for p in self.parts]
        a = (np.stack(parts) if self.stack else parts[0]).reshape(self.shape)
        return a.astype(dtype) if dtype is not None else np.array(a)


_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16, "F64": np.float64}


def _mapped_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only view of the mapped file (nothing read until used)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= 100 * 2**20:
                raise ValueError(f"header of {n} bytes")
            header = json.loads(f.read(n))
        data = np.memmap(path, np.uint8, mode="r", offset=8 + n)
        out = {}
        for key, h in header.items():
            if key == "__metadata__":
                continue
            a, b = h["data_offsets"]
            dtype = np.dtype(_DTYPES[h["dtype"]])
            if b > data.size or b - a != dtype.itemsize * int(np.prod(h["shape"], dtype=np.int64)):
                raise ValueError(f"{key}: data offsets {a}..{b} do not fit")
            out[key] = data[a:b].view(dtype).reshape(h["shape"])
        return out
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: corrupt or truncated safetensors file ({e})") from None


def read_checkpoint(path: str | pathlib.Path) -> tuple[MoondreamConfig, dict]:
    """(config, params of `Tensor` leaves: the file's tensors mapped, not read) of an official-layout checkpoint."""
    path = pathlib.Path(path)
    top: dict[tuple[str, str], Tensor] = {}
    blocks: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    flags: dict[tuple[str, str], bool] = {}
    unexpected = []
    for key, t in _checkpoint_tensors(path).items():
        name = key.removeprefix("model.")
        if name in _TOP:
            g, k, tr = _TOP[name]
            top[(g, k)] = Tensor([t], tr, False)
        elif (m := _BLOCK.match(name)) and m.group(3) in (_TEXT_BLOCK if m.group(1) == "text" else _VISION_BLOCK):
            k, tr = (_TEXT_BLOCK if m.group(1) == "text" else _VISION_BLOCK)[m.group(3)]
            if m.group(1) == "text" and k in ("fc1", "fc2") and t.ndim == 3:  # a MoE layer's experts
                k = "experts_" + k
            blocks.setdefault((m.group(1), k), {})[int(m.group(2))] = t
            flags[(m.group(1), k)] = tr
        else:
            unexpected.append(key)
    if unexpected:
        raise ValueError(f"{path}: tensors a Moondream checkpoint does not have: {unexpected[:8]}")
    need = [("text", "embed"), ("vision", "patch_w"), ("vision", "proj_fc1"), ("region", "coord_enc_w")]
    if missing := [f"{g}.{k}" for g, k in need if (g, k) not in top]:
        raise ValueError(f"{path}: not a Moondream checkpoint (missing {missing})")
    cfg = _with_config_json(_config_from_shapes(top, blocks), path.parent / "config.json")
    params: dict = {"text": {"layers": {}, **({"moe": {}} if cfg.text.n_experts else {})}, "vision": {"layers": {}},
                    "region": {}}
    for (g, k), t in top.items():
        if (g, k) == ("vision", "pos"):  # [1, patches, E] -> [patches, E]
            t = Tensor(t.parts, False, False, (t.parts[0].size // t.parts[0].shape[-1], t.parts[0].shape[-1]))
        params[g][k] = t
    t = cfg.text
    spans = {"dense": range(t.n_dense), "moe": range(t.n_dense, t.n_layers), "layers": range(t.n_layers)}
    for (g, k), by_layer in blocks.items():
        group = "layers" if g == "vision" or not t.n_experts else (
            "dense" if k in _DENSE else "moe" if k in _MOE or k.startswith("experts_") else "layers")
        want = range(cfg.vision.n_layers) if g == "vision" else spans[group]
        if sorted(by_layer) != list(want):
            raise ValueError(f"{path}: {g} blocks have {k} for layers {sorted(by_layer)[:8]}, expected "
                             f"{want.start}..{want.stop - 1}")
        parts = [by_layer[i] for i in want]
        if k == "experts_fc1":  # [E, 2F, D]: the GELU half, then the gate half
            F = parts[0].shape[1] // 2
            params[g]["moe"]["w_gate"] = Tensor([p[:, :F] for p in parts], False, True)
            params[g]["moe"]["w_up"] = Tensor([p[:, F:] for p in parts], False, True)
        elif k == "experts_fc2":
            params[g]["moe"]["w_down"] = Tensor(parts, False, True)
        else:
            params[g].setdefault(group, {})[k] = Tensor(parts, flags[(g, k)], True)
    _check_shapes(cfg, params, str(path))
    return cfg, params


def _config_from_shapes(top, blocks) -> MoondreamConfig:
    V, D = top[("text", "embed")].shape
    L = len(blocks.get(("text", "wqkv"), {}))
    dense_fc1 = blocks.get(("text", "fc1"), {})
    F = next(iter(dense_fc1.values())).shape[0] if dense_fc1 else 8192  # (torch layout: [out, in])
    pdim, E = top[("vision", "patch_w")].shape
    patch = int(round((pdim / 3) ** 0.5))
    grid = int(round(np.prod(top[("vision", "pos")].shape) / E) ** 0.5)
    Lv = len(blocks.get(("vision", "wqkv"), {}))
    Fv = next(iter(blocks[("vision", "fc1")].values())).shape[0] if Lv else 4304
    P = top[("vision", "proj_fc1")].shape[1]
    coord_feat, _ = top[("region", "coord_enc_w")].shape
    size_feat = top[("region", "size_enc_w")].shape[0]
    md3 = ("text", "tau_wq") in blocks
    base = MOONDREAM3 if md3 else MoondreamConfig()
    text = dataclasses.replace(base.text, dim=D, ff_dim=F, n_layers=L, vocab_size=V, n_heads=D // TEXT_HEAD_DIM)
    if experts := blocks.get(("text", "experts_fc2"), {}):  # [E, D, F] per MoE layer
        n_e, _, f_e = next(iter(experts.values())).shape
        text = dataclasses.replace(text, n_experts=n_e, expert_dim=f_e, moe_start=min(experts),
                                   experts_per_token=min(base.text.experts_per_token, n_e))
    elif md3:
        text = dataclasses.replace(text, n_experts=0)
    vision = VisionConfig(enc_dim=E, patch_size=patch, n_layers=Lv, ff_dim=Fv, n_heads=max(1, E // VISION_HEAD_DIM),
                          crop_size=grid * patch, proj_inner_dim=P)
    if ("region", "coord_dec_w") in top:
        region = RegionConfig(coord_feat_dim=coord_feat, coord_out_dim=top[("region", "coord_dec_w")].shape[1],
                              size_feat_dim=size_feat, size_out_dim=top[("region", "size_dec_w")].shape[1],
                              linear_decoders=True)
    else:
        region = RegionConfig(coord_feat_dim=coord_feat, coord_out_dim=top[("region", "coord_dec_fc2")].shape[1],
                              size_feat_dim=size_feat, size_out_dim=top[("region", "size_dec_fc2")].shape[1],
                              inner_dim=top[("region", "coord_dec_fc1")].shape[1])
    return dataclasses.replace(base, text=text, vision=vision, region=region)


def _with_config_json(cfg: MoondreamConfig, path: pathlib.Path) -> MoondreamConfig:
    """cfg with what a Moondream 3 `config.json` beside the weights says that the shapes do not ({"text": {"max_context",
    "moe": {"experts_per_token"}}}, at the top or under "config"); unchanged without one."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return cfg
    text = (doc.get("config", doc) if isinstance(doc, dict) else {}).get("text")
    if not isinstance(text, dict) or not cfg.text.n_experts:
        return cfg
    moe_doc = text.get("moe") if isinstance(text.get("moe"), dict) else {}
    k, ctx = moe_doc.get("experts_per_token", cfg.text.experts_per_token), text.get("max_context", cfg.text.max_context)
    if not (isinstance(k, int) and 1 <= k <= cfg.text.n_experts and isinstance(ctx, int) and ctx >= 1):
        raise ValueError(f"{path}: experts_per_token {k!r} / max_context {ctx!r} do not fit this checkpoint")
    return dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, experts_per_token=k, max_context=ctx))


def _check_shapes(cfg: MoondreamConfig, params: dict, source: str) -> None:
    def walk(want, got, path):
        if isinstance(want, dict):
            missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            if missing or extra:
                raise ValueError(f"{source}: params{path}: missing {missing}, unexpected {extra}")
            for k in want:
                walk(want[k], got[k], f"{path}.{k}")
        elif tuple(got.shape) != tuple(want):
            raise ValueError(f"{source}: params{path} has shape {tuple(got.shape)}, the config implies {tuple(want)}")

    walk(param_shapes(cfg), params, "")


def to_device(params: dict, dtype) -> dict:
    """Host params (`Tensor` or numpy leaves) -> device arrays of `dtype`: every tensor copied over as the file holds
    it, then transposed, stacked and cast there, all in one program (no strided copy on the host)."""
    leaves, tree = jax.tree.flatten(params, is_leaf=lambda a: isinstance(a, Tensor))
    tensors = [a if isinstance(a, Tensor) else Tensor([np.asarray(a)], False, False) for a in leaves]
    parts = jax.device_put([t.parts for t in tensors])
    layout = tuple((t.transpose, t.stack, t.shape) for t in tensors)
    return jax.tree.unflatten(tree, _assemble(parts, layout, jnp.dtype(dtype)))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _assemble(parts, layout, dtype):
    out = []
    for ps, (transpose, stack, shape) in zip(parts, layout, strict=True):
        ps = [p.T if transpose else p for p in ps]
        out.append((jnp.stack(ps) if stack else ps[0]).reshape(shape).astype(dtype))
    return out


def random_params(cfg: MoondreamConfig, dtype, seed: int = 0) -> dict:
    """Random weights of the config's shape built on the device (benchmarks; values do not matter to timing):
    matrices N(0, 1/fan_in), LayerNorm gains 1, biases 0."""
    flat, tree = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple))
    names = [path[-1].key for path, _ in flat]
    shapes = [shape for _, shape in flat]

    def init(key, name, shape):
        if "ln" in name and name.endswith("_w"):
            return jnp.ones(shape, dtype)
        if name.endswith("_b") or name[0] == "b" or name.endswith(("_b1", "_b2")):
            return jnp.zeros(shape, dtype)
        return (jax.random.normal(key, shape, jnp.float32) * shape[-2] ** -0.5).astype(dtype)

    keys = jax.random.split(jax.random.key(seed), len(shapes))
    make = jax.jit(lambda keys: [init(k, n, s) for k, n, s in zip(keys, names, shapes, strict=True)])
    return jax.tree.unflatten(tree, make(keys))


def official_tensors(cfg: MoondreamConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(key, torch shape) of every tensor of the official layout for this config."""
    shapes = param_shapes(cfg)
    out = []
    for name, (g, k, tr) in _TOP.items():
        if k not in shapes[g]:
            continue
        s = shapes[g][k]
        if (g, k) == ("vision", "pos"):
            s = (1, *s)
        out.append((f"model.{name}", tuple(reversed(s)) if tr else tuple(s)))
    t = cfg.text
    text_groups = {k: g for g in ("layers", "dense", "moe") for k in shapes["text"].get(g, {})}
    for i in range(t.n_layers):
        moe_layer = t.n_experts and i >= t.n_dense
        for sub, (k, tr) in _TEXT_BLOCK.items():
            g = text_groups.get(k)
            if g is None or (g == "dense" and moe_layer) or (g == "moe" and not moe_layer):
                continue
            s = shapes["text"][g][k][1:]
            out.append((f"model.text.blocks.{i}.{sub}", tuple(reversed(s)) if tr else tuple(s)))
        if moe_layer:
            E, F, D = shapes["text"]["moe"]["w_gate"][1:]
            out += [(f"model.text.blocks.{i}.mlp.fc1.weight", (E, 2 * F, D)),
                    (f"model.text.blocks.{i}.mlp.fc2.weight", (E, D, F))]
    for i in range(cfg.vision.n_layers):
        for sub, (k, tr) in _VISION_BLOCK.items():
            s = shapes["vision"]["layers"][k][1:]
            out.append((f"model.vision.blocks.{i}.{sub}", tuple(reversed(s)) if tr else tuple(s)))
    return out


def write_random_checkpoint(out_dir: str | pathlib.Path, cfg: MoondreamConfig, seed: int = 0) -> pathlib.Path:
    """A float32 checkpoint of this config in the official layout (plus the word-level tokenizer `w<i>` <-> id i)
    with seeded random weights, LayerNorm gains and biases included, scaled so activations stay O(1) and greedy
    choices are well separated (fixtures compare token ids with the reference implementation)."""
    from safetensors.numpy import save_file

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for key, shape in official_tensors(cfg):
        if key.endswith("tau.alpha"):
            a = rng.standard_normal(shape)
        elif key.endswith(("ln.weight", "ln1.weight", "ln2.weight", "post_ln.weight")):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif key.endswith(".bias"):
            a = 0.02 * rng.standard_normal(shape)
        elif key in ("model.text.wte", "model.vision.pos_emb"):
            a = (1.0 if key == "model.text.wte" else 0.5) * rng.standard_normal(shape)
        else:
            scale = 3.0 if key == "model.text.lm_head.weight" else 1.0
            a = scale * rng.standard_normal(shape) / np.sqrt(shape[-1])
        tensors[key] = a.astype(np.float32)
    save_file(tensors, str(out_dir / "model.safetensors"))
    write_word_tokenizer(out_dir / "tokenizer.json", cfg.text.vocab_size)
    t = cfg.text
    if t.n_experts:  # what the shapes do not say (`_with_config_json`)
        (out_dir / "config.json").write_text(json.dumps({"text": {
            "max_context": t.max_context, "moe": {"num_experts": t.n_experts, "start_layer": t.n_dense,
                                                  "experts_per_token": t.experts_per_token,
                                                  "expert_inner_dim": t.expert_dim}}}))
    (out_dir / "moondream.json").write_text(json.dumps({"seed": seed, "source": "write_random_checkpoint"}))
    return out_dir / "model.safetensors"


def write_word_tokenizer(path: str | pathlib.Path, vocab_size: int) -> None:
    """A word-level tokenizer where the word `w<i>` is id i (whitespace split): prompts of known ids, any vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab_size)}, unk_token="w100"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))


RANDOM = {"moondream2": MoondreamConfig(), "moondream3": MOONDREAM3}


def is_source(source) -> bool:
    """A Moondream source: `random:moondream2|moondream3[:layers=N][:vision_layers=N]` or an official-layout
    checkpoint."""
    if isinstance(source, str) and source.startswith("random:"):
        return source.split(":")[1] in RANDOM
    return isinstance(source, str | pathlib.Path) and _is_checkpoint(source)


def _is_checkpoint(source) -> bool:
    try:
        return checkpoint_file(pathlib.Path(source).expanduser()) is not None
    except (OSError, ValueError):
        return False


def parse_random(spec: str) -> MoondreamConfig:
    """`random:moondream2|moondream3[:layers=N][:vision_layers=N]` -> the real shape, with fewer layers if asked."""
    parts = spec.split(":")
    cfg = dataclasses.replace(RANDOM[parts[1]], name=spec)
    changes = {}
    for part in parts[2:]:
        key, _, value = part.partition("=")
        if key not in ("layers", "vision_layers") or not value.isdigit() or int(value) < 1:
            raise ValueError(f"bad option {part!r} in {spec!r}; options: layers=N, vision_layers=N (N >= 1)")
        changes[key] = int(value)
    text = dataclasses.replace(cfg.text, n_layers=changes.get("layers", cfg.text.n_layers))
    vision = dataclasses.replace(cfg.vision, n_layers=changes.get("vision_layers", cfg.vision.n_layers))
    return dataclasses.replace(cfg, text=text, vision=vision)


def load(source, dtype) -> tuple[MoondreamConfig, dict, object, str]:
    """(config, params on the device in `dtype`, tokenizer or None, name) of a Moondream source (`is_source`). dtype
    None: weights/load.py `resolve_dtype` (bfloat16 on accelerators)."""
    from jphoton.text.tokenizer import Tokenizer
    from jphoton.weights.load import resolve_dtype

    dtype = resolve_dtype(dtype)
    if isinstance(source, str) and source.startswith("random:"):
        cfg = parse_random(source)
        return cfg, random_params(cfg, dtype), None, source
    f = checkpoint_file(pathlib.Path(source).expanduser())
    cfg, host = read_checkpoint(f)
    cfg = dataclasses.replace(cfg, name=str(source))
    return cfg, to_device(host, dtype), Tokenizer.from_hf_dir(f.parent), str(source)
