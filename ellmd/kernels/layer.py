"""A transformer layer, defined once: `layer` runs kernel by kernel from Python (prefill) and
compiled in one call (`decode_layer`, a decode step).

Shape legend (n rows: a prefill chunk's tokens of one slot, or a decode step's, one per slot;
h hidden; H, G query/kv heads; d head_dim; I intermediate; E experts, k of them per token;
W workers = kernel threads; L layers of the model):
  x, h            [n, h]          residual stream; normed input / branch output
  qkv             [n, (H+2G)*d]   viewed as [n, H+2G, d]: q heads, then k, then v
  attn            [n, H*d]
  gate_up, act    [n, 2*I], [n, I]
  moe_out [n, h]; router logits [n, E]; expert weights, expert ids [n, k]
  k_cache, v_cache [L, slots, G, S, d] storage (compiled: kernel views, f16 as int16)
  key_mean        [L, G, d] float32 subtracted from keys stored in q4_0 (kv_blocks.py), or [L, 0, d]
  acc             [W, quant_f32.acc_floats(n)] float32: each worker's dot_rows accumulator
  xq, xd, xs      flat int8 or int16 [n*k], float32 [n*k/32], float32 [n*k/16]: activations
                  quantized for the integer paths, one matmul input at a time

`layer` is the sequence of blocks: rmsnorm -> qkv -> (Qwen3: q/k norm) -> rope -> store K, V ->
attention -> o_proj -> residual -> rmsnorm -> MLP or routed experts -> residual. Each block is an
op below: a plain Python function, the kernel-by-kernel call, and a numba overload, its call
inside compiled code. Called from Python, `layer` runs the kernel entry points one by one, which
choose their kernels by the rows (matmul's GEMM from PREFILL_MIN_ROWS rows, prefill or decode
attention): prefill, and decode's reference (Plan.fused_decode off). `decode_layer` is the same
function compiled: each op becomes its fused call, and a decode step's layer is one call.

Why: a decode step of a 30-layer model otherwise makes ~14 Python-to-numba calls per layer,
and at batch 1 on a small model those calls cost as much as the arithmetic. The plan passes one
layer at a time (plan.py): the layer's weight types compile once each, whatever the layer count.
Every kernel inside is the same code the kernel-by-kernel path runs, on the same rows in the
same order, so the results are identical to it.

The ops take their kernel-path arguments from `run`: a Stepwise record from Python, fused_run's
tuple compiled. A weight is a tuple of parts (one matrix, or the matrices of a fusion of
different formats) whose rows follow one another. Kernel paths (cpu.py) arrive as arguments,
never as globals: compiled code is cached on disk, and a global would be frozen into the cache.
"""

from typing import NamedTuple

import numba
import numpy as np
from numba import prange, types
from numba.extending import overload

from ellmd.kernels import attention, bf16, dpbf16, lanes, moe, norm, quant
from ellmd.kernels.activations import PARALLEL_MIN, silu_mul
from ellmd.kernels.matmul import ROW_BLOCK, matmul, part_rows, path_rows
from ellmd.kernels.norm import _rmsnorm_heads_rows, _rmsnorm_rows
from ellmd.kernels.rope import _rope_rows, rope

JIT = {"fastmath": True, "nogil": True}


class Stepwise(NamedTuple):
    """`run` of `layer` called from Python: what the kernel entry points take beside its arrays."""

    fmt: int  # the weights' storage format
    kv_fmt: int
    decode: bool  # one token per slot (attention_decode), else consecutive tokens of slots[0] (attention_prefill)
    matmul_scratch: np.ndarray
    attention_scratch: dict  # attention_decode's scratch arrays by name
    moe: tuple  # (top_k, normalize, MoeScratch) of a model with routed experts, else ()


def fused_run(integer, workers, q8buf, halves, acc, threads, attention_scratch, moe_work) -> tuple:
    """`run` of decode_layer: integer (an integer path on), workers and acc [W, ...] of _linear,
    q8buf (xq, xd, xs; on the "int8" path then int8 xq8, xd8, xs8 for lanes.INT8_BLOCKS), halves
    (xh, xl, on_tiles: flat uint16 for the packed activations, where bf16 weights decode on AMX tiles
    (on_tiles) or on vdpbf16ps, else (); xl empty where activations are rounded once), threads of decode attention, attention_scratch (partial_m, partial_l, partial_acc, tile) and moe_work (top_k,
    normalize, moe.fused_work's work) or ()."""
    return integer, workers, q8buf, halves, acc, threads, attention_scratch, moe_work


def layer(weights, ws, n, slots, positions, dims, run):
    """x[:n] += attention(rmsnorm(x)), then x[:n] += mlp(rmsnorm(x)): one layer over the n rows of
    slots and positions, x holding their embeddings or the previous layer's output.

    weights: (attention weights, MLP weights) of Llama.layer_weights; attention weights: (layer
    index, input norm [h], qkv parts, qkv bias [(H+2G)*d] or [0], q_norm [d] or [0], k_norm [d] or
    [0], o parts, post-attention norm [h]); MLP weights: see feed_forward. ws: (x, h, qkv, attn,
    lengths, cos, sin, k_cache, v_cache, (gate_up, act, (moe_out, router logits, expert weights,
    expert ids) or ()), key_mean) (plan.py); dims: (H, G, d, rms_norm_eps, attention scale); run: Stepwise
    from Python, fused_run compiled.
    """
    index, ln1, qkv_w, bias, q_norm, k_norm, o_w, ln2 = weights[0]
    x, h, qkv, attn, lengths, cos, sin, k_cache, v_cache, mlp_buffers, key_mean = ws
    H, G, d, eps, scale = dims
    x, h, qkv = x[:n], h[:n], qkv[:n]
    rmsnorm(x, ln1, eps, h)
    linear(h, qkv_w, qkv, run)
    add_bias(qkv, bias)
    heads = qkv.reshape((n, H + 2 * G, d))
    q, k, v = heads[:, :H], heads[:, H : H + G], heads[:, H + G :]
    if q_norm.shape[0]:  # Qwen3: an RMSNorm over each head of q and k
        rmsnorm_heads(q, q_norm, eps)
        rmsnorm_heads(k, k_norm, eps)
    rotate(q, positions, cos, sin)
    rotate(k, positions, cos, sin)
    k_layer, v_layer = k_cache[index], v_cache[index]
    store_kv(k, v, k_layer, v_layer, key_mean[index], slots, positions, run)
    attend(q, k_layer, v_layer, slots, positions, lengths, scale, attn[:n].reshape((n, H, d)), run)
    linear(attn[:n], o_w, h, run)
    add(x, h)
    rmsnorm(x, ln2, eps, h)
    feed_forward(weights[1], x, h, mlp_buffers, run)


# the layer compiled: each op below becomes its overload (cached on disk like every kernel)
decode_layer = numba.njit(cache=True, nogil=True, fastmath=True)(layer)


def routed(mlp_weights) -> bool:
    """True for routed experts' weights (router, gate, up, up0, down), False for a dense MLP's
    (gate_up parts, down parts); a compile-time constant inside compiled code."""
    return len(mlp_weights) == 5


def feed_forward(weights, x, h, buffers, run):
    """x += the MLP of h: dense_mlp or routed_mlp, by the weights."""
    (routed_mlp if routed(weights) else dense_mlp)(weights, x, h, buffers, run)


@overload(feed_forward, jit_options=JIT)
def _feed_forward_compiled(weights, x, h, buffers, run):
    return routed_mlp if routed(weights) else dense_mlp


def dense_mlp(weights, x, h, buffers, run):
    """x += down(silu(gate) * up) of h. weights: (gate_up parts, down parts)."""
    gate_up_w, down_w = weights
    n = x.shape[0]
    gate_up, act = buffers[0][:n], buffers[1][:n]
    linear(h, gate_up_w, gate_up, run)
    silu_mul(gate_up, act)
    linear(act, down_w, h, run)
    add(x, h)


def routed_mlp(weights, x, h, buffers, run):
    """x += the routed experts' MLP of h. weights: (router [E, h] f32, gate, up, up0, down) with the
    expert stacks of moe.moe_block (up's rows start at up0 of its stack)."""
    n = x.shape[0]
    out, logits, chosen, ids = buffers[2]
    experts(h, weights, out[:n], logits[:n], chosen[:n], ids[:n], run)
    add(x, out[:n])


# ---- the ops: the kernel-by-kernel call, then the compiled one ----------------------------------


def rmsnorm(x, weight, eps, out):
    """out = rmsnorm(x) * weight (norm.rmsnorm: rows in parallel when many)."""
    norm.rmsnorm(x, weight, eps, out)


@overload(rmsnorm, jit_options=JIT)
def _rmsnorm_compiled(x, weight, eps, out):
    return lambda x, weight, eps, out: _rmsnorm_rows(x, weight, eps, out, 0, x.shape[0])


def rmsnorm_heads(x, weight, eps):
    """rmsnorm over each head of x [n, heads, d], in place (norm.rmsnorm_heads: rows in parallel when many)."""
    norm.rmsnorm_heads(x, weight, eps)


@overload(rmsnorm_heads, jit_options=JIT)
def _rmsnorm_heads_compiled(x, weight, eps):
    return lambda x, weight, eps: _rmsnorm_heads_rows(x, weight, eps, 0, x.shape[0])


def linear(x, w, out, run):
    """out = x @ w.T, w a tuple of parts (matmul: decode's kernel, or the GEMM from PREFILL_MIN_ROWS rows)."""
    matmul(x, w[0] if len(w) == 1 else w, run.fmt, out, run.matmul_scratch)


@overload(linear, jit_options=JIT)
def _linear_compiled(x, w, out, run):
    def impl(x, w, out, run):
        integer, workers, q8buf, halves, acc, _, _, _ = run
        _linear(x, w, out, acc, q8buf, halves, integer, workers)

    return impl


def add_bias(x, bias):
    """x += bias on every row; bias [0]: none."""
    if bias.shape[0]:
        np.add(x, bias, out=x)


@overload(add_bias, jit_options=JIT)
def _add_bias_compiled(x, bias):
    def impl(x, bias):
        for i in range(x.shape[0] if bias.shape[0] else 0):
            for c in range(bias.shape[0]):
                x[i, c] += bias[c]

    return impl


def rotate(x, positions, cos, sin):
    """Rope on x [n, heads, d] in place, row i at positions[i]."""
    rope(x, positions[: x.shape[0]], cos, sin)


@overload(rotate, jit_options=JIT)
def _rotate_compiled(x, positions, cos, sin):
    return lambda x, positions, cos, sin: _rope_rows(x, positions, cos, sin, 0, x.shape[0])


def store_kv(k, v, k_layer, v_layer, key_mean, slots, positions, run):
    """The rows' keys and values [n, G, d] into the layer's cache at (slot, head, position), keys
    less key_mean [G, d] (or [0, d]: none)."""
    n = k.shape[0]
    attention.store_kv(k, v, k_layer, v_layer, run.kv_fmt, slots[:n], positions[:n], key_mean)


@overload(store_kv, jit_options=JIT)
def _store_kv_compiled(k, v, k_layer, v_layer, key_mean, slots, positions, run):
    return lambda k, v, k_layer, v_layer, key_mean, slots, positions, run: attention._store(
        k, v, k_layer, v_layer, key_mean, slots, positions)


def attend(q, k_layer, v_layer, slots, positions, lengths, scale, out, run):
    """out [n, H, d] = causal attention of q over the keys stored so far: a decode step's rows, each
    of its slot up to its position (attention_decode), or a chunk of slots[0] from positions[0]
    (attention_prefill)."""
    n = q.shape[0]
    if run.decode:
        np.add(positions[:n], 1, out=lengths[:n])
        attention.attention_decode(q, k_layer, v_layer, run.kv_fmt, slots[:n], lengths[:n], scale, out,
                                   **run.attention_scratch)
    else:
        slot = slots[0]
        attention.attention_prefill(q, k_layer[slot], v_layer[slot], run.kv_fmt, int(positions[0]), scale, out)


@overload(attend, jit_options=JIT)
def _attend_compiled(q, k_layer, v_layer, slots, positions, lengths, scale, out, run):
    bf16_kv = k_layer.dtype == types.uint16  # f16 KV comes viewed as int16

    def impl(q, k_layer, v_layer, slots, positions, lengths, scale, out, run):
        n = q.shape[0]
        for i in range(n):
            lengths[i] = positions[i] + 1
        _, _, _, halves, _, threads, (partial_m, partial_l, partial_acc, tile), _ = run
        products = _attention_products(halves, q.shape[2]) if bf16_kv else attention.ON_F32
        attention.decode_rows(q, k_layer, v_layer, slots, lengths[:n], scale, partial_m, partial_l, partial_acc,
                              tile, threads, products, out)

    return impl


def add(x, y):
    """x += y (the residual)."""
    np.add(x, y, out=x)


@overload(add, jit_options=JIT)
def _add_compiled(x, y):
    return lambda x, y: _add(x, y)


def experts(x, weights, out, logits, chosen, ids, run):
    """out = the routed experts' MLP of x (moe.moe_block); logits, chosen, ids receive the routing."""
    router, gate, up, _, down = weights
    top_k, normalize, scratch = run.moe
    moe.moe_block(x, router, top_k, normalize, (gate, up), down, run.fmt, out, logits, chosen, ids, scratch)


@overload(experts, jit_options=JIT)
def _experts_compiled(x, weights, out, logits, chosen, ids, run):
    def impl(x, weights, out, logits, chosen, ids, run):
        router, gate, up, up0, down = weights
        integer, _, _, _, _, _, _, (top_k, normalize, work) = run
        moe._block_fused(x, router, top_k, normalize, (gate, up, up0, down), out, logits, chosen, ids, work, integer)

    return impl


# ---- the compiled kernels of the ops ------------------------------------------------------------


def _parts_rows(x, parts, out, j0, j1, acc, q8, halves, integer):
    """Rows j0:j1 of a tuple of weight parts (rows counted across the parts)."""
    raise NotImplementedError("numba only")


@overload(_parts_rows, jit_options=JIT)
def _parts_rows_overload(x, parts, out, j0, j1, acc, q8, halves, integer):
    if len(parts) == 1:

        def impl_one(x, parts, out, j0, j1, acc, q8, halves, integer):
            path_rows(x, q8, halves, parts[0], out, j0, j1, acc, integer)

        return impl_one

    def impl(x, parts, out, j0, j1, acc, q8, halves, integer):
        m0 = part_rows(parts[0])
        if j0 < m0:
            path_rows(x, q8, halves, parts[0], out, j0, min(j1, m0), acc, integer)
        if j1 > m0:
            _parts_rows(x, parts[1:], out[:, m0:], max(j0, m0) - m0, j1 - m0, acc, q8, halves, integer)

    return impl


def _attention_products(halves, hd):
    """attention.products of bf16 KV, from run's halves: AMX tiles with decode's matmuls on them
    (hd % 16 == 0), vdpbf16ps with theirs on it (hd % 32 == 0), else the f32 kernels."""
    raise NotImplementedError("numba only")


@overload(_attention_products, jit_options={"fastmath": False})
def _attention_products_overload(halves, hd):
    if len(halves) == 0:
        return lambda halves, hd: attention.ON_F32

    def impl(halves, hd):
        if halves[2]:
            return attention.ON_AMX if hd % 16 == 0 else attention.ON_F32
        return attention.ON_DPBF16 if hd % 32 == 0 else attention.ON_F32

    return impl


def _packed(x, parts, halves):
    """(xh, xl, on_tiles): x packed into the flat halves, when they are given and a part is bf16: on
    AMX tiles as rows (bf16.pack_token_rows) for weights packed at load, else by pairs
    (bf16.pack_tokens); on vdpbf16ps as rows of values for packed weights (dpbf16.pack_tokens);
    else ()."""
    raise NotImplementedError("numba only")


@overload(_packed, jit_options={"fastmath": False})
def _packed_overload(x, parts, halves):
    packed = any(bf16.packed_type(t) for t in parts)
    if len(halves) == 0 or not (packed or any(t.dtype == numba.types.uint16 for t in parts)):
        return lambda x, parts, halves: ()
    pack = bf16.pack_token_rows if packed else bf16.pack_tokens

    def impl(x, parts, halves):
        n, k = x.shape
        tiles = halves[2]
        if tiles:
            shape = ((n + bf16.TILE - 1) // bf16.TILE, k * bf16.TILE)
        else:  # vdpbf16ps: packed weights only (the others take the f32 kernels)
            shape = (dpbf16.token_rows(n) if packed else 0, k)
        xh = halves[0][: shape[0] * shape[1]].reshape(shape)
        lo_shape = (shape[0] if halves[1].size else 0, shape[1])  # no lo half: activations rounded once
        xl = halves[1][: lo_shape[0] * shape[1]].reshape(lo_shape)
        if tiles:
            pack(x, xh, xl)
        elif packed:
            dpbf16.pack_tokens(x, xh, xl)
        return xh, xl, tiles

    return impl


def _quantizes(parts, integer, q8buf):
    """True when the activations are quantized to q8buf's first codes for parts: a part in tiles
    (lanes.py) that does not take the int8 codes (_with_int8), or in a block type of the integer
    paths when they are on (the block types: a compile-time constant)."""
    raise NotImplementedError("numba only")


@overload(_quantizes, jit_options={"fastmath": False})
def _quantizes_overload(parts, integer, q8buf):
    blocks = any(quant.record_name(t.dtype) in quant.VNNI_BLOCKS for t in parts)
    tiles = any(lanes.tiles_type(t) and not lanes.takes_int8(t, q8buf) for t in parts)
    return lambda parts, integer, q8buf: tiles or (integer and blocks)


def _with_int8(x, parts, q8, q8buf):
    """q8, and where q8buf holds int8 buffers too (the "int8" path) and a part is in tiles of
    lanes.INT8_BLOCKS, x's int8 codes, scales and sums after it (matmul.path_rows)."""
    raise NotImplementedError("numba only")


@overload(_with_int8, jit_options={"fastmath": True, "nogil": True})
def _with_int8_overload(x, parts, q8, q8buf):
    if not any(lanes.takes_int8(t, q8buf) for t in parts):
        return lambda x, parts, q8, q8buf: q8

    def impl(x, parts, q8, q8buf):
        n, k = x.shape
        xq = q8buf[3][: n * k].reshape((n, k))
        xd = q8buf[4][: n * (k // 32)].reshape((n, k // 32))
        xs = q8buf[5][: n * (k // 16)].reshape((n, k // 16))
        quant.quantize_activations(x, xq, xd, xs)
        return (q8[0], q8[1], q8[2], xq, xd, xs)

    return impl


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _linear(x, parts, out, acc, q8buf, halves, integer, workers):
    """out = x @ w.T, w the rows of parts; as matmul.linear: serial below the same work, else
    each of `workers` tasks takes a contiguous run of ROW_BLOCK-row blocks with its own acc."""
    n, k = x.shape
    m = out.shape[1]
    xq = q8buf[0][: n * k].reshape((n, k))
    xd = q8buf[1][: n * (k // 32)].reshape((n, k // 32))
    xs = q8buf[2][: n * (k // 16)].reshape((n, k // 16))
    if _quantizes(parts, integer, q8buf):
        quant.quantize_activations(x, xq, xd, xs)
    q8 = _with_int8(x, parts, (xq, xd, xs), q8buf)
    packed = _packed(x, parts, halves)
    if n * m * k < 8 * PARALLEL_MIN:
        _parts_rows(x, parts, out, 0, m, acc[0], q8, packed, integer)
        return
    blocks = (m + ROW_BLOCK - 1) // ROW_BLOCK
    for wk in prange(workers):
        b0, b1 = wk * blocks // workers, (wk + 1) * blocks // workers
        _parts_rows(x, parts, out, b0 * ROW_BLOCK, min(m, b1 * ROW_BLOCK), acc[wk], q8, packed, integer)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _add(x, y):
    """x += y (the residual)."""
    for i in range(x.shape[0]):
        for c in range(x.shape[1]):
            x[i, c] += y[i, c]


@numba.njit(cache=True, nogil=True, fastmath=True)
def decode_logits(x, n, norm, eps, lm_head, h, out, acc, paths):
    """out[:n] = lm_head(rmsnorm(x[:n])): the logits of the n decode rows. lm_head: its parts."""
    _rmsnorm_rows(x[:n], norm, eps, h[:n], 0, n)
    _linear(h[:n], lm_head, out[:n], acc, paths[2], paths[3], paths[0], paths[1])
