"""The static plan: every activation buffer of one forward pass, sized once for the chunk size.

A forward over n <= chunk_size tokens uses views [:n] of these buffers, so a decode step
allocates nothing and the same plan serves one token or a whole chunk.

Shapes (C chunk size, B decode batch = slots, h hidden, H/G query/kv heads, d head_dim,
I intermediate, V vocab, E experts, k experts per token):
  x, h, rows_x    [C, h]          residual stream, normed/branch output, rows picked for logits
  qkv             [C, (H+2G)*d]
  attn            [C, H*d]
  gate_up, act    [C, 2*I], [C, I]
  logits          [B, V]          decode logits, one row per slot
  cos, sin        [S, d/2]        rope tables for every position of the sequence
"""

from __future__ import annotations

import numba
import numpy as np

from ellmd import kernels
from ellmd.model.llama import logical_shape
from ellmd.model.spec import ModelSpec


class Workspace:
    """Preallocated activation buffers for one model and one chunk size."""

    def __init__(self, spec: ModelSpec, chunk_size: int, batch_size: int, sequence_length: int, weight_shapes):
        C, B = chunk_size, max(batch_size, 1)
        rows = max(C, B)
        H, G, d, h = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, spec.hidden_size
        inter = max(spec.intermediate_size, spec.moe_intermediate_size)
        f32 = np.float32
        self.x = np.zeros((rows, h), f32)
        self.h = np.zeros((rows, h), f32)
        self.rows_x = np.zeros((rows, h), f32)
        self.qkv = np.zeros((rows, (H + 2 * G) * d), f32)
        self.attn = np.zeros((rows, H * d), f32)
        self.gate_up = np.zeros((rows, 2 * inter), f32)
        self.act = np.zeros((rows, inter), f32)
        self.logits = np.zeros((B, spec.vocab_size), f32)
        self.tokens = np.zeros(rows, np.int64)
        self.slots = np.zeros(rows, np.int64)
        self.positions = np.zeros(rows, np.int64)
        self.lengths = np.zeros(rows, np.int64)
        self.row_ids = np.arange(rows, dtype=np.int64)
        self.cos, self.sin = kernels.rope_tables(
            d, spec.rope_theta, spec.rope_scaling, spec.max_position_embeddings, sequence_length
        )
        shapes = kernels.decode_scratch_shapes(B, H, d, numba.get_num_threads())
        self.attention_scratch = {name: np.zeros(shape, f32) for name, shape in shapes.items()}
        self.matmul_scratch = np.zeros(max(kernels.prefill_scratch_size(m, k) for m, k in weight_shapes), f32)
        if spec.num_experts:
            E, k = spec.num_experts, spec.num_experts_per_tok
            self.router_logits = np.zeros((rows, E), f32)
            self.expert_weights = np.zeros((rows, k), f32)
            self.expert_ids = np.zeros((rows, k), np.int64)
            self.moe_out = np.zeros((rows, h), f32)
            self.moe_scratch = kernels.moe_scratch(rows, k, E, h, spec.moe_intermediate_size)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in _arrays(self))


def _arrays(obj):
    for value in vars(obj).values():
        if isinstance(value, np.ndarray):
            yield value
        elif isinstance(value, dict):
            yield from (a for a in value.values() if isinstance(a, np.ndarray))


class Plan:
    """The model's forward pass bound to its workspace and the KV cache."""

    def __init__(self, model, kv, chunk_size: int):
        self.model = model
        self.kv = kv
        self.chunk_size = chunk_size
        spec = model.spec
        self.ws = Workspace(spec, chunk_size, kv.slots, kv.sequence_length, _weight_shapes(model))

    def forward(self, n: int, decode: bool) -> None:
        """Embed and run the n tokens set in ws.tokens/slots/positions; the residual ends in ws.x[:n]."""
        ws = self.ws
        kernels.embed(ws.tokens[:n], self.model.embed_tokens, self.model.fmt, ws.x[:n])
        self.model.forward(ws, self.kv, n, ws.slots, ws.positions, decode)

    def logits(self, rows, out) -> np.ndarray:
        """Logits of the given residual rows into out [len(rows), V]."""
        self.model.logits(self.ws, rows, out)
        return out


def _weight_shapes(model):
    """[m, k] in values of every weight matrix (expert stacks: one expert's)."""
    shapes = [logical_shape(model.lm_head)]
    for layer in model.layers:
        shapes += [logical_shape(w)[-2:] for w in layer.values() if isinstance(w, tuple) or w.ndim >= 2]
    return shapes
