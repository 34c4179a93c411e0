"""What the network is: spec, checkpoint readers, and one module per model family.

Each family module registers itself (registry.register): importing them here fills FAMILIES.
"""

from ellmd.model import llama, qwen3, qwen3_moe  # noqa: F401 (each registers its family)
from ellmd.model.registry import FAMILIES, Family, family  # noqa: F401
