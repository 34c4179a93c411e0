"""Causal attention over the resident KV cache: KV store, tiled prefill, split-K decode.

Shape legend:
  n      query tokens of one prefill chunk
  B      decode batch (one query token per row)
  H      query heads; kvh kv heads; g = H // kvh query heads per kv head (GQA group)
  hd     head_dim; hdp = hd rounded up to NR (tile.py)
  slots  KV slots; S sequence capacity of a slot
  KB     keys per tile (TILE_KEYS)
  R      query rows of a task: (query, head of the group) pairs, row r = qi * g + gi;
         Rp = R rounded up for the SIMD kernel (to 32 on AMX)
  KA, RB keys per tile and query rows per softmax block of the AMX path (AMX_KEYS, AMX_BLOCK)

Both kernels are flash attention: keys are visited in tiles with an online softmax (running
max, running sum, rescaled accumulator), the products run on the SIMD kernel of tile.py, and no
n x n matrix is ever built. Any head_dim: prefill converts keys and values into float32 tiles
padded to hdp columns, and so does decode when hd % NR != 0 (it reads storage directly
otherwise): the KV layout stays exactly [..., hd] whatever hd.
Storage: see formats.py (f16 is viewed as int16 inside kernels).

Prefill of bf16 KV on the "bf16" path (cpu.py, AMX): the two products are tdpbf16ps tile products
(bf16.tile_product), the online softmax stays f32. A task is (kv head, block of up to
AMX_TASK_ROWS query rows, key range): it packs its queries once (scaled, as hi + lo bf16 halves:
a single bf16 raised the median logit error by a fifth on 1,100-token prefill), then visits its
keys in tiles of KA, each packed once (keys as rows, values transposed) for all its rows, in
blocks of RB rows: scores^T [KA, RB] = keys . queries^T, softmax along the rows, probabilities
rounded to bf16 (as flash attention does; no change in the logit error measured) and
acc^T [hdp, R] += values^T . p^T. Key ranges split the causal work of a query block into one
share per thread; the partial softmaxes are merged as in decode. f16 and f32 KV, kept for their
precision, take the f32 kernels.
Loops index from 0 over views: an index that may be negative, like range(lo, n), makes numba
emit wraparound checks that stop LLVM from vectorizing.
"""

import numba
import numpy as np
from numba import prange

from ellmd.kernels import bf16, cpu
from ellmd.kernels.activations import exp_f32
from ellmd.kernels.formats import BF16, _bitcast_f32, _bitcast_u32, decode, encode, kernel_view, to_f32, to_storage
from ellmd.kernels.tile import MR, NR, TALL_MR, gemm_tile

TILE_KEYS = 64  # KB, a multiple of NR
TASK_ROWS = 144  # R target of a prefill task: query block = TASK_ROWS // g queries
# Below this many (kv head, query block) units per thread, prefill splits the keys of every unit
# too (one share per thread, merged as in decode): a short chunk has as few units as kv heads,
# and 3 units on 2 threads leave one thread idle a third of the time.
SPLIT_UNITS = 4
# Below this many (key, kv head) pairs a decode step runs on the calling thread (launching the
# parallel region, ~10 us with this many arrays, costs more than it saves), and a row's keys are
# not split across the threads (_row_splits).
DECODE_PARALLEL_MIN = 2048
# Running max before any key: finite, because fastmath assumes no infinities.
_NO_MAX = np.float32(-1e30)


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def _round_up(x, m):
    return (x + m - 1) // m * m


@numba.njit(cache=True, nogil=True, fastmath=True)
def _store(k_new, v_new, k_layer, v_layer, slots, positions):
    # serial: a few values per token, memory-bound
    for i in range(k_new.shape[0]):
        for h in range(k_new.shape[1]):
            kd = k_layer[slots[i], h, positions[i]]
            vd = v_layer[slots[i], h, positions[i]]
            for d in range(kd.shape[0]):
                kd[d] = encode(k_new[i, h, d], kd)
                vd[d] = encode(v_new[i, h, d], vd)


def store_kv(k_new, v_new, k_layer, v_layer, fmt, slots, positions):
    """Write each token's keys and values into the cache at (slot, head, position).

    k_new, v_new: [n, kvh, hd] float32; k_layer, v_layer: [slots, kvh, S, hd] storage;
    slots, positions: [n] int64.
    """
    _store(k_new, v_new, kernel_view(k_layer, fmt), kernel_view(v_layer, fmt), slots, positions)


def store_kv_ref(k_new, v_new, k_layer, v_layer, fmt, slots, positions):
    """numpy reference of store_kv (the same rounding: to_storage)."""
    for i in range(k_new.shape[0]):
        k_layer[slots[i], :, positions[i]] = to_storage(k_new[i], fmt)
        v_layer[slots[i], :, positions[i]] = to_storage(v_new[i], fmt)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _load_rows(head, k0, nk, dst):
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


@numba.njit(cache=True, nogil=True, fastmath=True)
def _prefill_tile(qt, kt, vt, rows, nk, limit, g, st, m, l, acc, m_new, alpha, total):
    """One online-softmax step of a task's query rows over a tile of nk keys.

    Works on transposed scores so that every softmax loop runs along the rows, elementwise,
    with no reductions. Key j of the tile is seen by rows r with r // g >= j - limit.
    qt: [hd, Rp] pre-scaled queries transposed, zero past `rows`; kt: [KBp, hdp] keys (KBp = KB
    rounded up to TALL_MR, finite past nk); vt: [KB, hdp] values; st: [KBp, Rp] scores
    transposed; m, l: [Rp] running max and sum; acc: [Rp, hdp] output accumulator;
    m_new, alpha, total: [Rp] scratch.
    """
    hd, rows_p = qt.shape
    hdp = acc.shape[1]
    gemm_tile(kt, False, qt, st, _round_up(nk, TALL_MR), rows_p, hd, False, True)
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
    for r in range(rows):
        a = acc[r]
        for d in range(hd):
            a[d] *= alpha[r]
    # acc[r, d] += sum_j st[j, r] * v[j, d]: st read transposed in place
    gemm_tile(st, True, vt, acc, rows_p, hdp, nk, True, rows_p % TALL_MR == 0)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _prefill_task(q, k_slot, v_slot, start, scale, h, q0, nq, k0, k1):
    """Queries q0..q0+nq of the g heads of kv head h over keys [k0, k1): the unnormalised partial
    softmax m, l: [Rp] and acc: [Rp, hdp], row r = qi * g + gi.

    Rp is rows rounded to NR (the scores' columns), not to 48: a short chunk of 1..5 tokens would
    spend most of its products on padding rows; the values product then takes the 4-row blocks
    where Rp is no multiple of TALL_MR.
    """
    heads, hd = q.shape[1], q.shape[2]
    g = heads // k_slot.shape[0]
    hdp = _round_up(hd, NR)
    rows = nq * g
    rows_p = _round_up(rows, NR)
    keys_p = _round_up(TILE_KEYS, TALL_MR)
    qt = np.zeros((hd, rows_p), np.float32)  # [hd, Rp]
    kt = np.zeros((keys_p, hdp), np.float32)  # [KBp, hdp]
    vt = np.zeros((TILE_KEYS, hdp), np.float32)  # [KB, hdp]; zeros past hd, never stray denormals
    st = np.empty((keys_p, rows_p), np.float32)  # [KBp, Rp]
    acc = np.zeros((rows_p, hdp), np.float32)  # [Rp, hdp]
    m = np.full(rows_p, _NO_MAX, np.float32)  # [Rp]
    l = np.zeros(rows_p, np.float32)  # [Rp]
    m_new = np.empty(rows_p, np.float32)  # [Rp]
    alpha = np.empty(rows_p, np.float32)  # [Rp]
    total = np.empty(rows_p, np.float32)  # [Rp]
    for qi in range(nq):
        for gi in range(g):
            for d in range(hd):
                qt[d, qi * g + gi] = q[q0 + qi, h * g + gi, d] * np.float32(scale)
    for t0 in range(k0, k1, TILE_KEYS):
        nk = min(TILE_KEYS, k1 - t0)
        _load_rows(k_slot[h], t0, nk, kt)
        _load_rows(v_slot[h], t0, nk, vt)
        # query qi sees keys up to start + q0 + qi
        _prefill_tile(qt, kt, vt, rows, nk, start + q0 - t0, g, st, m, l, acc, m_new, alpha, total)
    return m, l, acc


@numba.njit(cache=True, nogil=True, fastmath=True)
def _split_point(first, nq, kend, s, nsplit, tile):
    """Start of key split s of nsplit for queries at positions first..first+nq (kend = first + nq):
    a tile boundary that cuts the causal work (keys x queries that see them) into equal shares."""
    if s == 0:
        return 0
    if s >= nsplit:
        return kend
    total = 0
    for t0 in range(0, kend, tile):
        total += min(tile, kend - t0) * (nq - max(0, t0 - first))
    done = 0
    for t0 in range(0, kend, tile):
        if done * nsplit >= total * s:
            return t0
        done += min(tile, kend - t0) * (nq - max(0, t0 - first))
    return kend


@numba.njit(cache=True, nogil=True, fastmath=True)
def _merge_key_splits(pm, pl, pacc, u, h, q0, nq, g, out):
    """out rows of unit u (kv head h, queries q0..q0+nq) = the merge of its key splits' partials.

    pm, pl: [nsplit, units, Rp]; pacc: [nsplit, units, hdp, Rp] (accumulators transposed)."""
    nsplit = pm.shape[0]
    w = np.empty(nsplit, np.float32)
    for qi in range(nq):
        for gi in range(g):
            r = qi * g + gi
            mx = _NO_MAX
            for s in range(nsplit):
                mx = max(mx, pm[s, u, r])
            total = np.float32(0.0)
            for s in range(nsplit):
                w[s] = exp_f32(pm[s, u, r] - mx)
                total += w[s] * pl[s, u, r]
            inv = np.float32(1.0) / total
            o = out[q0 + qi, h * g + gi]
            for d in range(o.shape[0]):
                x = np.float32(0.0)
                for s in range(nsplit):
                    x += w[s] * pacc[s, u, d, r]
                o[d] = x * inv


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _prefill(q, k_slot, v_slot, start, scale, out, threads):
    n, heads, hd = q.shape
    kvh = k_slot.shape[0]
    g = heads // kvh
    qb = max(1, TASK_ROWS // g)  # queries per task
    nqb = (n + qb - 1) // qb
    units = kvh * nqb  # (kv head, query block)
    nsplit = threads if units < SPLIT_UNITS * threads else 1
    parts = nsplit if nsplit > 1 else 0  # no partials unless keys are split
    rows_p = _round_up(min(n, qb) * g, NR)
    pm = np.empty((parts, units, rows_p), np.float32)
    pl = np.empty((parts, units, rows_p), np.float32)
    pacc = np.empty((parts, units, _round_up(hd, NR), rows_p), np.float32)
    for task in prange(nsplit * units):  # split-major: a thread's contiguous range is split s of every unit
        s, h, t = task // units, task % units // nqb, task % nqb
        b = t // 2 if t % 2 == 0 else nqb - 1 - t // 2  # blocks short, long, short, ...: equal ranges
        q0 = b * qb
        nq = min(n, q0 + qb) - q0
        kend = start + q0 + nq  # keys seen by the block's last query
        k0 = _split_point(start + q0, nq, kend, s, nsplit, TILE_KEYS)
        k1 = _split_point(start + q0, nq, kend, s + 1, nsplit, TILE_KEYS)
        m, l, acc = _prefill_task(q, k_slot, v_slot, start, scale, h, q0, nq, k0, k1)
        if nsplit == 1:
            for qi in range(nq):
                for gi in range(g):
                    r = qi * g + gi
                    inv = np.float32(1.0) / l[r]
                    for d in range(hd):
                        out[q0 + qi, h * g + gi, d] = acc[r, d] * inv
        else:
            u = h * nqb + b
            pm[s, u, : m.shape[0]] = m
            pl[s, u, : l.shape[0]] = l
            pacc[s, u, :, : acc.shape[0]] = acc.T
    if nsplit > 1:
        for u in prange(units):
            q0 = u % nqb * qb
            _merge_key_splits(pm, pl, pacc, u, u // nqb, q0, min(n, q0 + qb) - q0, g, out)


# ---- prefill on AMX (tdpbf16ps), bf16 KV -------------------------------------------------

AMX_KEYS = 64  # KA: keys per tile of the AMX path
AMX_BLOCK = 128  # RB: query rows of one softmax pass (its scores [KA, RB] stay in L1)
AMX_TASK_ROWS = 1024  # query rows of an AMX task at most: its accumulator and queries stay in L2
_MASKED = np.float32(-3e30)  # a hidden score: below _NO_MAX, so exp(_MASKED - m) is 0 even for m = _NO_MAX
# The reference max m of a row moves only when a score exceeds it by this much (so the
# accumulator's rescaling is rare); probabilities are then up to e**_SLACK, well within range.
_SLACK = np.float32(8.0)
_scores = bf16.tile_product(2, 2, 2, False)  # st = keys . (hi + lo) queries
_values = bf16.tile_product(2, 2, 1, True)  # acc += values^T . bf16 probabilities


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
def _pack_tile(k_head, v_head, t0, nk, kt, vt):
    """kt[:nk, :hd] = keys t0..t0+nk (bf16 rows, A operand of the scores); vt[:hd, :nk] = their
    values transposed (A operand of the values product). Columns past nk keep finite old values,
    which meet zero probabilities."""
    hd = k_head.shape[1]
    for j in range(nk):
        src = k_head[t0 + j]
        dst = kt[j]
        for d in range(hd):
            dst[d] = src[d]
    for j0 in range(0, nk, 16):  # 16 keys x hd: the source rows stay in L1 while transposed
        for d in range(hd):
            dst = vt[d]
            for j in range(j0, min(nk, j0 + 16)):
                dst[j] = v_head[t0 + j, d]


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
    acc: [hdp, Rp]; pt: [KA // 2, RB] uint32, the bf16 probabilities of keys 2p and 2p + 1 (the
    B operand of the values product); scratch: [3, RB]. l sums the very bf16 weights the values
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
        for d in range(acc.shape[0]):
            a = acc[d, r0 : r0 + cols]
            for c in range(cols):
                a[c] *= alpha[c]


@numba.njit(cache=True, nogil=True, fastmath=True)
def _amx_rows(kt, vt, qh, ql, st, pt, pt_pairs, acc, m, l, r0, cols, nk, base, g, scratch):
    """Rows r0..r0+cols of a task (r0, cols multiples of 32) over one tile of keys: scores,
    softmax, values. Row r sees tile key j while j <= base + r // g; pt, pt_pairs: [KA // 2, RB]
    uint32 and [KA // 2, 2 * RB] uint16 views of the probabilities; scratch: [3, RB] float32."""
    hdp = kt.shape[1]
    for j in range(0, AMX_KEYS, 32):
        for c in range(0, cols, 32):
            _scores(kt, j, 0, qh, ql, 0, r0 + c, st, j, c, hdp // 2)
    if nk < AMX_KEYS or base + r0 // g < AMX_KEYS - 1:  # the diagonal or the last tile
        _mask(st, nk, r0, cols, base, g)
    _softmax_block(st, r0, cols, m, l, acc, pt, scratch)
    for d in range(0, hdp, 32):
        for c in range(0, cols, 32):
            _values(vt, d, 0, pt_pairs, pt_pairs, 0, c, acc, d, r0 + c, AMX_KEYS // 2)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _amx_task(q, k_head, v_head, start, scale, g, h, q0, nq, k0, k1, m, l, acc):
    """Queries q0..q0+nq of the g heads of kv head h over keys [k0, k1): the unnormalised partial
    softmax m, l: [Rp] and acc: [hdp, Rp] (values^T . probabilities), row r = qi * g + gi."""
    hdp, rows_p = acc.shape
    half = hdp // 2 * rows_p
    qbuf = np.empty(2 * half, np.uint32)
    qh, ql = qbuf[:half].reshape((hdp // 2, rows_p)), qbuf[half:].reshape((hdp // 2, rows_p))
    _pack_queries(q, h, g, q0, nq, scale, qh, ql)
    qh16 = qbuf[:half].view(np.uint16).reshape((hdp // 2, 2 * rows_p))
    ql16 = qbuf[half:].view(np.uint16).reshape((hdp // 2, 2 * rows_p))
    kt = np.zeros((AMX_KEYS, hdp), np.uint16)  # [KA, hdp]
    vt = np.zeros((hdp, AMX_KEYS), np.uint16)  # [hdp, KA]
    st = np.empty((AMX_KEYS, AMX_BLOCK), np.float32)  # [KA, RB]
    pbuf = np.empty(AMX_KEYS // 2 * AMX_BLOCK, np.uint32)
    pt = pbuf.reshape((AMX_KEYS // 2, AMX_BLOCK))  # [KA // 2, RB]
    pt_pairs = pbuf.view(np.uint16).reshape((AMX_KEYS // 2, 2 * AMX_BLOCK))
    scratch = np.empty((3, AMX_BLOCK), np.float32)
    m[:] = _NO_MAX
    l[:] = np.float32(0.0)
    acc[:] = np.float32(0.0)
    for t0 in range(k0, k1, AMX_KEYS):
        nk = min(AMX_KEYS, k1 - t0)
        _pack_tile(k_head, v_head, t0, nk, kt, vt)
        r0 = max(0, t0 - start - q0) * g // 32 * 32  # rows before see no key of this tile
        while r0 < rows_p:
            cols = min(AMX_BLOCK, rows_p - r0)
            _amx_rows(kt, vt, qh16, ql16, st, pt, pt_pairs, acc, m, l, r0, cols, nk, start + q0 - t0, g, scratch)
            r0 += cols


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _prefill_amx(q, k_slot, v_slot, start, scale, out, nsplit):
    n, heads, hd = q.shape
    kvh = k_slot.shape[0]
    g = heads // kvh
    qb = max(1, AMX_TASK_ROWS // g)  # queries per task
    nqb = (n + qb - 1) // qb
    units = kvh * nqb  # (kv head, query block)
    rows_p = _round_up(min(n, qb) * g, 32)
    hdp = _round_up(hd, 32)
    pm = np.empty((nsplit, units, rows_p), np.float32)
    pl = np.empty((nsplit, units, rows_p), np.float32)
    pacc = np.empty((nsplit, units, hdp, rows_p), np.float32)
    for task in prange(nsplit * units):  # split-major: a thread's contiguous range is split s of every unit
        s, u = task // units, task % units
        h, q0 = u // nqb, u % nqb * qb
        nq = min(n, q0 + qb) - q0
        kend = start + q0 + nq
        k0 = _split_point(start + q0, nq, kend, s, nsplit, AMX_KEYS)
        k1 = _split_point(start + q0, nq, kend, s + 1, nsplit, AMX_KEYS)
        _amx_task(q, k_slot[h], v_slot[h], start, scale, g, h, q0, nq, k0, k1, pm[s, u], pl[s, u], pacc[s, u])
    for u in prange(units):
        q0 = u % nqb * qb
        _merge_key_splits(pm, pl, pacc, u, u // nqb, q0, min(n, q0 + qb) - q0, g, out)


def _on_amx(q, k_slot, fmt):
    return "bf16" in cpu.ENABLED and bf16.AMX and fmt == BF16 and k_slot.dtype == np.uint16 and q.shape[2] % 2 == 0


def attention_prefill(q, k_slot, v_slot, fmt, start, scale, out):
    """Causal attention of n new queries of one slot (flash attention, GQA).

    Query i sits at position start + i and sees keys [0, start + i]; keys [0, start + n) must be
    stored. q: [n, H, hd] float32; k_slot, v_slot: [kvh, S, hd] storage; out: [n, H, hd] float32.
    bf16 KV on the "bf16" path where the CPU has AMX: tile products (see above), the output
    within 2**-8 x max|v| of exact (bf16 probabilities). Otherwise the f32 kernels: tasks are
    (kv head, block of TASK_ROWS // g queries), each converting a key tile once for all g heads
    of its block, ordered short, long, short, ... (causal work grows with the block) so that the
    contiguous task ranges the threads receive carry equal work; a short chunk, with too few
    tasks for the threads, also splits every task's keys into one share per thread.
    """
    if _on_amx(q, k_slot, fmt):
        _prefill_amx(q, k_slot, v_slot, start, scale, out, numba.get_num_threads())
    else:
        _prefill(q, kernel_view(k_slot, fmt), kernel_view(v_slot, fmt), start, scale, out, numba.get_num_threads())


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


def decode_scratch_shapes(max_batch, H, hd, max_splits):
    """Shapes of attention_decode's float32 scratch arrays, by argument name.

    Every sequence is cut into min(max_splits, threads) key splits: max_splits = the thread
    count is enough.
    """
    rows_p = _round_up(H, MR)  # bounds the padded group size
    hdp = _round_up(hd, NR)
    tile = rows_p * (2 * hdp + TILE_KEYS) + (2 * TILE_KEYS * hdp if hd % NR else 0)
    return {
        "partial_m": (max_splits, max_batch, H),
        "partial_l": (max_splits, max_batch, H),
        "partial_acc": (max_splits, max_batch, H, hd),
        "tile": (max_splits, tile),
    }


@numba.njit(cache=True, nogil=True, fastmath=True)
def _scores_rows4(qs, k_head, k0, nk, rows, scores):
    """_decode_scores in blocks of 4 rows."""
    hd = qs.shape[1]
    zero = np.float32(0.0)
    for j in range(0, nk, 2):
        j1 = min(j + 1, nk - 1)  # an odd last key is computed twice
        b0, b1 = k_head[k0 + j], k_head[k0 + j1]
        for r in range(0, rows, 4):
            a0, a1, a2, a3 = qs[r], qs[r + 1], qs[r + 2], qs[r + 3]
            s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = zero
            for d in range(hd):
                u = decode(b0[d])
                v = decode(b1[d])
                s00 += a0[d] * u
                s01 += a0[d] * v
                s10 += a1[d] * u
                s11 += a1[d] * v
                s20 += a2[d] * u
                s21 += a2[d] * v
                s30 += a3[d] * u
                s31 += a3[d] * v
            scores[r, j] = s00
            scores[r + 1, j] = s10
            scores[r + 2, j] = s20
            scores[r + 3, j] = s30
            scores[r, j1] = s01
            scores[r + 1, j1] = s11
            scores[r + 2, j1] = s21
            scores[r + 3, j1] = s31


@numba.njit(cache=True, nogil=True, fastmath=True)
def _scores_rows2(qs, k_head, k0, nk, scores):
    """_decode_scores of rows 0 and 1."""
    hd = qs.shape[1]
    a0, a1 = qs[0], qs[1]
    zero = np.float32(0.0)
    for j in range(0, nk, 2):
        j1 = min(j + 1, nk - 1)
        b0, b1 = k_head[k0 + j], k_head[k0 + j1]
        s00 = s01 = s10 = s11 = zero
        for d in range(hd):
            u = decode(b0[d])
            v = decode(b1[d])
            s00 += a0[d] * u
            s01 += a0[d] * v
            s10 += a1[d] * u
            s11 += a1[d] * v
        scores[0, j] = s00
        scores[1, j] = s10
        scores[0, j1] = s01
        scores[1, j1] = s11


@numba.njit(cache=True, nogil=True, fastmath=True)
def _scores_rows1(qs, k_head, k0, nk, scores):
    """_decode_scores of row 0."""
    hd = qs.shape[1]
    a0 = qs[0]
    zero = np.float32(0.0)
    for j in range(0, nk, 2):
        j1 = min(j + 1, nk - 1)
        b0, b1 = k_head[k0 + j], k_head[k0 + j1]
        s0 = s1 = zero
        for d in range(hd):
            s0 += a0[d] * decode(b0[d])
            s1 += a0[d] * decode(b1[d])
        scores[0, j] = s0
        scores[0, j1] = s1


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def _decode_scores(qs, k_head, k0, nk, rows, scores):
    """scores[r, j] = qs[r] . key k0 + j for r < rows, keys read from storage.

    Dot products along hd, 4 rows x 2 keys per pass sharing each key load: with a handful of
    query rows this beats transposing keys for the SIMD kernel. Blocks run into the zero
    padding rows of qs; groups of 1 (MHA) and 2 rows have passes of their own, where a 4-row
    block would be mostly padding (one loop nest per function: LLVM vectorizes those best).
    qs: [Rp, hd]; k_head: [S, hd] storage (or float32); scores: [Rp, KB].
    """
    if rows == 1:
        _scores_rows1(qs, k_head, k0, nk, scores)
    elif rows == 2:
        _scores_rows2(qs, k_head, k0, nk, scores)
    else:
        _scores_rows4(qs, k_head, k0, nk, rows, scores)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _values_rows1(scores, values, acc):
    """_values_rows of row 0."""
    a0 = acc[0]
    for j in range(values.shape[0]):
        row = values[j]
        s0 = scores[0, j]
        for d in range(row.shape[0]):
            a0[d] += s0 * decode(row[d])


@numba.njit(cache=True, nogil=True, fastmath=True)
def _values_rows2(scores, values, acc):
    """_values_rows of rows 0 and 1."""
    a0, a1 = acc[0], acc[1]
    for j in range(values.shape[0]):
        row = values[j]
        s0, s1 = scores[0, j], scores[1, j]
        for d in range(row.shape[0]):
            x = decode(row[d])
            a0[d] += s0 * x
            a1[d] += s1 * x


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def _values_rows(scores, values, g, acc):
    """acc[:g] += scores[:g, :nk] @ values for g of 1 or 2, where the SIMD kernel's 4-row blocks
    would be mostly padding: one pass over each value row, the accumulators in L1.

    values: [nk, hd] storage or float32; scores: [Rp, KB]; acc: [Rp, >=hd].
    """
    if g == 1:
        _values_rows1(scores, values, acc)
    else:
        _values_rows2(scores, values, acc)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _decode_split(q, k_head, v_head, b, h, k0, k1, scale, m, l, acc_out, tile):
    """Attention of the g query heads of (batch row b, kv head h) over keys [k0, k1).

    Writes this split's partial results m, l: [g] and acc_out: [g, hd]; tile: its scratch.
    """
    g, hd = acc_out.shape
    hdp = _round_up(hd, NR)
    rows_p = _round_up(g, MR)
    o1 = rows_p * hdp
    o2 = o1 + rows_p * TILE_KEYS
    o3 = o2 + rows_p * hdp
    qs = tile[:o1].reshape((rows_p, hdp))  # [Rp, hdp]
    scores = tile[o1:o2].reshape((rows_p, TILE_KEYS))  # [Rp, KB]
    acc = tile[o2:o3].reshape((rows_p, hdp))  # [Rp, hdp]
    # hd % NR != 0: each tile is converted into zero-padded float32 rows [KB, hdp], so that the
    # dot products and the SIMD kernel run whole vectors (a scalar remainder of every key's
    # dot product would cost more than the conversion)
    padded = hdp > hd
    kt = tile[o3 : o3 + (TILE_KEYS * hdp if padded else 0)].reshape((-1, hdp))  # [KB, hdp] or empty
    vt = tile[o3 + kt.size : o3 + 2 * kt.size].reshape((-1, hdp))  # [KB, hdp] or empty
    kt[:] = np.float32(0.0)
    vt[:] = np.float32(0.0)
    for r in range(rows_p):
        for d in range(hdp):
            inside = r < g and d < hd
            qs[r, d] = q[b, h * g + r, d] * np.float32(scale) if inside else np.float32(0.0)
            acc[r, d] = np.float32(0.0)
    for gi in range(g):
        m[gi] = _NO_MAX
        l[gi] = np.float32(0.0)
    for t0 in range(k0, k1, TILE_KEYS):
        nk = min(TILE_KEYS, k1 - t0)
        if padded:
            _load_rows(k_head, t0, nk, kt)
            _decode_scores(qs, kt, 0, nk, g, scores)
        else:
            _decode_scores(qs, k_head, t0, nk, g, scores)
        for r in range(g):
            s = scores[r, :nk]
            mx = m[r]
            for j in range(nk):
                mx = max(mx, s[j])
            alpha = exp_f32(m[r] - mx)
            total = np.float32(0.0)
            for j in range(nk):
                e = exp_f32(s[j] - mx)
                s[j] = e
                total += e
            m[r] = mx
            l[r] = l[r] * alpha + total
            a = acc[r]
            for d in range(hd):
                a[d] *= alpha
        # values straight from storage (converted in registers) unless padded; the SIMD kernel
        # for groups of 3 rows or more (dispatched here: behind one more call it runs slower)
        if padded:
            _load_rows(v_head, t0, nk, vt)
            if g <= 2:
                _values_rows(scores, vt[:nk], g, acc)
            else:
                gemm_tile(scores, False, vt, acc, rows_p, hdp, nk, True, False)
        elif g <= 2:
            _values_rows(scores, v_head[t0 : t0 + nk], g, acc)
        else:
            gemm_tile(scores, False, v_head[t0 : t0 + nk], acc, rows_p, hd, nk, True, False)
    for gi in range(g):
        for d in range(hd):
            acc_out[gi, d] = acc[gi, d]


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def _row_splits(length, kvh, nsplit):
    """Key splits of a decode row: decided by its own length alone, never by the rows beside it, so
    that a session's numbers are the same whether it decodes alone, in a batch, or beside a prefill
    riding its step (the splits' merge sums in another order than one pass over the keys)."""
    return nsplit if length * kvh >= DECODE_PARALLEL_MIN else 1


@numba.njit(cache=True, nogil=True, fastmath=True)
def _decode_part(q, k_layer, v_layer, slots, lengths, scale, partial_m, partial_l, partial_acc, tile, s, nsplit):
    """Task s of nsplit: split s of every row long enough to split, and the whole of every other
    row whose turn it is (rows taken in turns); partial_*[split, row]; tile[s]: its scratch."""
    heads = q.shape[1]
    kvh = k_layer.shape[1]
    g = heads // kvh
    for b in range(q.shape[0]):
        length = lengths[b]
        splits = _row_splits(length, kvh, nsplit)
        if splits == 1 and b % nsplit != s:
            continue
        part = np.int64(s) if splits > 1 else np.int64(0)  # one type (a prange index may be unsigned)
        per = (length + splits - 1) // splits
        k0 = min(length, part * per)
        k1 = min(length, k0 + per)
        for h in range(kvh):
            _decode_split(
                q, k_layer[slots[b], h], v_layer[slots[b], h], b, h, k0, k1, scale,
                partial_m[part, b, h * g : h * g + g], partial_l[part, b, h * g : h * g + g],
                partial_acc[part, b, h * g : h * g + g], tile[s],
            )


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _decode_parallel(q, k_layer, v_layer, slots, lengths, scale, partial_m, partial_l, partial_acc, tile, nsplit):
    for s in prange(nsplit):
        _decode_part(q, k_layer, v_layer, slots, lengths, scale, partial_m, partial_l, partial_acc, tile, s, nsplit)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _merge_splits(partial_m, partial_l, partial_acc, lengths, kvh, nsplit, out):
    """out = the softmax-weighted merge of each row's partial results (_row_splits of them)."""
    batch, heads, hd = out.shape
    for b in range(batch):
        splits = _row_splits(lengths[b], kvh, nsplit)
        for hq in range(heads):
            mx = _NO_MAX
            for s in range(splits):
                mx = max(mx, partial_m[s, b, hq])
            total = np.float32(0.0)
            o = out[b, hq]
            for d in range(hd):
                o[d] = np.float32(0.0)
            for s in range(splits):
                w = exp_f32(partial_m[s, b, hq] - mx)
                total += w * partial_l[s, b, hq]
                pa = partial_acc[s, b, hq]
                for d in range(hd):
                    o[d] += w * pa[d]
            inv = np.float32(1.0) / total
            for d in range(hd):
                o[d] *= inv


@numba.njit(cache=True, nogil=True, fastmath=True)
def decode_rows(q, k_layer, v_layer, slots, lengths, scale, partial_m, partial_l, partial_acc, tile, nsplit, out):
    """attention_decode on kernel views, nsplit = the threads to share it (at most the scratch's
    splits): on the calling thread when the step is short, else one task per thread."""
    kvh = k_layer.shape[1]
    if nsplit <= 1 or int(lengths.sum()) * kvh < DECODE_PARALLEL_MIN:
        nsplit = 1  # every row is short: one split each, whichever thread runs it
        _decode_part(q, k_layer, v_layer, slots, lengths, scale, partial_m, partial_l, partial_acc, tile, 0, 1)
    else:
        _decode_parallel(q, k_layer, v_layer, slots, lengths, scale, partial_m, partial_l, partial_acc, tile, nsplit)
    _merge_splits(partial_m, partial_l, partial_acc, lengths, kvh, nsplit, out)


def attention_decode(q, k_layer, v_layer, fmt, slots, lengths, scale, out, partial_m, partial_l, partial_acc, tile):
    """One query per batch row attending keys [0, lengths[b]) of slot slots[b] (flash decoding).

    q: [B, H, hd] float32; k_layer, v_layer: [slots, kvh, S, hd] storage; slots, lengths: [B]
    int64 (lengths >= 1: the new token's k/v are stored first); out: [B, H, hd] float32.
    Scratch, float32, shapes from decode_scratch_shapes: partial_m, partial_l: [max_splits,
    >=B, H]; partial_acc: [max_splits, >=B, H, hd]; tile: [max_splits, tile_floats].
    A long row is cut into one key split per thread, whatever the mix of lengths, and the splits'
    partial softmaxes are then merged; short rows go whole to the threads in turns (_row_splits).
    Short work runs on the calling thread. Allocates nothing.
    """
    k_layer, v_layer = kernel_view(k_layer, fmt), kernel_view(v_layer, fmt)
    nsplit = min(partial_m.shape[0], numba.get_num_threads())
    decode_rows(q, k_layer, v_layer, slots, lengths, scale, partial_m, partial_l, partial_acc, tile, nsplit, out)


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
