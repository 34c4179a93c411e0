"""numba kernels, each beside a numpy reference of the same signature (`<name>_ref`)."""

from ellmd.kernels.activations import silu_mul
from ellmd.kernels.attention import attention_decode, attention_prefill, decode_scratch_shapes, store_kv
from ellmd.kernels.matmul import embed, linear_rows, matmul, prefill_scratch_size
from ellmd.kernels.quant import BLOCK_DTYPES, decode_row, is_blocks
from ellmd.kernels.moe import moe_experts, moe_scratch, route
from ellmd.kernels.norm import rmsnorm, rmsnorm_heads
from ellmd.kernels.rope import rope, rope_tables
