"""Mixture-of-experts block of Qwen3-MoE: router top-k and the routed expert MLPs.

Shape legend:
  n   tokens
  E   experts; k experts per token (top_k)
  h   hidden size; I expert intermediate size
  W   workers of the fused path (kernel threads)
  expert stacks: gate_up [E, 2*I, h] (gate rows, then up rows) or a tuple (gate, up) of [E, I, h];
  down [E, h, I]; in a block format (quant.py) the last axis counts blocks

Two paths, both reading each routed expert's weights once per call whatever its number of tokens:

- fused (few tokens, n <= FUSED_MAX_TOKENS; any number of tokens when the experts are in GGUF
  blocks): moe_block runs the router, the top-k, and every routed expert's gate_up, silu, down and
  weighted sum in one compiled call. Each of W workers owns a run of weight rows across all
  routed experts (gate_up: a run of intermediate columns, with its silu; down: a run of hidden
  columns of the output), so workers write disjoint outputs and need no reduction, and a layer
  costs one Python-to-numba transition instead of a few per expert. A worker takes ROW_BLOCK
  weight rows at a time over all of the expert's tokens, FUSED_MAX_TOKENS at a time, so a prefill
  chunk reads an expert's weights once from memory (a GEMM over its tokens). On the integer paths
  (cpu.py) block weights meet activations quantized once: each pair's input for gate and up, each
  pair's silu output for down, as dense layers do (kernels.layer). Every work array is the scratch's.
- grouped (many tokens on float experts): experts run one at a time over the tokens routed to
  them (gathered into contiguous rows), through the same matmul as dense layers (packed panels for
  many rows, or AMX on the opt-in prefill paths: not on "bf16", whose AMX decode the fused path
  does not share).

(token, slot) pairs are grouped by expert in both, so one expert's inputs are contiguous rows.
"""

from typing import NamedTuple

import numba
import numpy as np
from numba import prange
from numba.extending import overload

from ellmd.kernels import cpu, quant, quant_f32
from ellmd.kernels.activations import FASTMATH_DIVIDES, exp_f32, silu_mul, silu_mul_ref
from ellmd.kernels.formats import F32, kernel_view, to_f32
from ellmd.kernels.matmul import ROW_BLOCK, linear_rows, matmul, matmul_ref, path_rows, prefill_scratch_size

FUSED_MAX_TOKENS = 16  # up to this many tokens float experts take the fused path (decode batches); its row slice


@numba.njit(cache=True, nogil=True, fastmath=True)
def route(router_logits, top_k, normalize, weights_out, experts_out):
    """Softmax over experts, then the top_k of each token, as Hugging Face's Qwen3-MoE.

    router_logits: [n, E] float32; weights_out: [n, k] float32 (the selected probabilities,
    divided by their sum when normalize); experts_out: [n, k] int64, by decreasing weight,
    ties to the lower expert index. Selection compares logits (the softmax is monotonic), so
    it is exact whatever the rounding of the probabilities.
    """
    n, num_experts = router_logits.shape
    for i in range(n):
        row = router_logits[i]
        mx = row[0]
        for e in range(1, num_experts):
            mx = max(mx, row[e])
        total = np.float32(0.0)
        for e in range(num_experts):
            total += np.exp(row[e] - mx)
        chosen = np.float32(0.0)
        prev, prev_e = mx, -1
        for j in range(top_k):
            # the largest (logit, -index) below the previous pick
            best, best_e = mx, -1
            for e in range(num_experts):
                v = row[e]
                below = j == 0 or v < prev or (v == prev and e > prev_e)
                if below and (best_e < 0 or v > best):
                    best, best_e = v, e
            experts_out[i, j] = best_e
            weights_out[i, j] = np.exp(best - mx) / total
            chosen += weights_out[i, j]
            prev, prev_e = best, best_e
        if normalize:
            for j in range(top_k):
                weights_out[i, j] /= chosen


def route_ref(router_logits, top_k, normalize, weights_out, experts_out):
    """numpy reference of route."""
    z = router_logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)  # [n, E]
    order = np.argsort(-p, axis=1, kind="stable")[:, :top_k]  # [n, k]
    w = np.take_along_axis(p, order, axis=1)
    if normalize:
        w /= w.sum(axis=1, keepdims=True)
    weights_out[:] = w
    experts_out[:] = order


class MoeScratch(NamedTuple):
    """Work arrays of moe_experts, sized for at most max_tokens tokens (see moe_scratch)."""

    order: np.ndarray  # [n*k] int64: (token, slot) pairs grouped by expert, pair = token * k + slot
    offsets: np.ndarray  # [E + 1] int64: expert e owns order[offsets[e]:offsets[e + 1]]
    active: np.ndarray  # [E] int64: experts with tokens, first `count` entries
    # rows: n*k, every pair (the fused path, in `order`); the grouped path uses one expert's rows
    xs: np.ndarray  # [rows, h] float32: gathered inputs
    gate_up: np.ndarray  # [n, 2*I] float32: one expert's rows on the grouped path
    act: np.ndarray  # [rows, I] float32
    ys: np.ndarray  # [n, h] float32: the grouped path's expert outputs before weighting
    matmul: np.ndarray  # 1-D float32: matmul's prefill scratch
    # the fused path's own, per worker (S = min(max_tokens, FUSED_MAX_TOKENS) rows a slice):
    acc: np.ndarray  # [W, quant_f32.acc_floats(S)] float32: block-row accumulator
    tiles: np.ndarray  # [W, S, 3*ROW_BLOCK] float32: gate, up and down outputs of a slice and row block
    # activations quantized for the integer paths, two areas one after the other: the pairs'
    # inputs [rows, h], their silu outputs [rows, I] (see _area)
    codes8: np.ndarray  # [rows*(h + I)] int8 codes ("vnni")
    codes16: np.ndarray  # [rows*(h + I)] int16 codes ("int16")
    scales: np.ndarray  # [rows*(h + I) / 32] float32: one per 32 values
    sums: np.ndarray  # [rows*(h + I) / 16] float32: code sums per 16 values


def moe_scratch(max_tokens, top_k, num_experts, hidden, inter):
    """Allocate the scratch of moe_experts and moe_block for up to max_tokens tokens."""
    rows = max_tokens * top_k
    piece = min(max_tokens, FUSED_MAX_TOKENS)
    workers = numba.get_num_threads()
    codes = rows * (hidden + inter)
    return MoeScratch(
        order=np.zeros(rows, np.int64),
        offsets=np.zeros(num_experts + 1, np.int64),
        active=np.zeros(num_experts, np.int64),
        xs=np.zeros((rows, hidden), np.float32),
        gate_up=np.zeros((max_tokens, 2 * inter), np.float32),
        act=np.zeros((rows, inter), np.float32),
        ys=np.zeros((max_tokens, hidden), np.float32),
        matmul=np.zeros(
            max(prefill_scratch_size(2 * inter, hidden), prefill_scratch_size(hidden, inter)), np.float32
        ),
        acc=np.zeros((workers, quant_f32.acc_floats(piece)), np.float32),
        tiles=np.zeros((workers, piece, 3 * ROW_BLOCK), np.float32),
        codes8=np.zeros(codes, np.int8),
        codes16=np.zeros(codes, np.int16),
        scales=np.zeros(codes // 32 + 1, np.float32),
        sums=np.zeros(codes // 16 + 1, np.float32),
    )


def fused_work(scratch) -> tuple:
    """(work, integer): the scratch arrays the fused kernels take, on the kernel path cpu.ENABLED
    names at this call (int8 codes on "vnni", int16 on "int16"), and whether an integer path is on.

    work: (order, offsets, active, xs, act, acc and tiles of W workers, codes, scales, sums).
    """
    s = scratch
    codes = s.codes8 if "vnni" in cpu.ENABLED else s.codes16
    workers = max(1, min(numba.get_num_threads(), len(s.acc)))
    work = (s.order, s.offsets, s.active, s.xs, s.act, s.acc[:workers], s.tiles[:workers], codes, s.scales, s.sums)
    return work, bool(cpu.INTEGER & cpu.ENABLED)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _group(experts, order, offsets, active):
    """Counting sort of the (token, slot) pairs by expert; returns the number of active experts."""
    n, k = experts.shape
    num_experts = active.shape[0]
    for e in range(num_experts + 1):
        offsets[e] = 0
    for i in range(n):
        for j in range(k):
            offsets[experts[i, j] + 1] += 1
    count = 0
    for e in range(num_experts):
        if offsets[e + 1] > 0:
            active[count] = e
            count += 1
        offsets[e + 1] += offsets[e]
    # offsets[e] serves as expert e's write cursor, which ends at the start of e + 1 ...
    for i in range(n):
        for j in range(k):
            e = experts[i, j]
            order[offsets[e]] = i * k + j
            offsets[e] += 1
    # ... so shifting by one restores the starts
    for e in range(num_experts, 0, -1):
        offsets[e] = offsets[e - 1]
    offsets[0] = 0
    return count


@numba.njit(cache=True, nogil=True, fastmath=True)
def _gather(x, pairs, k, xs):
    """xs[r] = x[token of pair r]."""
    for r in range(pairs.shape[0]):
        src = x[pairs[r] // k]
        dst = xs[r]
        for c in range(dst.shape[0]):
            dst[c] = src[c]


@numba.njit(cache=True, nogil=True, fastmath=True)
def _scatter_add(ys, pairs, weights, out):
    """out[token] += routing weight * ys[r] for each pair r."""
    k = weights.shape[1]
    for r in range(pairs.shape[0]):
        w = weights[pairs[r] // k, pairs[r] % k]
        dst = out[pairs[r] // k]
        src = ys[r]
        for c in range(dst.shape[0]):
            dst[c] += w * src[c]


def _on_integer(w):
    """True (a compile-time constant) when stack w is in a block type of the integer paths."""
    raise NotImplementedError("numba only")


@overload(_on_integer, jit_options={"fastmath": False})
def _on_integer_overload(w):
    flag = quant.record_name(w.dtype) in quant.VNNI_BLOCKS
    return lambda w: flag


@numba.njit(cache=True, nogil=True, fastmath=True)
def _area(codes, scales, sums, start, rows, k):
    """(xq [rows, k], xd [rows, k/32], xs [rows, k/16]): quantized activations from value `start`
    of the flat buffers (areas carved this way from increasing starts never overlap)."""
    xq = codes[start : start + rows * k].reshape((rows, k))
    xd = scales[start // 32 : start // 32 + rows * (k // 32)].reshape((rows, k // 32))
    xs = sums[start // 16 : start // 16 + rows * (k // 16)].reshape((rows, k // 16))
    return xq, xd, xs


@numba.njit(cache=True, nogil=True, fastmath=FASTMATH_DIVIDES)  # its silu as silu_mul's
def _gate_up_block(xs, q, stacks, offsets, active, count, act, c0, c1, acc, tile, integer):
    """act[:, c0:c1] = silu(gate) * up of intermediate columns c0:c1, for every routed expert.

    gate rows c0:c1 and up rows up0 + c0:up0 + c1 of each expert, ROW_BLOCK rows at a time over
    all the expert's rows (FUSED_MAX_TOKENS at a time: the rows of tile); xs [rows, h] the gathered
    inputs, q the same quantized (read on the integer path only).
    """
    gate, up, up0, _ = stacks
    for t in range(count):
        e = active[t]
        gate_e, up_e = gate[e], up[e]
        for j0 in range(c0, c1, ROW_BLOCK):
            j1 = min(c1, j0 + ROW_BLOCK)
            g_rows, u_rows = gate_e[j0:j1], up_e[up0 + j0 : up0 + j1]
            for r0 in range(offsets[e], offsets[e + 1], tile.shape[0]):
                r1 = min(offsets[e + 1], r0 + tile.shape[0])
                x_r, q_r = xs[r0:r1], (q[0][r0:r1], q[1][r0:r1], q[2][r0:r1])
                g, u = tile[: r1 - r0, :ROW_BLOCK], tile[: r1 - r0, ROW_BLOCK : 2 * ROW_BLOCK]
                path_rows(x_r, q_r, (), g_rows, g, 0, j1 - j0, acc, integer)
                path_rows(x_r, q_r, (), u_rows, u, 0, j1 - j0, acc, integer)
                for r in range(r1 - r0):
                    dst = act[r0 + r]
                    for c in range(j1 - j0):
                        dst[j0 + c] = g[r, c] / (np.float32(1.0) + exp_f32(-g[r, c])) * u[r, c]


@numba.njit(cache=True, nogil=True, fastmath=True)
def _down_block(act, q, down, order, offsets, active, count, weights, out, c0, c1, acc, tile, integer):
    """out[:, c0:c1] = sum over routed experts of weight * down rows c0:c1 (overwrites out's columns),
    blocked as _gate_up_block; q: act quantized (read on the integer path only)."""
    k = weights.shape[1]
    for i in range(out.shape[0]):
        for c in range(c0, c1):
            out[i, c] = np.float32(0.0)
    for t in range(count):
        e = active[t]
        down_e = down[e]
        for j0 in range(c0, c1, ROW_BLOCK):
            j1 = min(c1, j0 + ROW_BLOCK)
            rows = down_e[j0:j1]
            for r0 in range(offsets[e], offsets[e + 1], tile.shape[0]):
                r1 = min(offsets[e + 1], r0 + tile.shape[0])
                y = tile[: r1 - r0, 2 * ROW_BLOCK :]
                path_rows(act[r0:r1], (q[0][r0:r1], q[1][r0:r1], q[2][r0:r1]), (), rows, y, 0, j1 - j0, acc, integer)
                for r in range(r1 - r0):
                    pair = order[r0 + r]
                    w = weights[pair // k, pair % k]
                    dst = out[pair // k]
                    for c in range(j1 - j0):
                        dst[j0 + c] += w * y[r, c]


@numba.njit(cache=True, nogil=True, fastmath=True)
def _pair_inputs(x, pairs, k, xs, q, quantized, floats):
    """The gate/up inputs of a run of pairs: when quantized, each pair's input row quantized into
    q (the integer path; a row is quantized alike for every pair of its token); when floats, xs."""
    for r in range(pairs.shape[0]):
        i = pairs[r] // k
        if quantized:
            quant.quantize_activations(x[i : i + 1], q[0][r : r + 1], q[1][r : r + 1], q[2][r : r + 1])
        if floats:
            src, dst = x[i], xs[r]
            for c in range(dst.shape[0]):
                dst[c] = src[c]


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _experts_fused(x, experts, weights, stacks, out, work, integer):
    """Every routed expert's MLP for all tokens in parallel loops over W workers; see moe_experts.

    stacks: (gate, up, up0, down), up's rows starting at up0; work and integer: of fused_work.
    """
    order, offsets, active, xs, act, acc, tiles, codes, scales, sums = work
    n, k = experts.shape
    rows, (hidden, inter) = n * k, (x.shape[1], act.shape[1])
    xs, act = xs[:rows], act[:rows]
    gate, up, _, down = stacks
    count = _group(experts, order, offsets, active)
    # gate and up share their inputs: quantized if either takes them so, as floats if either does
    quantized = integer and (_on_integer(gate) or _on_integer(up))
    floats = not (integer and _on_integer(gate) and _on_integer(up))
    q = _area(codes, scales, sums, 0, rows, hidden)
    qa = _area(codes, scales, sums, rows * hidden, rows, inter)
    workers = acc.shape[0]
    for wk in prange(workers):
        r0, r1 = wk * rows // workers, (wk + 1) * rows // workers
        _pair_inputs(x, order[r0:r1], k, xs[r0:r1], (q[0][r0:r1], q[1][r0:r1], q[2][r0:r1]), quantized, floats)
    blocks = (inter + ROW_BLOCK - 1) // ROW_BLOCK
    for wk in prange(workers):
        c0, c1 = wk * blocks // workers * ROW_BLOCK, min(inter, (wk + 1) * blocks // workers * ROW_BLOCK)
        _gate_up_block(xs, q, stacks, offsets, active, count, act, c0, c1, acc[wk], tiles[wk], integer)
    if integer and _on_integer(down):
        for wk in prange(workers):
            r0, r1 = wk * rows // workers, (wk + 1) * rows // workers
            quant.quantize_activations(act[r0:r1], qa[0][r0:r1], qa[1][r0:r1], qa[2][r0:r1])
    blocks = (hidden + ROW_BLOCK - 1) // ROW_BLOCK
    for wk in prange(workers):
        c0, c1 = wk * blocks // workers * ROW_BLOCK, min(hidden, (wk + 1) * blocks // workers * ROW_BLOCK)
        _down_block(act, qa, down, order, offsets, active, count, weights, out, c0, c1, acc[wk], tiles[wk], integer)


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _block_fused(x, router, top_k, normalize, stacks, out, logits, weights, experts, work, integer):
    """moe_block in one compiled call: router logits, top-k, then _experts_fused."""
    num_experts = router.shape[0]
    for b in prange((num_experts + ROW_BLOCK - 1) // ROW_BLOCK):
        linear_rows(x, router, logits, b * ROW_BLOCK, min(num_experts, b * ROW_BLOCK + ROW_BLOCK))
    route(logits, top_k, normalize, weights, experts)
    _experts_fused(x, experts, weights, stacks, out, work, integer)


def _fused_stacks(gate_up, down, fmt, n, top_k, scratch):
    """(gate, up, up0, down) in kernel views for the fused kernels, or None when n tokens take the
    grouped path: float experts beyond FUSED_MAX_TOKENS tokens (whose many rows an expert's packed
    GEMM serves better)."""
    gate, up = gate_up if isinstance(gate_up, tuple) else (gate_up, gate_up)
    capacity = len(scratch.order) // top_k
    if n > (capacity if all(quant.is_blocks(w) for w in (gate, up, down)) else min(capacity, FUSED_MAX_TOKENS)):
        return None
    up0 = 0 if isinstance(gate_up, tuple) else scratch.act.shape[1]
    return kernel_view(gate, fmt), kernel_view(up, fmt), up0, kernel_view(down, fmt)


def _expert(gate_up, e):
    """Expert e's [2*I, h] gate_up matrix: one array, or (gate, up) when the stacks are separate."""
    return (gate_up[0][e], gate_up[1][e]) if isinstance(gate_up, tuple) else gate_up[e]


def moe_experts(x, experts, weights, gate_up, down, fmt, out, scratch):
    """out = sum over each token's experts of weight * down(silu(gate) * up).

    x: [n, h] float32; experts: [n, k] int64; weights: [n, k] float32; gate_up: [E, 2*I, h]
    storage (gate rows then up rows; or a tuple (gate, up) of [E, I, h] stacks, e.g. of two
    block formats) and down: [E, h, I] storage; block formats have [..., blocks] for the last
    axis (quant.py); out: [n, h] float32, overwritten; scratch: a MoeScratch for at least n
    tokens. Allocates nothing.
    """
    n, k = experts.shape
    stacks = _fused_stacks(gate_up, down, fmt, n, k, scratch)
    if stacks is not None:
        _experts_fused(x, experts, weights, stacks, out, *fused_work(scratch))
        return
    s = scratch
    paths = cpu.ENABLED - {"bf16"}  # decode's fused kernels sum in f32: no AMX tiles in prefill either
    count = _group(experts, s.order, s.offsets, s.active)
    out[:] = 0.0
    for t in range(count):
        e = s.active[t]
        pairs = s.order[s.offsets[e] : s.offsets[e + 1]]
        rows = pairs.shape[0]
        xs, gu, act, ys = s.xs[:rows], s.gate_up[:rows], s.act[:rows], s.ys[:rows]
        _gather(x, pairs, k, xs)
        matmul(xs, _expert(gate_up, e), fmt, gu, s.matmul, paths)
        silu_mul(gu, act)
        matmul(act, down[e], fmt, ys, s.matmul, paths)
        _scatter_add(ys, pairs, weights, out)


def moe_block(x, router, top_k, normalize, gate_up, down, fmt, out, logits, weights, experts, scratch):
    """The whole MoE block: out = moe_experts(x) with the experts and weights of route(x @ router.T).

    x: [n, h] float32; router: [E, h] float32; gate_up, down, out, scratch as in moe_experts;
    logits: [n, E], weights: [n, k] float32 and experts: [n, k] int64 receive the routing.
    One compiled call on block experts, and on float experts up to FUSED_MAX_TOKENS tokens;
    allocates nothing.
    """
    stacks = _fused_stacks(gate_up, down, fmt, x.shape[0], top_k, scratch)
    if stacks is not None:
        _block_fused(x, router, top_k, normalize, stacks, out, logits, weights, experts, *fused_work(scratch))
        return
    matmul(x, router, F32, logits, scratch.matmul)
    route(logits, top_k, normalize, weights, experts)
    moe_experts(x, experts, weights, gate_up, down, fmt, out, scratch)


def moe_block_ref(x, router, top_k, normalize, gate_up, down, fmt, out, logits, weights, experts, scratch):
    """numpy reference of moe_block."""
    matmul_ref(x, router, F32, logits, None)
    route_ref(logits, top_k, normalize, weights, experts)
    moe_experts_ref(x, experts, weights, gate_up, down, fmt, out, scratch)


def moe_experts_ref(x, experts, weights, gate_up, down, fmt, out, scratch):
    """numpy reference of moe_experts: expert by expert (blocks dequantized by gguf), token by token."""
    n, k = experts.shape
    out[:] = 0.0
    for e in np.unique(experts):
        parts = _expert(gate_up, e) if isinstance(gate_up, tuple) else (gate_up[e],)
        w_gu = np.concatenate([to_f32(part, fmt) for part in parts]).astype(np.float64)  # [2*I, h]
        w_down = to_f32(down[e], fmt).astype(np.float64)  # [h, I]
        for i, j in zip(*np.nonzero(experts == e)):
            gu = (x[i : i + 1].astype(np.float64) @ w_gu.T).astype(np.float32)
            act = np.empty((1, w_gu.shape[0] // 2), np.float32)
            silu_mul_ref(gu, act)
            out[i] += weights[i, j] * (act.astype(np.float64) @ w_down.T)[0].astype(np.float32)
