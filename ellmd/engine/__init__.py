"""How the model runs: KV cache, static plan, sampling, and the Engine over slots."""

from ellmd.engine.engine import Engine, builtin_model_path
from ellmd.engine.sampling import Sampler, SamplingParams

__all__ = ["Engine", "Sampler", "SamplingParams", "builtin_model_path"]
