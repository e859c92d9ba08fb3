"""The PyTorch side of benchmarks/vs_pytorch.py: the shapes as HF `LlamaConfig`s, the shared random weights built in
torch, and the HF rows (static-cache compiled `generate`, continuous-batching `generate_batch`, the eager reference for
the agreement check). torch and transformers are imported inside the functions: jphoton's side never needs them."""

from __future__ import annotations

import inspect
import logging
import statistics
import time

log = logging.getLogger("vs_pytorch")

_LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
SHAPES = {  # LlamaConfig kwargs (transformers 5 naming: rope_parameters)
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
               max_position_embeddings=131072, tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE,
               bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
               max_position_embeddings=8192, tie_word_embeddings=False,
               rope_parameters=dict(rope_type="default", rope_theta=500000.0),
               bos_token_id=128000, eos_token_id=[128001, 128009]),
    "smoke": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=2048,
                  tie_word_embeddings=True, rope_parameters={**_LLAMA3_ROPE, "original_max_position_embeddings": 256},
                  bos_token_id=1, eos_token_id=[2]),
}


# ---- the shared weights ---------------------------------------------------------------------------------------------
def _fp32_rotary(model) -> None:
    import torch

    rotary = model.model.rotary_emb
    with torch.device(rotary.inv_freq.device):
        model.model.rotary_emb = type(rotary)(config=model.config)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def build_hf_model(shape: str, device: str, dtype, seed: int):
    """HF's random init (seeded, on the device), then norms randomised around 1."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape])
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    model = model.to(device=device, dtype=dtype).eval()
    # `.to(dtype)` also rounds the RoPE inverse frequencies (a buffer) to bf16, which shifts every rotation angle by up
    # to ~0.4% x position: a different model from the checkpoint's. `from_pretrained(dtype=bf16)` keeps them float32
    # (computed with an explicit float dtype, never cast), so do as it does: a fresh rotary module, built in float32.
    _fp32_rotary(model)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32))
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
    # EOS off: every HF row generates exactly N tokens, as jphoton does with ignore_eos.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _to_numpy(t):
    import ml_dtypes
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bf16: reinterpret the bits (exact, no float32 copy)
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def torch_state_to_host(model) -> dict:
    """The state dict as host numpy arrays in HF's layout ([out, in] weights). Weights the loader transposes are
    transposed on the device first and handed over as transposed views, so the loader's `.T` yields contiguous arrays
    (stacking them is then a plain copy)."""
    from jphoton.weights import hf

    out = {}
    for key, t in model.state_dict().items():
        m = hf._LAYER_KEY.match(key)
        transposed = key == "lm_head.weight" or bool(m and hf._LAYER_MAP.get(m.group(2), (None, False))[1])
        out[key] = _to_numpy(t.T.contiguous()).T if transposed else _to_numpy(t)
    return out


# ---- HF rows --------------------------------------------------------------------------------------------------------
def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_static_case(model, prompts: list[list[int]], new_tokens: int, reps: int) -> dict:
    import torch
    from transformers.generation import CompileConfig

    dev = model.device
    ids = torch.tensor(prompts, device=dev)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, cache_implementation="static",
              compile_config=CompileConfig(fullgraph=False, dynamic=False, mode="reduce-overhead"), pad_token_id=0)

    def run(n):
        _sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync()
        dt = time.perf_counter() - t0
        if out.shape[1] - ids.shape[1] != n:
            raise RuntimeError(f"generate made {out.shape[1] - ids.shape[1]} tokens, asked for {n}")
        return dt

    t0 = time.perf_counter()
    run(new_tokens)  # compiles (this B), records the CUDA graphs
    run(new_tokens)
    run(1)
    warm = time.perf_counter() - t0
    t1 = statistics.median(run(1) for _ in range(reps))
    tn = statistics.median(run(new_tokens) for _ in range(reps))
    b = len(prompts)
    return dict(ms_step=1e3 * (tn - t1) / max(1, new_tokens - 1), ttft_ms=1e3 * t1, tok_s=b * new_tokens / tn,
                t_1_s=t1, t_n_s=tn, warmup_s=warm, new_tokens=new_tokens)


def hf_batch_case(model, prompts: list[list[int]], new_tokens: int, attn: str) -> dict:
    import torch
    from transformers import GenerationConfig

    if hasattr(model, "set_attn_implementation") and model.config._attn_implementation != attn:
        model.set_attn_implementation(attn)
    cuda = torch.cuda.is_available()
    options = dict(use_cuda_graph=cuda, use_async_batching=False, max_memory_percent=0.5, auto_switch_to_flash=False)
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    sig = inspect.signature(model.generate_batch).parameters
    kwargs = {}
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        ContinuousBatchingConfig = None
    if ContinuousBatchingConfig is not None and "continuous_batching_config" in sig:
        known = set(getattr(ContinuousBatchingConfig, "__dataclass_fields__", {})) or set(
            inspect.signature(ContinuousBatchingConfig).parameters)
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            **{k: v for k, v in options.items() if k in known})
        used = {k: v for k, v in options.items() if k in known}
    else:  # older API: the options live on the GenerationConfig
        for k, v in options.items():
            setattr(gen, k, v)
        used = options
    stamps = "record_timestamps" in sig
    if stamps:
        kwargs["record_timestamps"] = True
    persistent = "persistent_manager" in sig
    if persistent:
        kwargs["persistent_manager"] = True

    def call():
        _sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            res = model.generate_batch(inputs=prompts, generation_config=gen, **kwargs)
        _sync()
        return time.perf_counter() - t0, res

    try:
        warm_s, _ = call()  # untimed: lazy init, graph capture; the persistent manager is reused by the next call
        wall, res = call()
    finally:
        if persistent and hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
        if cuda:
            torch.cuda.empty_cache()
    outs = list(res.values())
    errors = [o.error for o in outs if getattr(o, "error", None)]
    if errors:
        raise RuntimeError(f"generate_batch: {errors[0]}")
    tokens = sum(len(o.generated_tokens) for o in outs)
    row = dict(new_tokens=new_tokens, tokens=tokens, wall_s=wall, warmup_s=warm_s, attn=attn, options=used,
               persistent_manager=persistent)
    ts = [o for o in outs if getattr(o, "timestamps", None)]
    if stamps and len(ts) == len(outs) and all(len(o.timestamps) == len(o.generated_tokens) for o in outs):
        steps = [(o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1) for o in outs if len(o.timestamps) > 1]
        span = max(o.timestamps[-1] for o in outs) - min(o.created_time for o in outs)
        row.update(timing="timestamps", ms_step=1e3 * statistics.median(steps),
                   ttft_ms=1e3 * statistics.median(o.timestamps[0] - o.created_time for o in outs),
                   tok_s=tokens / span,
                   tok_s_from_first_token=tokens / (max(o.timestamps[-1] for o in outs)
                                                    - min(o.timestamps[0] for o in outs)))
    else:
        row.update(timing="wall (includes the manager's start-up)", ms_step=1e3 * wall / new_tokens, ttft_ms=None,
                   tok_s=tokens / wall)
    return row


def hf_reference(model, prompts: list[list[int]], greedy_tokens: int) -> dict:
    """Last prompt position's logits (eager forward) and the first greedy tokens (eager generate, dynamic cache), in the
    model's dtype and, for a bf16 model, also in float32 (the same weights upcast in place and cast back, exactly):
    random bf16 weights give near-uniform logits with near-ties, so the float32 run is the yardstick that both bf16
    implementations are measured against."""
    import torch

    ids = torch.tensor(prompts, device=model.device)

    def run():
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float().cpu().numpy()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=greedy_tokens, min_new_tokens=greedy_tokens, pad_token_id=0)
        return logits, out[:, ids.shape[1]:].cpu().numpy()

    ref = dict(zip(("logits", "tokens"), run(), strict=True))
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:
        model.float()
        try:
            ref["logits_fp32"], ref["tokens_fp32"] = run()
        finally:
            model.to(dtype)
            _fp32_rotary(model)  # `.to` rounded the RoPE frequencies again
    return ref
