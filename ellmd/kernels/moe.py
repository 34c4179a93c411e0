"""Mixture-of-experts block of Qwen3-MoE: router top-k and the routed expert MLPs.

Shape legend:
  n   tokens
  E   experts; k experts per token (top_k)
  h   hidden size; I expert intermediate size

Experts run one at a time over the tokens routed to them (gathered into contiguous rows), so
each expert's weights are read once per call whatever the number of tokens, through the same
matmul as dense layers (decode kernel for few rows, BLAS for many).
"""

from typing import NamedTuple

import numba
import numpy as np

from ellmd.kernels.activations import silu_mul, silu_mul_ref
from ellmd.kernels.formats import to_f32
from ellmd.kernels.matmul import matmul, prefill_scratch_size


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
    xs: np.ndarray  # [n, h] float32: gathered inputs of one expert
    gate_up: np.ndarray  # [n, 2*I] float32
    act: np.ndarray  # [n, I] float32
    ys: np.ndarray  # [n, h] float32: one expert's outputs
    matmul: np.ndarray  # 1-D float32: matmul's prefill scratch


def moe_scratch(max_tokens, top_k, num_experts, hidden, inter):
    """Allocate the scratch of moe_experts for up to max_tokens tokens."""
    return MoeScratch(
        order=np.zeros(max_tokens * top_k, np.int64),
        offsets=np.zeros(num_experts + 1, np.int64),
        active=np.zeros(num_experts, np.int64),
        xs=np.zeros((max_tokens, hidden), np.float32),
        gate_up=np.zeros((max_tokens, 2 * inter), np.float32),
        act=np.zeros((max_tokens, inter), np.float32),
        ys=np.zeros((max_tokens, hidden), np.float32),
        matmul=np.zeros(
            max(prefill_scratch_size(2 * inter, hidden), prefill_scratch_size(hidden, inter)), np.float32
        ),
    )


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


def moe_experts(x, experts, weights, gate_up, down, fmt, out, scratch):
    """out = sum over each token's experts of weight * down(silu(gate) * up).

    x: [n, h] float32; experts: [n, k] int64; weights: [n, k] float32; gate_up: [E, 2*I, h]
    and down: [E, h, I] storage; out: [n, h] float32, overwritten; scratch: a MoeScratch for
    at least n tokens. Allocates nothing.
    """
    k = experts.shape[1]
    count = _group(experts, scratch.order, scratch.offsets, scratch.active)
    out[:] = 0.0
    for t in range(count):
        e = scratch.active[t]
        pairs = scratch.order[scratch.offsets[e] : scratch.offsets[e + 1]]
        rows = pairs.shape[0]
        xs, gu, act, ys = scratch.xs[:rows], scratch.gate_up[:rows], scratch.act[:rows], scratch.ys[:rows]
        _gather(x, pairs, k, xs)
        matmul(xs, gate_up[e], fmt, gu, scratch.matmul)
        silu_mul(gu, act)
        matmul(act, down[e], fmt, ys, scratch.matmul)
        _scatter_add(ys, pairs, weights, out)


def moe_experts_ref(x, experts, weights, gate_up, down, fmt, out, scratch):
    """numpy reference of moe_experts: token by token, expert by expert."""
    n, k = experts.shape
    inter = down.shape[2]
    out[:] = 0.0
    for i in range(n):
        for j in range(k):
            e = experts[i, j]
            gu = (x[i : i + 1].astype(np.float64) @ to_f32(gate_up[e], fmt).T).astype(np.float32)
            act = np.empty((1, inter), np.float32)
            silu_mul_ref(gu, act)
            out[i] += weights[i, j] * (act.astype(np.float64) @ to_f32(down[e], fmt).T)[0].astype(np.float32)
