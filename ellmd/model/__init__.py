"""What the network is: spec, checkpoint readers, and one module per model family."""

from ellmd.model.llama import Llama
from ellmd.model.qwen3 import Qwen3
from ellmd.model.qwen3_moe import Qwen3Moe

FAMILIES = {"llama": Llama, "qwen3": Qwen3, "qwen3_moe": Qwen3Moe}
