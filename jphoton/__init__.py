"""jphoton: a JAX/Pallas LLM inference engine."""

from jphoton.api import LLM
from jphoton.params import Completion, SamplingParams

__all__ = ["LLM", "Completion", "SamplingParams"]
__version__ = "0.1.0"
