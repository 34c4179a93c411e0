"""Causal attention over the resident KV cache: KV store, tiled prefill, segmented decode.

Shape legend:
  n      query tokens of one prefill chunk
  B      decode batch (one query token per row)
  H      query heads; kvh kv heads; g = H // kvh query heads per kv head (GQA group)
  hd     head_dim; hdp = hd rounded up to NR (tile.py)
  slots  KV slots; S sequence capacity of a slot
  KB     keys per tile (TILE_KEYS)
  R      query rows of a task: (query, head of the group) pairs, row r = qi * g + gi;
         Rp = R rounded up for the SIMD kernel (to 16 on AMX)
  segments  a row's keys in SEGMENT-key pieces (decode's partial softmaxes, one per segment)
  KA, RB keys per tile and query rows per softmax block of the AMX path (AMX_KEYS, AMX_BLOCK)

Both kernels are flash attention: keys are visited in tiles with an online softmax (running
max, running sum, rescaled accumulator), and no n x n matrix is ever built. Any head_dim: the KV
layout stays exactly [..., hd] whatever hd.

One arithmetic per token (the f32 kernels): decode computes each row exactly as prefill computes
the same query, so a token's numbers do not depend on the chunk, batch or step that ran it. A
row's keys are cut into segments of SEGMENT keys at fixed positions; within a segment, tiles of
KB keys from the segment's start: scores in decode's dot-product order (matmul.linear_rows on a
few rows, the packed GEMM of gemm.py on many: the same sums), the softmax step along the rows and
sequential over the keys (_tile_step: a key a row does not see gets probability 0, which adds
nothing), values on the SIMD kernel of tile.py (a sum over the tile's keys, then added); then the
row's segments are merged in order (_fold_row) and divided by the sum. Decode shares (row,
segment, kv head) tasks among the threads; prefill walks a task's segments in order, or, for a
chunk with too few tasks for the threads, shares its segments too.
Storage: see formats.py (f16 is viewed as int16 inside kernels). KV in q8_0 blocks is read as
stored (kv_blocks.py: integer scores, values summed from their codes), q4_0 blocks converted a
tile at a time; either way in prefill as in decode.

bf16 KV on the "bf16" path (cpu.py, AMX), in prefill and decode alike: a segment's partial softmax
comes from AMX tiles instead of the f32 kernels, in the same frame (segments at fixed positions,
folded in order by the same code). Its queries are packed once (scaled, as hi + lo bf16 halves: a
single bf16 raised the median logit error by a fifth on 1,100-token prefill), then its keys are
visited in tiles of KA from the segment's start, each packed once (keys as rows, read in place when
they fill whole tiles; values interleaved by pairs of keys, bf16.pair_keys) for all its rows, in
blocks of up to RB rows: scores^T [KA, RB] = keys . queries^T (bf16.tile_product), the online
softmax along the rows in f32, probabilities rounded to bf16 (as flash attention does; no change
in the logit error measured), turned to rows (bf16.transpose_words) and acc [R, hdp] += p . values.
A row is a column of the score tiles, a lane of the softmax and a row of the value tiles, so its
numbers are its own: a decode step's g rows (padded to 16) get the bits prefill gives the same
query. f16 and f32 KV, kept for their precision, take the f32 kernels. Loops
index from 0 over views: an index that may be negative, like range(lo, n), makes numba emit
wraparound checks that stop LLVM from vectorizing.
"""

import numba
import numpy as np
from numba import prange, types
from numba.extending import overload

from ellmd.kernels import bf16, dpbf16, gemm, kv_blocks
from ellmd.kernels.activations import FASTMATH_DIVIDES, exp_f32
from ellmd.kernels.aligned import line_start
from ellmd.kernels.formats import BF16, _bitcast_f32, _bitcast_u32, decode, encode, kernel_view, to_f32, to_storage
from ellmd.kernels.matmul import linear_rows
from ellmd.kernels.quant_int import key_scores, value_sums
from ellmd.kernels.tile import MR, NR, TALL_MR, gemm_tile

# KB, a multiple of NR dividing SEGMENT. Each tile pays fixed costs (the kernels' set-up, the running
# max, the rescaling of acc): at 64 keys they took a fifth of a decode step at 8k and a third of an
# append there (Xeon model 207, 1 thread: decode 1.1-1.3x faster at 256, a 256-token append at 7,936
# 1.3-1.55x; 512 no better, and its tiles no longer sit in L2 beside the task's other scratch)
TILE_KEYS = 256
TASK_ROWS = 144  # R target of a prefill task: query block = TASK_ROWS // g queries
# Below this many (kv head, query block) units per thread, prefill shares the segments of every
# unit among the threads (merged in order as decode merges them): a short chunk has as few units
# as kv heads, and 3 units on 2 threads leave one thread idle a third of the time. (The AMX path
# splits keys into one share per thread.)
SPLIT_UNITS = 4
# Below this many (key, kv head) pairs a decode step runs on the calling thread (launching the
# parallel region costs more than it saves). A step's keys come cold from memory, after the
# layer's weights: SmolLM2's 3 kv heads x 512 keys took 0.82 ms over 30 layers on one thread,
# 0.53 on two (Zen 5, bf16 KV on vdpbf16ps).
DECODE_PARALLEL_MIN = 512
# Running max before any key: finite, because fastmath assumes no infinities.
_NO_MAX = np.float32(-1e30)


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def _round_up(x, m):
    return (x + m - 1) // m * m


@numba.njit(cache=True, nogil=True, fastmath=True)
def _store(k_new, v_new, k_layer, v_layer, key_mean, slots, positions):
    """store_kv on kernel views: values converted, or rows quantized into blocks (kv_blocks.py)."""
    _store_any(k_new, v_new, k_layer, v_layer, key_mean, slots, positions)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _store_values(k_new, v_new, k_layer, v_layer, key_mean, slots, positions):
    # key_mean: only q4_0 keys are centred (kv_blocks.centred_keys), never keys held as values
    # serial: a few values per token, memory-bound
    for i in range(k_new.shape[0]):
        for h in range(k_new.shape[1]):
            kd = k_layer[slots[i], h, positions[i]]
            vd = v_layer[slots[i], h, positions[i]]
            for d in range(kd.shape[0]):
                kd[d] = encode(k_new[i, h, d], kd)
                vd[d] = encode(v_new[i, h, d], vd)


def store_kv(k_new, v_new, k_layer, v_layer, fmt, slots, positions, key_mean=None):
    """Write each token's keys and values into the cache at (slot, head, position).

    k_new, v_new: [n, kvh, hd] float32; k_layer, v_layer: [slots, kvh, S, hd] storage;
    slots, positions: [n] int64; key_mean: [kvh, hd] float32 subtracted from q4_0 keys
    (kv_blocks.store_blocks), or None.
    """
    if key_mean is None:
        key_mean = np.zeros((0, k_new.shape[-1]), np.float32)
    _store(k_new, v_new, kernel_view(k_layer, fmt), kernel_view(v_layer, fmt), key_mean, slots, positions)


def store_kv_ref(k_new, v_new, k_layer, v_layer, fmt, slots, positions):
    """numpy reference of store_kv (the same rounding: to_storage)."""
    for i in range(k_new.shape[0]):
        k_layer[slots[i], :, positions[i]] = to_storage(k_new[i], fmt)
        v_layer[slots[i], :, positions[i]] = to_storage(v_new[i], fmt)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _load_values(head, k0, nk, dst):
    """dst[:nk, :hd] = positions k0..k0+nk of one head as float32.

    head: [S, hd] storage; dst: [KB, >=hd] float32.
    """
    hd = head.shape[1]
    for j in range(nk):
        src = head[k0 + j]
        row = dst[j]
        for d in range(hd):
            row[d] = decode(src[d])


@numba.njit(cache=True, nogil=True, fastmath=True)
def _max_into(src, s, dst):
    """dst = max(src, s) elementwise, into another array: an in-place running max compiles
    to masked stores, which are slow on AMD."""
    for r in range(dst.shape[0]):
        dst[r] = max(src[r], s[r])


@numba.njit(cache=True, nogil=True, fastmath=True)
def _exp_into(s, m, total):
    """s = exp(s - m), total += s, elementwise."""
    for r in range(s.shape[0]):
        e = exp_f32(s[r] - m[r])
        s[r] = e
        total[r] += e


# Every row's keys are cut into segments of SEGMENT keys at fixed positions (0, SEGMENT, ...): a
# segment's partial softmax starts afresh, and a row's segments are merged in order (_fold_row).
# Decode shares a long row's segments among the threads; prefill walks them in one task or, for a
# short chunk, shares them too: the same sums either way (one arithmetic per token).
SEGMENT = 1024
FEW_ROWS = 8  # up to this many query rows, scores come from decode's kernel on the stored keys


def _tile_scores(qs, qc, qd, k_head, t0, nk, rows, st, kt, panel):
    """st[j, r] = qs[r] . key t0 + j for r < rows and j < nk, as decode computes it: q8_0 keys on
    integer dot products (quant_int.key_scores, queries quantized in qc, qd); other keys in decode's
    order of float sums (gemm.py): on a few rows, decode's kernel on the stored keys; on more, the
    keys packed to float32 once for all rows. qs: [>= rows, hd] float32 C-contiguous; k_head: [S, hd]
    storage or [S, nb] blocks; st: [KBp, Rp]; kt: [KB, hdp] float32 (keys in q4_0 blocks converted);
    panel: 1-D float32 of gemm.PANEL * hd (unused on a few rows)."""
    raise NotImplementedError("numba only")


@overload(_tile_scores, jit_options={"nogil": True, "fastmath": True})
def _tile_scores_overload(qs, qc, qd, k_head, t0, nk, rows, st, kt, panel):
    if kv_blocks.read_as_stored(k_head):
        return lambda qs, qc, qd, k_head, t0, nk, rows, st, kt, panel: key_scores(qc, qd, k_head, t0, nk, rows,
                                                                                    st[:nk, :rows].T)
    return lambda qs, qc, qd, k_head, t0, nk, rows, st, kt, panel: _float_scores(qs, k_head, t0, nk, rows, st, kt,
                                                                                   panel)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _float_scores(qs, k_head, t0, nk, rows, st, kt, panel):
    """_tile_scores of keys in float storage or converted blocks."""
    out = st[:nk, :rows].T
    stored, o = _tile_rows(k_head, t0, nk, kt)
    keys = stored[o : o + nk]
    if rows <= FEW_ROWS:
        linear_rows(qs[:rows], keys, out, 0, nk)
        return
    for j0 in range(0, nk, gemm.PANEL):
        gemm.pack(keys, j0, panel)
        gemm.panel_product(qs[:rows], panel, out, j0, nk)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _tile_step(st, values, rows, nk, limit, g, m, l, acc, m_new, alpha, total):
    """One online-softmax step of a task's query rows over a tile of nk keys whose scores are in st.

    Works on transposed scores so that every softmax loop runs along the rows, elementwise, and
    over the keys in order: a row's numbers do not depend on the rows beside it. Key j of the tile
    is seen by rows r with r // g >= j - limit; the hidden ones get probability 0, which adds
    nothing to the values' sums. st: [KBp, Rp] (columns past rows zero); values: [nk, hdv] storage
    or float32, hdv a multiple of NR; m, l: [Rp] running max and sum; acc: [Rp, hdv];
    m_new, alpha, total: [Rp] scratch.
    """
    # new running max, ping-ponging between alpha and m_new so that it ends in m_new
    src = m
    for j in range(nk):
        lo = min(rows, max(0, (j - limit) * g))
        dst = m_new if (nk - j) % 2 == 1 else alpha
        for r in range(lo):
            dst[r] = src[r]
        _max_into(src[lo:rows], st[j, lo:rows], dst[lo:rows])
        src = dst
    for r in range(rows):
        alpha[r] = exp_f32(m[r] - m_new[r])
        total[r] = np.float32(0.0)
    for j in range(nk):
        lo = min(rows, max(0, (j - limit) * g))
        s = st[j]
        for r in range(lo):
            s[r] = np.float32(0.0)
        _exp_into(st[j, lo:rows], m_new[lo:rows], total[lo:rows])
    for r in range(rows):
        m[r] = m_new[r]
        l[r] = l[r] * alpha[r] + total[r]
        a = acc[r]
        for d in range(a.shape[0]):
            a[d] *= alpha[r]
    # acc[r, d] += sum_j st[j, r] * v[j, d]: st read transposed in place
    _add_values(st, True, values, acc, rows, nk)


@numba.njit(cache=True, nogil=True, fastmath={"nnan", "ninf", "nsz", "contract", "afn"})
def _sums_in_order(sr, rows, nk, total):
    """total[r] = sr[r, 0] + sr[r, 1] + ... from 0, one add after the other (no reassociation:
    _tile_step's order), the rows' chains side by side."""
    for r in range(rows):
        total[r] = np.float32(0.0)
    for j in range(nk):
        for r in range(rows):
            total[r] += sr[r, j]


@numba.njit(cache=True, nogil=True, fastmath=True)
def _row_step(sr, values, rows, nk, m, l, acc, alpha, total):
    """_tile_step's arithmetic for rows that see every key of the tile (decode), row by row, the
    exponentials vectorized along the keys: sr: [Rp, KB] scores, rows in order (rows past `rows`
    finite); values, m, l, acc, alpha, total as in _tile_step."""
    for r in range(rows):
        s = sr[r, :nk]
        mx = m[r]
        for j in range(nk):
            mx = max(mx, s[j])
        alpha[r] = exp_f32(m[r] - mx)
        for j in range(nk):
            s[j] = exp_f32(s[j] - mx)
        m[r] = mx
    _sums_in_order(sr, rows, nk, total)
    for r in range(rows):
        l[r] = l[r] * alpha[r] + total[r]
        a = acc[r]
        for d in range(a.shape[0]):
            a[d] *= alpha[r]
    _add_values(sr, False, values, acc, rows, nk)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _decode_tile(qs, qc, qd, k_head, values, t0, nk, rows, st, m, l, acc, alpha, total, kt):
    """A decode task's tile: scores [Rp, KB] (_decode_scores) and _row_step on values [nk, hdv]
    (float, hdv a multiple of NR, or q8_0 blocks)."""
    sr = st.reshape((acc.shape[0], TILE_KEYS))
    _decode_scores(qs, qc, qd, k_head, t0, nk, rows, sr, kt)
    _row_step(sr, values, rows, nk, m, l, acc, alpha, total)


def _decode_scores(qs, qc, qd, k_head, t0, nk, rows, sr, kt):
    """sr[r, j] = qs[r] . key t0 + j (sr: [Rp, KB]): q8_0 keys as _tile_scores scores them; float
    keys with rows in 4s where that shares the key loads (their sums do not change)."""
    raise NotImplementedError("numba only")


@overload(_decode_scores, jit_options={"nogil": True, "fastmath": True})
def _decode_scores_overload(qs, qc, qd, k_head, t0, nk, rows, sr, kt):
    if kv_blocks.read_as_stored(k_head):
        return lambda qs, qc, qd, k_head, t0, nk, rows, sr, kt: key_scores(qc, qd, k_head, t0, nk, rows, sr)

    def impl(qs, qc, qd, k_head, t0, nk, rows, sr, kt):
        stored, o = _tile_rows(k_head, t0, nk, kt)
        score_rows = rows if rows < 3 else min(_round_up(rows, 4), sr.shape[0])
        linear_rows(qs[:score_rows], stored[o : o + nk], sr[:score_rows, :nk], 0, nk)

    return impl


@numba.njit(cache=True, nogil=True, fastmath=True)
def _tile(qs, qc, qd, k_head, values, t0, nk, limit, g, rows, st, m, l, acc, m_new, alpha, total, kt, panel,
          every_key):
    """One tile of _segment: keys t0..t0+nk with their values [nk, hdv] (hdv a multiple of NR)."""
    if every_key:  # decode: every row sees every key
        _decode_tile(qs, qc, qd, k_head, values, t0, nk, rows, st, m, l, acc, alpha, total, kt)
    else:
        _tile_scores(qs, qc, qd, k_head, t0, nk, rows, st, kt, panel)
        _tile_step(st, values, rows, nk, limit - t0, g, m, l, acc, m_new, alpha, total)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _segment(qs, qc, qd, k_head, v_head, t_lo, t_hi, limit, g, rows, st, m, l, acc, m_new, alpha, total, kt, vt,
             panel, every_key=False):
    """The partial softmax m, l: [Rp] and acc: [Rp, hdv] of `rows` query rows over keys [t_lo, t_hi)
    (one segment), from a fresh start; row r sees key t when r // g >= t - limit.

    qs: [Rp, hd] pre-scaled queries (rotated for rotated blocks: _rotate_rows), and for q8_0 keys
    their int16 codes qc [Rp, hd] and scales qd [Rp, >= nb] (kv_blocks.quantize_queries); k_head,
    v_head: [S, hd] storage or [S, nb] blocks; st: [KBp, Rp]; kt, vt: [KB, hdp] float32 tiles:
    q4_0 keys and block values converted (_tile_rows), or values copied to float32 (_as_float_tile:
    padded when hd is not a multiple of NR, hdv = hdp), else values read as stored (hdv = hd);
    panel: _tile_scores' scratch.
    """
    m[:] = _NO_MAX
    l[:] = np.float32(0.0)
    acc[:] = np.float32(0.0)
    for t0 in range(t_lo, t_hi, TILE_KEYS):
        nk = min(TILE_KEYS, t_hi - t0)
        values, o = _tile_rows(v_head, t0, nk, vt)  # as stored, or blocks converted
        if _as_float_tile(values, rows):  # for the SIMD kernel
            _load_rows(values, o, nk, vt)
            _tile(qs, qc, qd, k_head, vt[:nk], t0, nk, limit, g, rows, st, m, l, acc, m_new, alpha, total, kt, panel,
                  every_key)
        else:
            _tile(qs, qc, qd, k_head, values[o : o + nk], t0, nk, limit, g, rows, st, m, l, acc, m_new, alpha, total,
                  kt, panel, every_key)
    _rotate_rows(v_head, acc, rows)  # rotated value blocks: their sums back to the model's basis


@numba.njit(cache=True, nogil=True, fastmath=True)
def _fold_row(state_m, state_l, o, m, l, acc):
    """Merge one segment's partial softmax (m, l, acc: [hd]) into a row's running one (state_m,
    state_l, o: [hd], updated in place), segments in order; returns the new (state_m, state_l).
    A row starts at (_NO_MAX, 0, zeros)."""
    mx = max(state_m, m)
    a = exp_f32(state_m - mx)
    b = exp_f32(m - mx)
    for d in range(o.shape[0]):
        o[d] = o[d] * a + acc[d] * b
    return mx, state_l * a + l * b


@numba.njit(cache=True, nogil=True, fastmath=FASTMATH_DIVIDES)
def _normalize(o, total, dst):
    """dst = o / total, as o * (1 / total) in every caller (no reciprocal rewrites: FASTMATH_DIVIDES)."""
    inv = np.float32(1.0) / total
    for d in range(dst.shape[0]):
        dst[d] = o[d] * inv


@numba.njit(cache=True, nogil=True, fastmath=True)
def _segments(length):
    return (length + SEGMENT - 1) // SEGMENT


# ---- prefill on the f32 kernels ------------------------------------------------------------


@numba.njit(cache=True, nogil=True, fastmath=True)
def _task_buffers(rows, hd):
    """A prefill task's arrays: qs [Rp, hd], st [KBp, Rp], acc [Rp, hdp], m, l, m_new, alpha, total
    [Rp], kt, vt [KB, hdp], panel [gemm.PANEL * hd], qc [Rp, hd] int16, qd [Rp, hd / 32] (Rp: rows
    rounded up to TALL_MR)."""
    rows_p = _round_up(rows, TALL_MR)
    hdp = _round_up(hd, NR)
    return (np.zeros((rows_p, hd), np.float32), np.zeros((TILE_KEYS, rows_p), np.float32),
            np.zeros((rows_p, hdp), np.float32), np.empty(rows_p, np.float32), np.empty(rows_p, np.float32),
            np.empty(rows_p, np.float32), np.empty(rows_p, np.float32), np.empty(rows_p, np.float32),
            np.zeros((TILE_KEYS, hdp), np.float32), np.zeros((TILE_KEYS, hdp), np.float32),
            np.empty(gemm.PANEL * hd, np.float32), np.zeros((rows_p, hd), np.int16),
            np.zeros((rows_p, _query_blocks(hd)), np.float32))


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def _query_blocks(hd):
    """Columns of qd: the most key blocks a row of head_dim hd has (blocks of 32 or 64 values)."""
    return max(1, hd // 32)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _unit_partial(q, k_slot, v_slot, start, scale, h, q0, nq, seg, bufs, bf16_bufs, bf16_path):
    """The partial softmax of segment seg for queries q0..q0+nq of the g heads of kv head h (row
    r = qi * g + gi) into bufs' m, l, acc (bufs: _task_buffers, its qs filled by _fill_queries; on
    bf16 KV, bf16_bufs: _bf16_buffers, its queries packed by _pack_bf16_queries)."""
    qs, st, acc, m, l, m_new, alpha, total, kt, vt, panel, qc, qd = bufs
    g = q.shape[1] // k_slot.shape[0]
    t_lo = seg * SEGMENT
    t_hi = min(start + q0 + nq, t_lo + SEGMENT)  # the unit's last query sees keys up to start + q0 + nq - 1
    if bf16_path:
        _bf16_partial(k_slot[h], v_slot[h], t_lo, t_hi, start + q0, g, nq * g, bf16_bufs, m, l, acc, bf16_path)
    else:
        _segment(qs, qc, qd, k_slot[h], v_slot[h], t_lo, t_hi, start + q0, g, nq * g, st, m, l, acc, m_new, alpha,
                 total, kt, vt, panel)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _unit_queries(q, h, g, q0, nq, scale, k_head, bufs, bf16_path):
    """A unit's queries into its buffers (bufs from _task_buffers and the bf16 ones from
    _bf16_buffers, filled for the path the unit takes) and the bf16 buffers."""
    qs, qc, qd = bufs[0], bufs[11], bufs[12]
    if bf16_path:
        area = line_start(np.zeros(bf16_floats(nq * g, q.shape[2], bf16_path) + 16, np.float32))  # rows on lines
        bf16_bufs = _bf16_buffers(area, nq * g, q.shape[2], bf16_path)
        _pack_bf16_queries(q, h, g, q0, nq, scale, bf16_bufs, bf16_path)
    else:  # views of nothing: the f32 path neither reads them nor pays for an area
        bf16_bufs = _amx_buffers(np.zeros(0, np.float32), 0, 0)
        _fill_queries(q, h, g, q0, nq, scale, k_head, qs, qc, qd)
    return bf16_bufs


@numba.njit(cache=True, nogil=True, fastmath=True)
def _fill_queries(q, h, g, q0, nq, scale, k_head, qs, qc, qd):
    """qs[qi * g + gi] = q[q0 + qi, h * g + gi] * scale, rotated as k_head's keys are (the rows
    past nq * g stay as they are); for q8_0 keys, quantized into qc, qd (kv_blocks.quantize_queries)."""
    for qi in range(nq):
        for gi in range(g):
            src, dst = q[q0 + qi, h * g + gi], qs[qi * g + gi]
            for d in range(src.shape[0]):
                dst[d] = src[d] * np.float32(scale)
    _rotate_rows(k_head, qs, nq * g)
    kv_blocks.quantize_queries(k_head, qs, nq * g, qc, qd)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _write_rows(state_m, state_l, o, h, g, q0, nq, out):
    """out rows of the unit = its rows' merged softmax (o: [Rp, >= hd])."""
    hd = out.shape[2]
    for qi in range(nq):
        for gi in range(g):
            r = qi * g + gi
            _normalize(o[r, :hd], state_l[r], out[q0 + qi, h * g + gi])


@numba.njit(cache=True, nogil=True, fastmath=True)
def _prefill_unit(q, k_slot, v_slot, start, scale, h, q0, nq, out, bf16_path):
    """Queries q0..q0+nq of kv head h over all their keys, segment after segment, into out."""
    g, hd = q.shape[1] // k_slot.shape[0], q.shape[2]
    rows = nq * g
    bufs = _task_buffers(rows, hd)
    bf16_bufs = _unit_queries(q, h, g, q0, nq, scale, k_slot[h], bufs, bf16_path)
    acc, m, l = bufs[2], bufs[3], bufs[4]
    state_m = np.full(rows, _NO_MAX, np.float32)
    state_l = np.zeros(rows, np.float32)
    o = np.zeros((rows, hd), np.float32)
    for seg in range(_segments(start + q0 + nq)):
        _unit_partial(q, k_slot, v_slot, start, scale, h, q0, nq, seg, bufs, bf16_bufs, bf16_path)
        for r in range(rows):
            state_m[r], state_l[r] = _fold_row(state_m[r], state_l[r], o[r], m[r], l[r], acc[r, :hd])
    _write_rows(state_m, state_l, o, h, g, q0, nq, out)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _unit_bounds(u, n, qb, nqb):
    """(kv head, first query, queries) of unit u, blocks ordered short, long, short, ...: the
    contiguous unit ranges the threads receive carry equal causal work."""
    h, t = u // nqb, u % nqb
    b = t // 2 if t % 2 == 0 else nqb - 1 - t // 2
    q0 = b * qb
    return h, q0, min(n, q0 + qb) - q0


@numba.njit(cache=True, nogil=True, fastmath=False)
def _task_queries(n, kvh, g, threads):
    """(queries per block, blocks) of a chunk of n queries: blocks of about TASK_ROWS // g queries,
    made a little smaller where that makes the units (kv heads x blocks) a multiple of the threads,
    which then receive equal shares (SmolLM2's 3 kv heads and a 240-token turn: 18 units, not 15
    split 8 / 7). A query's numbers do not depend on its block."""
    qb = max(1, TASK_ROWS // g)
    nqb = (n + qb - 1) // qb
    more = nqb
    while (kvh * more) % threads != 0 and more < min(n, 2 * nqb):
        more += 1
    fine = (n + more - 1) // more
    if more > nqb and (kvh * more) % threads == 0 and (n + fine - 1) // fine == more:
        return fine, more
    return qb, nqb


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _prefill(q, k_slot, v_slot, start, scale, out, threads, bf16_path):
    n, heads, hd = q.shape
    kvh = k_slot.shape[0]
    g = heads // kvh
    qb, nqb = _task_queries(n, kvh, g, threads)
    units = kvh * nqb  # (kv head, query block)
    if units >= SPLIT_UNITS * threads:
        for u in prange(units):
            h, q0, nq = _unit_bounds(u, n, qb, nqb)
            _prefill_unit(q, k_slot, v_slot, start, scale, h, q0, nq, out, bf16_path)
        return
    # a short chunk: its units' segments are shared among the threads, then merged in order
    nseg = _segments(start + n)
    rows_p = _round_up(min(n, qb) * g, TALL_MR)
    pm = np.full((units, nseg, rows_p), _NO_MAX, np.float32)
    pl = np.zeros((units, nseg, rows_p), np.float32)
    pacc = np.zeros((units, nseg, rows_p, hd), np.float32)
    for task in prange(units * nseg):  # segment-major: the threads' contiguous ranges mix long and short
        seg, u = task // units, task % units
        h, q0, nq = _unit_bounds(u, n, qb, nqb)
        if seg >= _segments(start + q0 + nq):
            continue  # past the unit's keys: the fold below skips it too
        bufs = _task_buffers(nq * g, hd)
        bf16_bufs = _unit_queries(q, h, g, q0, nq, scale, k_slot[h], bufs, bf16_path)
        _unit_partial(q, k_slot, v_slot, start, scale, h, q0, nq, seg, bufs, bf16_bufs, bf16_path)
        rows = nq * g
        pm[u, seg, :rows] = bufs[3][:rows]
        pl[u, seg, :rows] = bufs[4][:rows]
        pacc[u, seg, :rows] = bufs[2][:rows, :hd]
    for u in prange(units):
        h, q0, nq = _unit_bounds(u, n, qb, nqb)
        rows = nq * g
        state_m = np.full(rows, _NO_MAX, np.float32)
        state_l = np.zeros(rows, np.float32)
        o = np.zeros((rows, hd), np.float32)
        for seg in range(_segments(start + q0 + nq)):
            for r in range(rows):
                state_m[r], state_l[r] = _fold_row(state_m[r], state_l[r], o[r], pm[u, seg, r], pl[u, seg, r],
                                                   pacc[u, seg, r])
        _write_rows(state_m, state_l, o, h, g, q0, nq, out)


# ---- bf16 KV on AMX (tdpbf16ps): a segment's partial softmax, in prefill and decode ---------

AMX_KEYS = 64  # KA: keys per tile of the AMX path
AMX_BLOCK = 128  # RB: query rows of one softmax pass (its scores [KA, RB] stay in L1)
_MASKED = np.float32(-3e30)  # a hidden score: below _NO_MAX, so exp(_MASKED - m) is 0 even for m = _NO_MAX
# The reference max m of a row moves only when a score exceeds it by this much (so the
# accumulator's rescaling is rare); probabilities are then up to e**_SLACK, well within range.
_SLACK = np.float32(8.0)
# st = keys . (hi + lo) queries and acc += bf16 probabilities . values, on 32 rows of queries and on
# 16 (a decode step's few rows, a block's last 16; its values on 4 or 2 accumulators of 16
# dimensions, whose chains hide the latency of tdpbf16ps): a row's sums are the same in either
_scores = bf16.tile_product(2, 2, 2, False)
_scores_16 = bf16.tile_product(2, 1, 2, False)
_values = bf16.tile_product(2, 2, 1, True)
_values_16 = bf16.tile_product(1, 4, 1, True)
_values_16_32 = bf16.tile_product(1, 2, 1, True)


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def _bf16_bits(x):
    """Round-to-nearest-even bf16 of a finite float32, in the top half of a uint32 (low half 0)."""
    b = _bitcast_u32(x)
    return (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _pack_queries(q, h, g, q0, nq, scale, qh, ql):
    """qh, ql: [hdp // 2, Rp] uint32 pairs (d = 2p, 2p + 1) of hi and lo of the scaled queries,
    column r = qi * g + gi; zero past hd and past the task's rows."""
    hd = q.shape[2]
    qh[:] = 0
    ql[:] = 0
    for qi in range(nq):
        for gi in range(g):
            row = q[q0 + qi, h * g + gi]
            r = qi * g + gi
            for p in range(hd // 2):
                x0, x1 = row[2 * p] * np.float32(scale), row[2 * p + 1] * np.float32(scale)
                h0, h1 = _bf16_bits(x0), _bf16_bits(x1)
                l0 = _bf16_bits(x0 - _bitcast_f32(h0))
                l1 = _bf16_bits(x1 - _bitcast_f32(h1))
                qh[p, r] = (h0 >> np.uint32(16)) | h1
                ql[p, r] = (l0 >> np.uint32(16)) | l1


@numba.njit(cache=True, nogil=True, fastmath=True)
def _pack_tile(k_head, v_head, t0, nk, kt, vp):
    """The tile's operands: (keys, k0), its keys as rows k0.. of keys (the A operand of the scores:
    k_head itself for a whole tile whose rows fill whole tiles, hd % 32 == 0; else kt[:nk, :hd],
    rows past nk keeping finite old values, whose scores are masked); vp = their values by pairs
    of keys (the B operand of the values product, bf16.pair_keys; keys past nk repeat the last)."""
    bf16.pair_keys(v_head, t0, nk, vp)
    hd = k_head.shape[1]
    if nk == AMX_KEYS and hd % 32 == 0:
        return k_head, t0
    for j in range(nk):
        src = k_head[t0 + j]
        dst = kt[j]
        for d in range(hd):
            dst[d] = src[d]
    return kt, 0


@numba.njit(cache=True, nogil=True, fastmath=True)
def _mask(st, nk, r0, cols, base, g):
    """Hide tile key j from row r0 + c unless j < nk and j <= base + (r0 + c) // g, i.e. from
    the columns c < (j - base) * g - r0 (a prefix of each row: no division per element)."""
    for j in range(st.shape[0]):
        s = st[j]
        hidden = cols if j >= nk else min(cols, max(0, (j - base) * g - r0))
        for c in range(hidden):
            s[c] = _MASKED


@numba.njit(cache=True, nogil=True, fastmath=True)
def _softmax_block(st, r0, cols, m, l, acc, pt, scratch):
    """Online softmax of rows r0..r0+cols over a tile: st: [KA, RB] scores; m, l: [Rp];
    acc: [Rp, hdp]; pt: [KA // 2, RB] uint32, the bf16 probabilities of keys 2p and 2p + 1 by
    column; scratch: [3, RB]. l sums the very bf16 weights the values
    product uses, so the output is their exact weighted mean (a constant value stays constant)."""
    m_new, alpha, total = scratch[0], scratch[1], scratch[2]
    bf16.column_max(st, m, r0, m_new, cols)
    mv, lv = m[r0 : r0 + cols], l[r0 : r0 + cols]
    scale = False
    for c in range(cols):  # the reference max moves only when a score passes it by _SLACK
        grow = m_new[c] > mv[c] + _SLACK
        mc = m_new[c] if grow else mv[c]
        alpha[c] = exp_f32(mv[c] - mc)
        scale |= grow
        mv[c] = mc
        m_new[c] = mc
    bf16.exp_pairs(st, m_new, total, pt, cols)
    for c in range(cols):
        lv[c] = lv[c] * alpha[c] + total[c]
    if scale:
        for c in range(cols):
            a = acc[r0 + c]
            for d in range(a.shape[0]):
                a[d] *= alpha[c]


@numba.njit(cache=True, nogil=True, fastmath=True)
def _amx_rows(keys, k0, vp, qh, ql, st, pt, pr, acc, m, l, r0, cols, nk, base, g, scratch):
    """Rows r0..r0+cols of a task (r0, cols multiples of 16) over one tile of keys: scores,
    softmax, values. Row r sees tile key j while j <= base + r // g; keys, k0, vp: the tile's
    operands (_pack_tile); pt: [KA // 2, RB] uint32, the probabilities by column (exp_pairs); pr:
    [RB, KA] uint16, the same by row (the A operand of the values); scratch: [3, RB] float32."""
    hdp = vp.shape[1] // 2
    wide = cols // 32 * 32
    for j in range(0, AMX_KEYS, 32):
        for c in range(0, wide, 32):
            _scores(keys, k0 + j, 0, qh, ql, 0, r0 + c, st, j, c, hdp // 2)
        if wide < cols:
            _scores_16(keys, k0 + j, 0, qh, ql, 0, r0 + wide, st, j, wide, hdp // 2)
    if nk < AMX_KEYS or base + r0 // g < AMX_KEYS - 1:  # the diagonal or the last tile
        _mask(st, nk, r0, cols, base, g)
    _softmax_block(st, r0, cols, m, l, acc, pt, scratch)
    bf16.transpose_words(pt, pr.view(np.uint32), 0, 0, pt.shape[0], cols)
    for c in range(0, wide, 32):
        for d in range(0, hdp, 32):
            _values(pr, c, 0, vp, vp, 0, d, acc, r0 + c, d, AMX_KEYS // 2)
    if wide < cols:
        for d in range(0, hdp // 64 * 64, 64):
            _values_16(pr, wide, 0, vp, vp, 0, d, acc, r0 + wide, d, AMX_KEYS // 2)
        if hdp % 64:
            _values_16_32(pr, wide, 0, vp, vp, 0, hdp - 32, acc, r0 + wide, hdp - 32, AMX_KEYS // 2)


@numba.njit(cache=True, nogil=True, fastmath=False)
def amx_floats(rows, hd):
    """float32 elements of _amx_buffers' area for `rows` query rows of head_dim hd."""
    rows_p, hdp = _round_up(rows, 16), _round_up(hd, 32)
    rb = min(AMX_BLOCK, rows_p)
    return 2 * hdp * rows_p + AMX_KEYS * hdp + AMX_KEYS * rb + AMX_KEYS * rb + 3 * rb + 2 * rows_p


@numba.njit(cache=True, nogil=True, fastmath=True)
def _amx_buffers(area, rows, hd):
    """An AMX task's arrays, views of area (1-D float32, amx_floats(rows, hd) elements): qh, ql
    [hdp // 2, Rp] uint32 (the queries' halves, _pack_queries) and their uint16 views [hdp // 2,
    2 Rp]; kt [KA, hdp] and vp [KA // 2, 2 hdp] uint16 (_pack_tile; past hd zeroed, as kt meets
    the queries' zero padding and vp's sums past hd must stay finite); st [KA, RB]; pt [KA // 2, RB]
    uint32; pr [RB, KA] uint16; scratch [3, RB]; m, l [Rp]; acc [Rp, hdp] (Rp: rows rounded up to
    16, RB: Rp up to AMX_BLOCK)."""
    rows_p, hdp = _round_up(rows, 16), _round_up(hd, 32)
    rb = min(AMX_BLOCK, rows_p)
    o = 0
    half = hdp // 2 * rows_p
    qh, ql = area[o : o + half].view(np.uint32), area[o + half : o + 2 * half].view(np.uint32)
    o += 2 * half
    kv = area[o : o + AMX_KEYS * hdp].view(np.uint16)
    o += AMX_KEYS * hdp
    kt = kv[: AMX_KEYS * hdp].reshape((AMX_KEYS, hdp))
    kt[:, hd:] = 0
    vp = kv[AMX_KEYS * hdp :].reshape((AMX_KEYS // 2, 2 * hdp))
    vp[:, 2 * hd :] = 0
    st = area[o : o + AMX_KEYS * rb].reshape((AMX_KEYS, rb))
    o += AMX_KEYS * rb
    pt = area[o : o + AMX_KEYS // 2 * rb].view(np.uint32)
    o += AMX_KEYS // 2 * rb
    pr = area[o : o + AMX_KEYS // 2 * rb].view(np.uint16)
    o += AMX_KEYS // 2 * rb
    scratch = area[o : o + 3 * rb].reshape((3, rb))
    o += 3 * rb
    m, l = area[o : o + rows_p], area[o + rows_p : o + 2 * rows_p]
    o += 2 * rows_p
    acc = area[o : o + rows_p * hdp].reshape((rows_p, hdp))
    return (qh.reshape((hdp // 2, rows_p)), ql.reshape((hdp // 2, rows_p)), qh.view(np.uint16).reshape((hdp // 2, 2 * rows_p)),
            ql.view(np.uint16).reshape((hdp // 2, 2 * rows_p)), kt, vp, st, pt.reshape((AMX_KEYS // 2, rb)),
            pr.reshape((rb, AMX_KEYS)), scratch, m, l, acc)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _amx_segment(k_head, v_head, t_lo, t_hi, limit, g, bufs):
    """The partial softmax m, l [Rp] and acc [Rp, hdp] in bufs of its packed query rows
    over keys [t_lo, t_hi), from a fresh start, in tiles of KA keys from t_lo; row r sees key t when
    r // g >= t - limit. A row is a column of the tiles and a lane of the softmax: its numbers do
    not depend on the rows beside it, and a tile a row does not see changes none of them (a hidden
    key's probability is 0), so a row block skips the tiles before its first key."""
    _, _, qh16, ql16, kt, vp, st, pt, pr, scratch, m, l, acc = bufs
    rows_p = acc.shape[0]
    m[:] = _NO_MAX
    l[:] = np.float32(0.0)
    acc[:] = np.float32(0.0)
    for t0 in range(t_lo, t_hi, AMX_KEYS):
        nk = min(AMX_KEYS, t_hi - t0)
        keys, k0 = _pack_tile(k_head, v_head, t0, nk, kt, vp)
        r0 = max(0, t0 - limit) * g // 16 * 16  # rows before see no key of this tile
        while r0 < rows_p:
            cols = min(st.shape[1], rows_p - r0)
            _amx_rows(keys, k0, vp, qh16, ql16, st, pt, pr, acc, m, l, r0, cols, nk, limit - t0, g, scratch)
            r0 += cols


def _bf16_partial(k_head, v_head, t_lo, t_hi, limit, g, rows, bufs, m_out, l_out, acc_out, bf16_path):
    """The partial of `rows` rows on bf16_path's products (_amx_segment, _dp_segment) into the f32
    path's arrays m_out, l_out [>= rows] and acc_out [>= rows, >= hd], for _fold_row (bf16 KV; a
    no-op for the other KV types, which never take this path)."""
    raise NotImplementedError("numba only")


@overload(_bf16_partial, jit_options={"nogil": True, "fastmath": True})
def _bf16_partial_overload(k_head, v_head, t_lo, t_hi, limit, g, rows, bufs, m_out, l_out, acc_out, bf16_path):
    if k_head.dtype != types.uint16:
        return lambda k_head, v_head, t_lo, t_hi, limit, g, rows, bufs, m_out, l_out, acc_out, bf16_path: None

    def impl(k_head, v_head, t_lo, t_hi, limit, g, rows, bufs, m_out, l_out, acc_out, bf16_path):
        if bf16_path == ON_AMX:
            _amx_segment(k_head, v_head, t_lo, t_hi, limit, g, bufs)
        else:
            _dp_segment(k_head, v_head, t_lo, t_hi, limit, g, rows, bufs)
        m, l, acc = bufs[10], bufs[11], bufs[12]
        for r in range(rows):
            m_out[r] = m[r]
            l_out[r] = l[r]
            dst, src = acc_out[r], acc[r]
            for d in range(k_head.shape[1]):
                dst[d] = src[d]

    return impl


# ---- bf16 KV on vdpbf16ps (dpbf16.py): a segment's partial softmax, in prefill and decode -------
#
# Where bf16 weights run on vdpbf16ps ("dpbf16", no AMX), bf16 KV takes that instruction in AMX's
# frame (segments at fixed positions, tiles of KA keys from a segment's start, queries as two bf16
# halves, probabilities rounded to bf16, the same softmax), with outputs in lanes: scores [rows, KA]
# = queries . keys on dpbf16.product, the tile's keys transposed into pairs of 16 keys
# (bf16.transpose_words), a row's scores in its own lanes; the softmax along each row; then acc
# [rows, hd] += probabilities . values, the values interleaved by pairs of keys (bf16.pair_keys),
# the probabilities a row's bf16 pairs as they lie. Each (row, key) score and (row, dimension) sum is
# one lane's chain of vdpbf16ps whatever the rows beside it, so a decode step's g rows get the bits
# prefill gives the same query, and no row is padded (AMX pads a decode step's g rows to 16).

ON_F32, ON_AMX, ON_DPBF16 = 0, 1, 2  # attention over bf16 KV: the f32 kernels, AMX tiles, vdpbf16ps


@numba.njit(cache=True, nogil=True, fastmath=False)
def _padded_rows(rows):
    """Rows of the packed queries and probabilities: dpbf16's blocks of tokens from any first row."""
    return dpbf16.token_rows(rows) + dpbf16.BLOCK_TOKENS


@numba.njit(cache=True, nogil=True, fastmath=False)
def dp_floats(rows, hd):
    """float32 elements of _dp_buffers' area for `rows` query rows of head_dim hd."""
    padded = _padded_rows(rows)
    return padded * hd + 3 * AMX_KEYS * hd // 2 + rows * AMX_KEYS + padded * AMX_KEYS // 2 + 2 * rows * hd + 2 * rows


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dp_buffers(area, rows, hd):
    """A vdpbf16ps task's arrays, views of area (dp_floats(rows, hd) elements), in the places of
    _amx_buffers' (the same types): two empty uint32 matrices; qh, ql [P, hd] uint16 (the scaled
    queries' halves as rows, P = _padded_rows(rows)); kt [hd // 2, 2 KA] uint16 (the tile's keys by
    pairs of dimensions, keys as columns); vp [KA // 2, 2 hd] uint16 (values by pairs of keys); st
    [rows, KA] scores; ks [KA, hd // 2] uint32 (a partial tile's keys, padded); pr [P, KA] uint16 (a
    row's bf16 probabilities); qs [rows, hd] (the scaled queries); m, l [rows]; acc [rows, hd]."""
    padded = _padded_rows(rows)
    o = 0
    qh = area[o : o + padded * hd // 2].view(np.uint16).reshape((padded, hd))
    o += padded * hd // 2
    ql = area[o : o + padded * hd // 2].view(np.uint16).reshape((padded, hd))
    o += padded * hd // 2
    kt = area[o : o + AMX_KEYS * hd // 2].view(np.uint16).reshape((hd // 2, 2 * AMX_KEYS))
    o += AMX_KEYS * hd // 2
    vp = area[o : o + AMX_KEYS * hd // 2].view(np.uint16).reshape((AMX_KEYS // 2, 2 * hd))
    o += AMX_KEYS * hd // 2
    st = area[o : o + rows * AMX_KEYS].reshape((rows, AMX_KEYS))
    o += rows * AMX_KEYS
    ks = area[o : o + AMX_KEYS * hd // 2].view(np.uint32).reshape((AMX_KEYS, hd // 2))
    o += AMX_KEYS * hd // 2
    pr = area[o : o + padded * AMX_KEYS // 2].view(np.uint16).reshape((padded, AMX_KEYS))
    o += padded * AMX_KEYS // 2
    qs = area[o : o + rows * hd].reshape((rows, hd))
    o += rows * hd
    m, l = area[o : o + rows], area[o + rows : o + 2 * rows]
    o += 2 * rows
    acc = area[o : o + rows * hd].reshape((rows, hd))
    none = area[:0].view(np.uint32).reshape((0, 0))
    return none, none, qh, ql, kt, vp, st, ks, pr, qs, m, l, acc


@numba.njit(cache=True, nogil=True, fastmath=True)
def _bf16_buffers(area, rows, hd, bf16_path):
    """A task's arrays for bf16_path's products: _amx_buffers or _dp_buffers."""
    return _amx_buffers(area, rows, hd) if bf16_path == ON_AMX else _dp_buffers(area, rows, hd)


@numba.njit(cache=True, nogil=True, fastmath=False)
def bf16_floats(rows, hd, bf16_path):
    """float32 elements of _bf16_buffers' area."""
    return amx_floats(rows, hd) if bf16_path == ON_AMX else dp_floats(rows, hd)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _pack_bf16_queries(q, h, g, q0, nq, scale, bufs, bf16_path):
    """The task's scaled queries (row r = qi * g + gi) as bf16_path's products take them: AMX's
    pairs by column (_pack_queries), or rows of halves (bf16.pack_token_halves)."""
    if bf16_path == ON_AMX:
        _pack_queries(q, h, g, q0, nq, scale, bufs[0], bufs[1])
        return
    qh, ql, qs = bufs[2], bufs[3], bufs[9]
    for qi in range(nq):
        for gi in range(g):
            src, dst = q[q0 + qi, h * g + gi], qs[qi * g + gi]
            for d in range(src.shape[0]):
                dst[d] = src[d] * np.float32(scale)
    bf16.pack_token_halves(qs, 0, nq * g, qh.shape[0], qh, ql)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dp_softmax(st, pr, m, l, acc, r0, rows, nk, base, g):
    """The online softmax of rows r0..rows over a tile (st: [rows, KA] scores), as _softmax_block's
    along a row: row r sees tile key j while j < nk and j <= base + r // g; its bf16 probabilities
    into pr[r] (0 for hidden keys), l summing those very values."""
    for r in range(r0, rows):
        s, p = st[r], pr[r]
        for j in range(min(nk, base + r // g + 1), AMX_KEYS):  # hidden: exp gives 0 (rows from r0 see key 0)
            s[j] = _MASKED
        top = bf16.row_max(s)
        mc = m[r]
        grow = top > mc + _SLACK  # the reference max moves only when a score passes it by _SLACK
        if grow:
            mc = top
        alpha = exp_f32(m[r] - mc)
        l[r] = l[r] * alpha + bf16.exp_row(s, mc, p)
        if grow:
            m[r] = mc
            a = acc[r]
            for d in range(a.shape[0]):
                a[d] *= alpha


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dp_segment(k_head, v_head, t_lo, t_hi, limit, g, rows, bufs):
    """The partial softmax m, l [rows] and acc [rows, hd] in bufs (_dp_buffers, its queries packed)
    over keys [t_lo, t_hi), from a fresh start, in tiles of KA keys from t_lo; row r sees key t when
    r // g >= t - limit, so a tile's products skip the rows before its first key's (a hidden key's
    probability is 0: skipping them changes no number)."""
    _, _, qh, ql, kt, vp, st, ks, pr, _, m, l, acc = bufs
    hd = k_head.shape[1]
    m[:] = _NO_MAX
    l[:] = np.float32(0.0)
    acc[:] = np.float32(0.0)
    pr[rows:] = 0  # rows past the task's, products computed and dropped: finite
    keys, kt32 = k_head.view(np.uint32), kt.view(np.uint32)  # [S, hd // 2], [hd // 2, KA]: pairs of dimensions
    for t0 in range(t_lo, t_hi, AMX_KEYS):
        nk = min(AMX_KEYS, t_hi - t0)
        if nk == AMX_KEYS:
            bf16.transpose_words(keys[t0 : t0 + AMX_KEYS], kt32, 0, 0, AMX_KEYS, hd // 2)
        else:  # past nk: zero keys, their scores hidden
            ks[:nk] = keys[t0 : t0 + nk]
            ks[nk:] = 0
            bf16.transpose_words(ks, kt32, 0, 0, AMX_KEYS, hd // 2)
        bf16.pair_keys(v_head, t0, nk, vp)
        r0 = min(rows, max(0, t0 - limit) * g)
        if r0 == rows:
            continue
        dpbf16.product(kt, qh[r0:], ql[r0:], rows - r0, st[r0:], 0, 0, AMX_KEYS // bf16.TILE, 0, hd // 2, False)
        _dp_softmax(st, pr, m, l, acc, r0, rows, nk, limit - t0, g)
        dpbf16.product(vp, pr[r0:], pr[:0], rows - r0, acc[r0:], 0, 0, hd // bf16.TILE, 0, AMX_KEYS // 2, True)


def products(fmt, hd, paths=None):
    """The products of attention over KV of format fmt and head_dim hd with these paths on
    (cpu.ENABLED when None): ON_AMX on the "bf16" path (decode's matmuls on tiles too:
    bf16.decode_tiles), bf16 KV, hd % 16 == 0; ON_DPBF16 where bf16 weights run on vdpbf16ps
    (bf16.vdpbf16ps), bf16 KV, hd % 32 == 0; else ON_F32 (the f32 kernels)."""
    if fmt != BF16:
        return ON_F32
    if bf16.decode_tiles(paths):
        return ON_AMX if hd % 16 == 0 else ON_F32
    return ON_DPBF16 if bf16.vdpbf16ps(paths) and hd % 32 == 0 else ON_F32


def attention_prefill(q, k_slot, v_slot, fmt, start, scale, out):
    """Causal attention of n new queries of one slot (flash attention, GQA).

    Query i sits at position start + i and sees keys [0, start + i]; keys [0, start + n) must be
    stored. q: [n, H, hd] float32; k_slot, v_slot: [kvh, S, hd] storage; out: [n, H, hd] float32.
    bf16 KV on AMX tiles or vdpbf16ps (products): bf16 products (see above), the output within
    2**-8 x max|v| of exact (bf16 probabilities); otherwise the f32 kernels. Either way each
    query is computed as a decode step computes it: tasks are (kv head, block of TASK_ROWS // g queries),
    each converting a key tile once for all g heads of its block, ordered short, long, short, ...
    (causal work grows with the block) so that the contiguous task ranges the threads receive
    carry equal work; a short chunk, with too few tasks for the threads, shares every task's
    segments among them.
    """
    _prefill(q, kernel_view(k_slot, fmt), kernel_view(v_slot, fmt), start, scale, out, numba.get_num_threads(),
             products(fmt, q.shape[2]))


def attention_prefill_ref(q, k_slot, v_slot, fmt, start, scale, out):
    """numpy reference of attention_prefill: full causal softmax in float64."""
    n, heads, _ = q.shape
    kvh = k_slot.shape[0]
    g = heads // kvh
    keys = to_f32(k_slot[:, : start + n], fmt).astype(np.float64)  # [kvh, T, hd]
    values = to_f32(v_slot[:, : start + n], fmt).astype(np.float64)  # [kvh, T, hd]
    visible = np.arange(start + n)[None, :] <= (start + np.arange(n))[:, None]  # [n, T]
    for hq in range(heads):
        scores = q[:, hq].astype(np.float64) @ keys[hq // g].T * scale  # [n, T]
        scores = np.where(visible, scores, -np.inf)
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, hq] = (p @ values[hq // g] / p.sum(axis=1, keepdims=True)).astype(np.float32)


def decode_scratch_shapes(max_batch, H, hd, threads, sequence_length):
    """Shapes of attention_decode's float32 scratch arrays, by argument name: a partial softmax per
    segment of each row (sequence_length bounds the segments), and each thread's tile scratch."""
    rows_p = _round_up(H, 12)  # bounds the padded group size (to MR, or to TALL_MR past 2 * MR)
    hdp = _round_up(hd, NR)
    tile = max(rows_p * (hd + TILE_KEYS + hdp + 5 + hd + max(1, hd // 32)) + 2 * TILE_KEYS * hdp
               + (gemm.PANEL * hd if H > FEW_ROWS else 0), amx_floats(H, hd), dp_floats(H, hd))
    tile = _round_up(tile, 16)  # each thread's row starts a cache line (the scratch does: aligned.py)
    segments = (sequence_length + SEGMENT - 1) // SEGMENT
    return {
        "partial_m": (segments, max_batch, H),
        "partial_l": (segments, max_batch, H),
        "partial_acc": (segments, max_batch, H, hd),
        "tile": (threads, tile),
    }


@numba.njit(cache=True, nogil=True, fastmath=True)
def _carve(tile, g, hd):
    """The _segment arrays of a decode task, views of its thread's tile scratch: qs [Rp, hd],
    st [KB, Rp], acc [Rp, hdp], m, l, m_new, alpha, total [Rp], kt, vt [KB, hdp], panel, qc [Rp, hd]
    int16 (in the room of as many floats), qd [Rp, hd / 32]."""
    rows_p = _round_up(g, TALL_MR) if g > 2 * MR else _round_up(g, MR)
    hdp = _round_up(hd, NR)
    o = 0
    qs = tile[o : o + rows_p * hd].reshape((rows_p, hd))
    o += rows_p * hd
    st = tile[o : o + TILE_KEYS * rows_p].reshape((TILE_KEYS, rows_p))
    o += TILE_KEYS * rows_p
    acc = tile[o : o + rows_p * hdp].reshape((rows_p, hdp))
    o += rows_p * hdp
    vec = tile[o : o + 5 * rows_p].reshape((5, rows_p))
    o += 5 * rows_p
    kt = tile[o : o + TILE_KEYS * hdp].reshape((TILE_KEYS, hdp))
    o += kt.size
    vt = tile[o : o + TILE_KEYS * hdp].reshape((TILE_KEYS, hdp))
    o += vt.size
    panel = tile[o : o + (gemm.PANEL * hd if g > FEW_ROWS else 0)]
    o += panel.size
    qc = tile[o : o + rows_p * hd].view(np.int16)[: rows_p * hd].reshape((rows_p, hd))
    o += rows_p * hd
    qd = tile[o : o + rows_p * _query_blocks(hd)].reshape((rows_p, _query_blocks(hd)))
    return qs, st, acc, vec[0], vec[1], vec[2], vec[3], vec[4], kt, vt, panel, qc, qd


@numba.njit(cache=True, nogil=True, fastmath=True)
def _decode_task(q, k_head, v_head, b, h, length, seg, scale, m_out, l_out, acc_out, tile, bf16_path):
    """Segment seg of batch row b's keys [0, length) for the g query heads of kv head h: its partial
    softmax into m_out, l_out: [g] and acc_out: [g, hd], computed as prefill computes it."""
    g, hd = acc_out.shape
    t_lo = seg * SEGMENT
    t_hi = min(length, t_lo + SEGMENT)
    if bf16_path:
        bufs = _bf16_buffers(tile, g, hd, bf16_path)
        _pack_bf16_queries(q, h, g, b, 1, scale, bufs, bf16_path)
        _bf16_partial(k_head, v_head, t_lo, t_hi, t_hi, g, g, bufs, m_out, l_out, acc_out, bf16_path)
        return
    qs, st, acc, m, l, m_new, alpha, total, kt, vt, panel, qc, qd = _carve(tile, g, hd)
    qs[:] = np.float32(0.0)
    st[:] = np.float32(0.0)
    _fill_queries(q, h, g, b, 1, scale, k_head, qs, qc, qd)
    _segment(qs, qc, qd, k_head, v_head, t_lo, t_hi, t_hi, g, g, st, m, l, acc, m_new, alpha, total, kt, vt, panel, True)
    for r in range(g):
        m_out[r] = m[r]
        l_out[r] = l[r]
        for d in range(hd):
            acc_out[r, d] = acc[r, d]


@numba.njit(cache=True, nogil=True, fastmath=True)
def _decode_tasks(q, k_layer, v_layer, slots, lengths, scale, partial_m, partial_l, partial_acc, tile, s, every, bf16_path):
    """Tasks s, s + every, ... of the step: (row, segment, kv head) triples in that order."""
    kvh = k_layer.shape[1]
    g = q.shape[1] // kvh
    task = 0
    for b in range(q.shape[0]):
        for seg in range(_segments(lengths[b])):
            for h in range(kvh):
                if task % every == s:
                    _decode_task(q, k_layer[slots[b], h], v_layer[slots[b], h], b, h, lengths[b], seg, scale,
                                 partial_m[seg, b, h * g : h * g + g], partial_l[seg, b, h * g : h * g + g],
                                 partial_acc[seg, b, h * g : h * g + g], tile[s], bf16_path)
                task += 1


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _decode_parallel(q, k_layer, v_layer, slots, lengths, scale, partial_m, partial_l, partial_acc, tile, threads, bf16_path):
    for s in prange(threads):
        _decode_tasks(q, k_layer, v_layer, slots, lengths, scale, partial_m, partial_l, partial_acc, tile, s, threads,
                      bf16_path)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _merge_segments(partial_m, partial_l, partial_acc, lengths, out):
    """out = each row's segments merged in order (as prefill merges them)."""
    batch, heads, hd = out.shape
    for b in range(batch):
        for hq in range(heads):
            o = out[b, hq]
            o[:] = np.float32(0.0)
            state_m, state_l = _NO_MAX, np.float32(0.0)
            for seg in range(_segments(lengths[b])):
                state_m, state_l = _fold_row(state_m, state_l, o, partial_m[seg, b, hq], partial_l[seg, b, hq],
                                             partial_acc[seg, b, hq])
            _normalize(o, state_l, o)


@numba.njit(cache=True, nogil=True, fastmath=True)
def decode_rows(q, k_layer, v_layer, slots, lengths, scale, partial_m, partial_l, partial_acc, tile, threads, bf16_path, out):
    """attention_decode on kernel views, shared by `threads` threads (at most the tile scratch's):
    on the calling thread when the step is short, else tasks dealt to the threads in turns; on
    bf16 products when bf16_path (products: ON_AMX, ON_DPBF16)."""
    kvh = k_layer.shape[1]
    if threads <= 1 or int(lengths.sum()) * kvh < DECODE_PARALLEL_MIN:
        _decode_tasks(q, k_layer, v_layer, slots, lengths, scale, partial_m, partial_l, partial_acc, tile, 0, 1, bf16_path)
    else:
        _decode_parallel(q, k_layer, v_layer, slots, lengths, scale, partial_m, partial_l, partial_acc, tile, threads,
                         bf16_path)
    _merge_segments(partial_m, partial_l, partial_acc, lengths, out)


def attention_decode(q, k_layer, v_layer, fmt, slots, lengths, scale, out, partial_m, partial_l, partial_acc, tile):
    """One query per batch row attending keys [0, lengths[b]) of slot slots[b] (flash decoding).

    q: [B, H, hd] float32; k_layer, v_layer: [slots, kvh, S, hd] storage; slots, lengths: [B]
    int64 (lengths >= 1: the new token's k/v are stored first); out: [B, H, hd] float32.
    Scratch, float32, shapes from decode_scratch_shapes: partial_m, partial_l: [segments, >=B, H];
    partial_acc: [segments, >=B, H, hd]; tile: [threads, tile_floats].
    Each row computes what prefill computes for its token (same segments, tiles and sums): the
    (row, segment, kv head) tasks go to the threads in turns, then each row's segments are
    merged in order. Short work runs on the calling thread. Allocates nothing.
    """
    bf16_path = products(fmt, q.shape[2])
    k_layer, v_layer = kernel_view(k_layer, fmt), kernel_view(v_layer, fmt)
    threads = min(tile.shape[0], numba.get_num_threads())
    decode_rows(q, k_layer, v_layer, slots, lengths, scale, partial_m, partial_l, partial_acc, tile, threads, bf16_path, out)


def attention_decode_ref(q, k_layer, v_layer, fmt, slots, lengths, scale, out, partial_m, partial_l, partial_acc, tile):
    """numpy reference of attention_decode (full softmax in float64; scratch unused)."""
    batch, heads, _ = q.shape
    g = heads // k_layer.shape[1]
    for b in range(batch):
        keys = to_f32(k_layer[slots[b], :, : lengths[b]], fmt).astype(np.float64)  # [kvh, T, hd]
        values = to_f32(v_layer[slots[b], :, : lengths[b]], fmt).astype(np.float64)
        for hq in range(heads):
            scores = keys[hq // g] @ q[b, hq].astype(np.float64) * scale  # [T]
            p = np.exp(scores - scores.max())
            out[b, hq] = (p @ values[hq // g] / p.sum()).astype(np.float32)


# ---- KV held in blocks (kv_blocks.py): the kernels above pick its code by the KV's type ----------


def _held_in_blocks(kv):
    return isinstance(kv.dtype, types.Record)


def _store_any(k_new, v_new, k_layer, v_layer, key_mean, slots, positions):
    raise NotImplementedError("numba only")


@overload(_store_any, jit_options={"fastmath": False, "nogil": True})
def _store_any_overload(k_new, v_new, k_layer, v_layer, key_mean, slots, positions):
    if _held_in_blocks(k_layer):
        from ellmd.kernels.kv_blocks import store_blocks as store
    else:
        store = _store_values
    return lambda k_new, v_new, k_layer, v_layer, key_mean, slots, positions: store(
        k_new, v_new, k_layer, v_layer, key_mean, slots, positions)


def _tile_rows(head, t0, nk, dst):
    """(rows, o): positions t0..t0+nk of a head are rows o..o+nk of `rows`: the stored head itself
    (o = t0), or blocks converted to float32 into dst (o = 0)."""
    raise NotImplementedError("numba only")


@overload(_tile_rows, jit_options={"nogil": True, "fastmath": True})
def _tile_rows_overload(head, t0, nk, dst):
    if not _held_in_blocks(head) or kv_blocks.read_as_stored(head):
        return lambda head, t0, nk, dst: (head, t0)

    def impl(head, t0, nk, dst):
        kv_blocks.dequantize_rows(head, t0, nk, dst)
        return dst, 0

    return impl


def _load_rows(head, k0, nk, dst):
    """dst[:nk, :hd] = positions k0..k0+nk of one head as float32 (head: [S, hd] storage or [S, nb]
    blocks; dst: [KB, >= hd] float32)."""
    raise NotImplementedError("numba only")


@overload(_load_rows, jit_options={"nogil": True, "fastmath": True})
def _load_rows_overload(head, k0, nk, dst):
    load = kv_blocks.dequantize_rows if _held_in_blocks(head) else _load_values
    return lambda head, k0, nk, dst: load(head, k0, nk, dst)


def _as_float_tile(values, rows):
    """True when a tile of values is copied into a float32 tile for the SIMD kernel: padded to NR
    columns (a head_dim not a multiple of NR), or 16-bit values under more than FEW_ROWS query rows,
    converted once and not again by every block of rows (P.V at 144 rows, hd 64: 1.2x; the same
    float32 values, so the same sums); never q8_0 blocks (value_sums)."""
    raise NotImplementedError("numba only")


@overload(_as_float_tile, jit_options={"fastmath": False, "nogil": True})
def _as_float_tile_overload(values, rows):
    if _held_in_blocks(values):
        return lambda values, rows: False
    narrow = values.dtype != types.float32  # 16-bit values
    return lambda values, rows: values.shape[1] % NR != 0 or (narrow and rows > FEW_ROWS)


def _add_values(p, transposed, values, acc, rows, nk):
    """acc[r] += sum_j p[r, j] values[j] for r < rows (p read as p.T when transposed: [KBp, Rp]):
    float values on the SIMD kernel (rows rounded up to its height: acc's padded rows), q8_0 blocks
    as stored (kv_blocks.value_sums)."""
    raise NotImplementedError("numba only")


@overload(_add_values, jit_options={"nogil": True, "fastmath": True})
def _add_values_overload(p, transposed, values, acc, rows, nk):
    if _held_in_blocks(values):
        def impl_blocks(p, transposed, values, acc, rows, nk):
            if transposed:
                value_sums(p.T, values, acc, rows, nk)
            else:
                value_sums(p, values, acc, rows, nk)

        return impl_blocks

    def impl(p, transposed, values, acc, rows, nk):
        rows_p = acc.shape[0]
        gemm_tile(p, transposed, values, acc, rows_p, values.shape[1], nk, True, rows_p % TALL_MR == 0)

    return impl


def _rotate_rows(k_head, x, rows):
    """x[:rows] rotated as k_head's rows are stored (kv_blocks.rotate_rows: queries by the keys'
    head, accumulators by the values'); nothing for values held as values."""
    raise NotImplementedError("numba only")


@overload(_rotate_rows, jit_options={"nogil": True, "fastmath": True})
def _rotate_rows_overload(k_head, x, rows):
    if not _held_in_blocks(k_head):
        return lambda k_head, x, rows: None
    from ellmd.kernels.kv_blocks import rotate_rows

    return lambda k_head, x, rows: rotate_rows(k_head, x, rows)
