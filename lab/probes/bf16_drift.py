"""How far bf16 logits drift from a float32 run of the same weights, model level (no engine): HF transformers vs
jphoton (`llama.forward` with the dense reference attention), Llama-3.2-1B shape, the random weights of
benchmarks/vs_pytorch.py. Separates "the model math differs" (the float32 rows, ~1e-5 when the semantics match) from
"bf16 rounding differs" (the bf16 rows) and, run beside vs_pytorch's engine agreement, from the engine's own path.

    python lab/probes/bf16_drift.py            # GPU when torch sees one, else CPU (2 prompts x 64 tokens)
"""

import gc
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 3)[0])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import vs_pytorch as vp  # noqa: E402
from jphoton.models import llama  # noqa: E402


def rel(a, ref) -> list[float]:
    return [round(float(np.abs(x - y).max() / np.abs(y).max()), 5) for x, y in zip(a, ref, strict=True)]


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model = vp.build_hf_model("1b", device, torch.float32, 0)
    prompts = np.random.default_rng(1).integers(0, 128256, (2, 64)).tolist()
    ids = torch.tensor(prompts, device=device)
    with torch.no_grad():
        ref32 = model(ids).logits[:, -1].float().cpu().numpy()
    arrays = vp.torch_state_to_host(model)
    cfg, params = vp.jphoton_params_from_host(model.config, arrays, "float32")
    del arrays
    gc.collect()
    toks = jnp.asarray(prompts, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(toks.shape[1], dtype=jnp.int32), toks.shape)

    @jax.jit
    def logits(p, kv):
        hidden, _ = llama.forward(p, cfg, toks, pos, kv, llama.dense_attention(cfg, pos))
        return llama.lm_head(p, hidden[:, -1])

    def jp(p):
        dt = jax.tree_util.tree_leaves(p)[0].dtype
        return np.asarray(logits(p, tuple(llama.init_dense_kv(cfg, *toks.shape, dt))), np.float32)

    out = {"device": device, "jax_backend": jax.default_backend()}
    out["jphoton_f32_vs_hf_f32"] = rel(jp(params), ref32)
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params)
    jb = jp(params)
    del params
    gc.collect()
    out["jphoton_bf16_vs_hf_f32"] = rel(jb, ref32)
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        hb = model(ids).logits[:, -1].float().cpu().numpy()
    out["hf_bf16_vs_hf_f32"] = rel(hb, ref32)
    out["jphoton_bf16_vs_hf_bf16"] = rel(jb, hb)
    out["s"] = round(time.perf_counter() - t0, 1)
    print(out, flush=True)


if __name__ == "__main__":
    main()
