"""The static plan: every activation buffer of one forward pass, sized once for the chunk size.

A forward over n <= chunk_size tokens uses views [:n] of these buffers, so a decode step
allocates nothing and the same plan serves one token or a whole chunk.

Shapes (C chunk size, B decode batch = slots, h hidden, H/G query/kv heads, d head_dim,
I intermediate, V vocab, E experts, k experts per token):
  x, h, rows_x    [C, h]          residual stream, normed/branch output, rows picked for logits
  qkv             [C, (H+2G)*d]
  attn            [C, H*d]
  gate_up, act    [C, 2*I], [C, I]
  logits          [D, V]          decode logits, one row per token of a decode step
  (D = max(B, PREFILL_MIN_ROWS - 1): the rows of a decode-path forward, its B sessions' tokens
  and the prefill tokens that ride along, Engine.step)
  cos, sin        [S, d/2]        rope tables for every position of the sequence
  acc             [W, quant_f32.acc_floats(D)]   each kernel thread's block-row accumulator (decode)
  xq8, xq16       [D*K] int8, int16   decode activations quantized for the integer paths ("vnni", "int16")
  xd, xs          [D*K/32], [D*K/16]  their scales (per 32) and code sums (per 16)
  xd8, xs8        [D*K/32], [D*K/16]  the same of xq8 on the "int8" path (beside xq16's: lanes.INT8_BLOCKS)
  xh, xl          [DP*K] uint16       decode activations' bf16 halves packed for AMX tiles or vdpbf16ps
                                      (DP: D rounded up to 16 tokens, or to dpbf16's blocks; empty without)
                                             (K the widest matmul input)
  router_logits   [C, E]; expert_weights, expert_ids [C, k]; moe_out [C, h]
  moe_scratch     kernels.moe.MoeScratch: the C*k (token, expert) pairs' gathered rows and quantized
                  activations (inputs, silu outputs), and the fused path's per-worker accumulators

Every forward runs kernels.layer's `layer` over the model's layers, the one definition of a layer:
decode (up to Plan.fused_max_rows rows) compiled, one call per layer (decode_layer); prefill from
Python, kernel by kernel (its calls are amortized over the chunk's tokens).
"""

from __future__ import annotations

import numba
import numpy as np

from ellmd import kernels
from ellmd.kernels import aligned, bf16, cpu, dpbf16, layer, quant_f32
from ellmd.kernels.formats import kernel_view
from ellmd.kernels.matmul import PREFILL_MIN_ROWS
from ellmd.kernels.moe import FUSED_MAX_TOKENS, fused_work
from ellmd.model.llama import logical_shape
from ellmd.model.spec import ModelSpec


class Workspace:
    """Preallocated activation buffers for one model and one chunk size, each starting a cache line
    (aligned.py)."""

    def __init__(self, spec: ModelSpec, chunk_size: int, batch_size: int, sequence_length: int, weight_shapes):
        C, B = chunk_size, max(batch_size, 1)
        D = max(B, PREFILL_MIN_ROWS - 1)
        rows = max(C, D)
        H, G, d, h = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, spec.hidden_size
        inter = max(spec.intermediate_size, spec.moe_intermediate_size)
        f32 = np.float32
        self.x = aligned.zeros((rows, h), f32)
        self.h = aligned.zeros((rows, h), f32)
        self.rows_x = aligned.zeros((rows, h), f32)
        self.qkv = aligned.zeros((rows, (H + 2 * G) * d), f32)
        self.attn = aligned.zeros((rows, H * d), f32)
        self.gate_up = aligned.zeros((rows, 2 * inter), f32)
        self.act = aligned.zeros((rows, inter), f32)
        self.logits = aligned.zeros((D, spec.vocab_size), f32)  # D >= B: a step's rows may carry drafts
        self.tokens = aligned.zeros(rows, np.int64)
        self.slots = aligned.zeros(rows, np.int64)
        self.positions = aligned.zeros(rows, np.int64)
        self.lengths = aligned.zeros(rows, np.int64)
        self.row_ids = aligned.on_line(np.arange(rows, dtype=np.int64))
        self.cos, self.sin = (aligned.on_line(t) for t in kernels.rope_tables(
            d, spec.rope_theta, spec.rope_scaling, spec.max_position_embeddings, sequence_length
        ))
        shapes = kernels.decode_scratch_shapes(D, H, d, numba.get_num_threads(), sequence_length)
        self.attention_scratch = {name: aligned.zeros(shape, f32) for name, shape in shapes.items()}
        self.matmul_scratch = aligned.zeros(max(kernels.prefill_scratch_size(m, k) for m, k in weight_shapes), f32)
        widest = max(k for _, k in weight_shapes)
        self.acc = aligned.zeros((numba.get_num_threads(), quant_f32.acc_floats(D)), f32)
        self.xq8 = aligned.zeros(D * widest, np.int8)
        self.xq16 = aligned.zeros(D * widest, np.int16)
        self.xd = aligned.zeros(D * (widest // 32), f32)
        self.xs = aligned.zeros(D * (widest // 16), f32)
        self.xd8 = aligned.zeros(D * (widest // 32), f32)
        self.xs8 = aligned.zeros(D * (widest // 16), f32)
        # decode's activations packed: in groups of 16 tokens for AMX, in vdpbf16ps' blocks of tokens
        packed = max(-(-D // bf16.TILE) * bf16.TILE if bf16.AMX else 0,
                     dpbf16.token_rows(D) if "dpbf16" in cpu.host_paths() else 0) * widest
        self.xh, self.xl = aligned.zeros(packed, np.uint16), aligned.zeros(0 if bf16.rounded() else packed, np.uint16)
        if spec.num_experts:
            E, k = spec.num_experts, spec.num_experts_per_tok
            self.router_logits = aligned.zeros((rows, E), f32)
            self.expert_weights = aligned.zeros((rows, k), f32)
            self.expert_ids = aligned.zeros((rows, k), np.int64)
            self.moe_out = aligned.zeros((rows, h), f32)
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
    """The model's forward pass bound to its workspace and the KV cache.

    fused_decode: decode through the compiled layer (True) or kernel by kernel as prefill does
    (False: the reference the tests compare the compiled step with).
    """

    def __init__(self, model, kv, chunk_size: int):
        self.model = model
        self.kv = kv
        self.chunk_size = chunk_size
        spec = model.spec
        self.ws = Workspace(spec, chunk_size, kv.slots, kv.sequence_length, _weight_shapes(model))
        self.fused_decode = True
        self.layers = [model.layer_weights(i) for i in range(len(model.layers))]
        self.lm_head = model.parts(model.lm_head)
        self._bind_layer()

    def _bind_layer(self) -> None:
        """The arguments of kernels.layer's layer, both ways, built once (each step passes one layer's
        weights: a tuple of several layers would compile anew for each count)."""
        model, ws, kv, spec = self.model, self.ws, self.kv, self.model.spec
        routed = (ws.moe_out, ws.router_logits, ws.expert_weights, ws.expert_ids) if spec.num_experts else ()
        buffers, mlp = (ws.x, ws.h, ws.qkv, ws.attn, ws.lengths, ws.cos, ws.sin), (ws.gate_up, ws.act, routed)
        self.stepwise_ws = (*buffers, kv.k, kv.v, mlp, kv.key_mean)
        self.fused_ws = (*buffers, kernel_view(kv.k, kv.fmt), kernel_view(kv.v, kv.fmt), mlp, kv.key_mean)
        self.dims = (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, spec.rms_norm_eps, model.scale)
        moe = (spec.num_experts_per_tok, spec.norm_topk_prob, ws.moe_scratch) if spec.num_experts else ()
        self.stepwise = {decode: layer.Stepwise(model.fmt, kv.fmt, decode, ws.matmul_scratch, ws.attention_scratch, moe)
                         for decode in (False, True)}
        self.fused_max_rows = PREFILL_MIN_ROWS - 1  # matmul's choice of kernel
        if any(layer.routed(mlp_weights) for _, mlp_weights in self.layers):
            self.fused_max_rows = min(self.fused_max_rows, FUSED_MAX_TOKENS)

    def forward(self, n: int, decode: bool) -> None:
        """Embed and run the n tokens set in ws.tokens/slots/positions; the residual ends in ws.x[:n]."""
        ws = self.ws
        kernels.embed(ws.tokens[:n], self.model.embed_tokens, self.model.fmt, ws.x[:n])
        if decode and self.fused_decode and n <= self.fused_max_rows:
            run_layer, buffers, run = layer.decode_layer, self.fused_ws, self._fused_run()
        else:
            run_layer, buffers, run = layer.layer, self.stepwise_ws, self.stepwise[decode]
        for weights in self.layers:
            run_layer(weights, buffers, n, ws.slots, ws.positions, self.dims, run)

    def prefill(self, slot: int, tokens):
        """Append tokens [n] to slot at its length, chunk by chunk; yields (begin, m) after each chunk,
        its m rows' residuals in ws.x[:m] (run it to the end: a chunk runs when it is asked for)."""
        ws, kv = self.ws, self.kv
        for begin in range(0, len(tokens), self.chunk_size):
            piece = tokens[begin : begin + self.chunk_size]
            m, start = len(piece), int(kv.lengths[slot])
            ws.tokens[:m] = piece
            ws.slots[:m] = slot
            ws.positions[:m] = np.arange(start, start + m)
            self.forward(m, decode=False)
            kv.lengths[slot] = start + m
            yield begin, m

    def _paths(self) -> tuple:
        """(integer path on, workers, (xq, xd, xs), (xh, xl) or ()): the kernel-path arguments of
        kernels.layer, read at each step; xq is int8 on the "vnni" path (it wins over "int16"),
        int16 otherwise, and on "int8" (xq8, xd8, xs8) follow for the tiles that take int8; the
        halves where bf16 weights decode on AMX tiles ("bf16", on_tiles) or on vdpbf16ps."""
        ws = self.ws
        xq = ws.xq8 if "vnni" in cpu.ENABLED else ws.xq16
        q8buf = (xq, ws.xd, ws.xs) + ((ws.xq8, ws.xd8, ws.xs8) if "int8" in cpu.ENABLED else ())
        halves = (ws.xh, ws.xl, bf16.decode_tiles()) if bf16.decode_tiles() or bf16.vdpbf16ps() else ()
        return bool(cpu.INTEGER & cpu.ENABLED), min(numba.get_num_threads(), len(ws.acc)), q8buf, halves

    def _fused_run(self) -> tuple:
        """The `run` of decode_layer on the kernel paths of this step (as _paths)."""
        ws, spec = self.ws, self.model.spec
        scratch = ws.attention_scratch
        threads = min(scratch["tile"].shape[0], numba.get_num_threads())
        moe_work = ()
        if spec.num_experts:
            moe_work = (spec.num_experts_per_tok, spec.norm_topk_prob, fused_work(ws.moe_scratch)[0])
        attention = (scratch["partial_m"], scratch["partial_l"], scratch["partial_acc"], scratch["tile"])
        return layer.fused_run(*self._paths(), ws.acc, threads, attention, moe_work)

    def logits(self, rows, out) -> np.ndarray:
        """Logits of the given residual rows into out [len(rows), V]."""
        self.model.logits(self.ws, rows, out)
        return out

    def decode_logits(self, n: int, out) -> np.ndarray:
        """Logits of the n rows of a decode step into out [n, V] (one compiled call when fused)."""
        if not (self.fused_decode and n <= self.fused_max_rows):
            return self.logits(self.ws.row_ids[:n], out)
        ws, model = self.ws, self.model
        layer.decode_logits(ws.x, n, model.norm, model.spec.rms_norm_eps, self.lm_head, ws.h, out, ws.acc,
                            self._paths())
        return out


def _weight_shapes(model):
    """[m, k] in values of every weight matrix (expert stacks: one expert's)."""
    shapes = [logical_shape(model.lm_head)]
    for weights in model.layers:
        shapes += [logical_shape(w)[-2:] for w in weights.values() if isinstance(w, tuple) or w.ndim >= 2]
    return shapes
