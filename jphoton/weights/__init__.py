"""Model sources: HF safetensors directories, GGUF files, orbax stores, random weights of real shapes."""

from jphoton.weights.load import LoadedModel, load_model, load_tokenizer, resolve_dtype

__all__ = ["LoadedModel", "load_model", "load_tokenizer", "resolve_dtype"]
