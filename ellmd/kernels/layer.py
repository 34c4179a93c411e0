"""A decode step through a transformer layer in one compiled call.

Shape legend (n decode rows, one token per slot; h hidden; H, G query/kv heads; d head_dim;
I intermediate; W workers = kernel threads; L layers of the model):
  x, h            [n, h]          residual stream; normed input / branch output
  qkv             [n, (H+2G)*d]   viewed as [n, H+2G, d]: q heads, then k, then v
  attn            [n, H*d]
  gate_up, act    [n, 2*I], [n, I]
  kv_k, kv_v      [L, slots, G, S, d] storage (f16 viewed as int16)
  acc             [W, quant.acc_floats(n)] float32: each worker's dot_rows accumulator
  xq, xd, xs      flat int8 or int16 [n*k], float32 [n*k/32], int32 [n*k/16]: activations
                  quantized for the integer paths, one matmul input at a time

Why: a decode step of a 30-layer model otherwise makes ~14 Python-to-numba calls per layer,
and at batch 1 on a small model those calls cost as much as the arithmetic. Here a layer is one
call (the functions take a tuple of layers; the plan passes one at a time, plan.py, since each
tuple length would be compiled anew). Every kernel inside is the same code the per-kernel path runs, on the
same rows in the same order, so the results are identical to it.

A weight is a tuple of parts (one matrix, or the matrices of a fusion of different formats)
whose rows follow one another. Kernel paths (cpu.py) arrive as arguments, never as globals:
compiled code is cached on disk, and a global would be frozen into the cache.
"""

import numba
from numba import prange
from numba.extending import overload

from ellmd.kernels import quant
from ellmd.kernels.activations import PARALLEL_MIN, silu_mul
from ellmd.kernels.attention import _store, decode_rows
from ellmd.kernels.matmul import ROW_BLOCK, path_rows
from ellmd.kernels.moe import _block_fused
from ellmd.kernels.norm import _rmsnorm_rows, qk_norm
from ellmd.kernels.rope import _rope_rows


def _parts_rows(x, parts, out, j0, j1, acc, q8, integer):
    """Rows j0:j1 of a tuple of weight parts (rows counted across the parts)."""
    raise NotImplementedError("numba only")


@overload(_parts_rows, jit_options={"fastmath": True, "nogil": True})
def _parts_rows_overload(x, parts, out, j0, j1, acc, q8, integer):
    if len(parts) == 1:

        def impl_one(x, parts, out, j0, j1, acc, q8, integer):
            path_rows(x, q8, parts[0], out, j0, j1, acc, integer)

        return impl_one

    def impl(x, parts, out, j0, j1, acc, q8, integer):
        m0 = parts[0].shape[0]
        if j0 < m0:
            path_rows(x, q8, parts[0], out, j0, min(j1, m0), acc, integer)
        if j1 > m0:
            _parts_rows(x, parts[1:], out[:, m0:], max(j0, m0) - m0, j1 - m0, acc, q8, integer)

    return impl


def _has_integer_part(parts):
    """True (a compile-time constant) when a part is in a block type of the integer paths."""
    raise NotImplementedError("numba only")


@overload(_has_integer_part)
def _has_integer_part_overload(parts):
    flag = any(quant.record_name(t.dtype) in quant.VNNI_BLOCKS for t in parts)
    return lambda parts: flag


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _linear(x, parts, out, acc, q8buf, integer, workers):
    """out = x @ w.T, w the rows of parts; as matmul.linear: serial below the same work, else
    each of `workers` tasks takes a contiguous run of ROW_BLOCK-row blocks with its own acc."""
    n, k = x.shape
    m = out.shape[1]
    xq = q8buf[0][: n * k].reshape((n, k))
    xd = q8buf[1][: n * (k // 32)].reshape((n, k // 32))
    xs = q8buf[2][: n * (k // 16)].reshape((n, k // 16))
    if integer and _has_integer_part(parts):
        quant.quantize_activations(x, xq, xd, xs)
    q8 = (xq, xd, xs)
    if n * m * k < 8 * PARALLEL_MIN:
        _parts_rows(x, parts, out, 0, m, acc[0], q8, integer)
        return
    blocks = (m + ROW_BLOCK - 1) // ROW_BLOCK
    for wk in prange(workers):
        b0, b1 = wk * blocks // workers, (wk + 1) * blocks // workers
        _parts_rows(x, parts, out, b0 * ROW_BLOCK, min(m, b1 * ROW_BLOCK), acc[wk], q8, integer)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _add(x, y):
    """x += y (the residual)."""
    for i in range(x.shape[0]):
        for c in range(x.shape[1]):
            x[i, c] += y[i, c]


@numba.njit(cache=True, nogil=True, fastmath=True)
def _attention(weights, ws, n, slots, positions, shape, eps, scale, threads, paths):
    """x += attention(rmsnorm(x)); then h = post-attention rmsnorm(x)."""
    index, ln1, qkv_w, bias, q_norm, k_norm, o_w, ln2 = weights
    x, h, qkv_buf, attn, lengths, cos, sin, kv_k, kv_v, pm, pl, pa, tile, acc = ws
    integer, workers, q8buf = paths
    H, G, d = shape
    x, h = x[:n], h[:n]
    _rmsnorm_rows(x, ln1, eps, h, 0, n)
    qkv = qkv_buf[:n]
    _linear(h, qkv_w, qkv, acc, q8buf, integer, workers)
    for i in range(n if bias.shape[0] else 0):
        for c in range(bias.shape[0]):
            qkv[i, c] += bias[c]
    if q_norm.shape[0]:
        qk_norm(qkv, H, G, q_norm, k_norm, eps)
    heads = qkv.reshape((n, H + 2 * G, d))
    q, k, v = heads[:, :H], heads[:, H : H + G], heads[:, H + G :]
    _rope_rows(q, positions, cos, sin, 0, n)
    _rope_rows(k, positions, cos, sin, 0, n)
    k_layer, v_layer = kv_k[index], kv_v[index]
    _store(k, v, k_layer, v_layer, slots, positions)
    for i in range(n):
        lengths[i] = positions[i] + 1
    decode_rows(q, k_layer, v_layer, slots, lengths[:n], scale, pm, pl, pa, tile, threads, attn[:n].reshape((n, H, d)))
    _linear(attn[:n], o_w, h, acc, q8buf, integer, workers)
    _add(x, h)
    _rmsnorm_rows(x, ln2, eps, h, 0, n)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dense_mlp(weights, ws, n, paths):
    """x += down(silu(gate) * up) of h."""
    gate_up_w, down_w = weights
    x, h, gate_up, act, acc = ws
    integer, workers, q8buf = paths
    x, h = x[:n], h[:n]
    _linear(h, gate_up_w, gate_up[:n], acc, q8buf, integer, workers)
    silu_mul(gate_up[:n], act[:n])
    _linear(act[:n], down_w, h, acc, q8buf, integer, workers)
    _add(x, h)


@numba.njit(cache=True, nogil=True, fastmath=True)
def decode_dense(layers, ws, mlp_ws, n, slots, positions, shape, eps, scale, threads, paths):
    """Decode n rows through a run of dense layers (Llama, Qwen3); x[:n] holds their embeddings.

    layers: a tuple of (attention weights, (gate_up parts, down parts)), every layer of the same
    types; attention weights: (layer index, input norm [h], qkv parts, qkv bias [(H+2G)*d] or
    [0], q_norm [d] or [0], k_norm [d] or [0], o parts, post-attention norm [h]); ws: the
    workspace buffers (plan.py); shape: (H, G, d); paths: (integer path on, workers, (xq, xd, xs)):
    xq's dtype picks the integer path, int8 (vpdpbusd) or int16 (vpdpwssd, or vpmaddwd on AVX2).
    """
    for i in range(len(layers)):
        attention_weights, mlp_weights = layers[i]
        _attention(attention_weights, ws, n, slots, positions, shape, eps, scale, threads, paths)
        _dense_mlp(mlp_weights, mlp_ws, n, paths)


@numba.njit(cache=True, nogil=True, fastmath=True)
def decode_moe(layers, ws, moe_ws, n, slots, positions, shape, eps, scale, threads, paths, top_k, normalize):
    """decode_dense for a run of Qwen3-MoE layers: the routed experts' MLP (moe.moe_block's fused path).

    layers: a tuple of (attention weights, (router [E, h], gate, up, up0, down)) with the expert
    stacks of moe.moe_block; moe_ws: (x, h, moe_out, router logits, weights, experts, the work
    arrays of moe.fused_work, whose codes have the dtype of paths' xq).
    """
    x, h, out, logits, weights, experts, work = moe_ws
    integer = paths[0]
    for i in range(len(layers)):
        attention_weights, (router, gate, up, up0, down) = layers[i]
        _attention(attention_weights, ws, n, slots, positions, shape, eps, scale, threads, paths)
        _block_fused(h[:n], router, top_k, normalize, (gate, up, up0, down), out[:n], logits[:n], weights[:n],
                     experts[:n], work, integer)
        _add(x[:n], out[:n])


@numba.njit(cache=True, nogil=True, fastmath=True)
def decode_logits(x, n, norm, eps, lm_head, h, out, acc, paths):
    """out[:n] = lm_head(rmsnorm(x[:n])): the logits of the n decode rows. lm_head: its parts."""
    _rmsnorm_rows(x[:n], norm, eps, h[:n], 0, n)
    _linear(h[:n], lm_head, out[:n], acc, paths[2], paths[0], paths[1])
