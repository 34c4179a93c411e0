"""The vdpbf16ps GEMM block (dpbf16.py) against numpy, and against the AMX block where the CPU has both.

The reference takes the same bf16 halves as the block and sums their products in float64 (as
bf16.gemm_ref does), so block and reference differ only by f32 summation order: test_bf16's TOL.
Operands the block must not read (pairs outside p0..p0 + pairs, weight columns outside theirs,
other tokens, the rows of c past the block) hold NaN, so a stray read shows in the result.
"""

from functools import cache

import numba
import numpy as np
import pytest
from llvmlite import binding

from ellmd.kernels import bf16, cpu, dpbf16, formats
from ellmd.kernels.formats import BF16

TOL = dict(rtol=1e-5, atol=1e-4)  # as test_bf16: f32 summation order
TOKENS = 96  # packed tokens: three blocks of 32
NAN_BITS = 0x7FC0  # a bf16 quiet NaN


@pytest.fixture
def rng():
    return np.random.default_rng(11)


@pytest.fixture
def dp():
    if "dpbf16" not in cpu.host_paths():  # the instruction would trap (cpu.compiled_for)
        pytest.skip("this CPU has no AVX512-BF16 (vdpbf16ps): the dpbf16 block cannot run here")


@cache
def _runner(block):
    @numba.njit(nogil=True, fastmath=True)
    def run(w, wl, split, j0, xh, xl, t0, c, p0, pairs):
        block(w, wl, split, j0, xh, xl, t0, c, p0, pairs)

    return run


@cache
def _dp_block(row_tiles, accumulate):
    return _runner(dpbf16.make_block(row_tiles, accumulate))


def _pack(x):
    """xh, xl: [pairs, 2 * tokens] uint16 of x [tokens, 2 * pairs], as bf16.pack_activations lays
    them out (here in numpy: that intrinsic is compiled for AMX CPUs only)."""
    packed = []
    for half in bf16.split(x):
        bits = formats.to_storage(half, BF16)  # [tokens, 2 * pairs]
        p = np.empty((x.shape[1] // 2, 2 * x.shape[0]), np.uint16)
        p[:, 0::2], p[:, 1::2] = bits[:, 0::2].T, bits[:, 1::2].T  # the even depth of each pair first
        packed.append(p)
    return packed


class Case:
    """The operands of one block call and its float64 reference: weights [48, 2 (p0 + pairs) + 6]
    (the rows from j0, padded), tokens [TOKENS, 2 (p0 + pairs + 4)], c [32, TOKENS]."""

    def __init__(self, rng, row_tiles, split, p0, pairs, t0, j0=8):
        self.rows, self.split, self.p0, self.pairs, self.t0, self.j0 = 16 * row_tiles, split, p0, pairs, t0, j0
        d0, d1 = 2 * p0, 2 * (p0 + pairs)
        wf = rng.standard_normal((48, d1 + 6)).astype(np.float32)
        if split:  # weights from GGUF blocks: their two halves (bf16.split_rows)
            self.wh, self.wl = (formats.to_storage(h, BF16) for h in bf16.split(wf))
        else:
            self.wh = formats.to_storage(wf, BF16)
            self.wl = np.full_like(self.wh, NAN_BITS)  # not read
        for w in (self.wh, self.wl):  # columns before and after the call's depths
            w[:, :d0] = w[:, d1:] = NAN_BITS
        self.x = rng.standard_normal((TOKENS, d1 + 8)).astype(np.float32)
        self.x[:, :d0] = self.x[:, d1:] = np.nan  # pairs before p0 and after p0 + pairs
        self.x[:t0] = self.x[t0 + 32 :] = np.nan  # the tokens of other blocks
        self.xh, self.xl = _pack(self.x)
        self.c0 = rng.standard_normal((32, TOKENS)).astype(np.float32)

    def reference(self, accumulate):
        rows, toks, depths = slice(self.j0, self.j0 + self.rows), slice(self.t0, self.t0 + 32), \
            slice(2 * self.p0, 2 * (self.p0 + self.pairs))
        hi, lo = (h.astype(np.float64) for h in bf16.split(self.x[toks, depths]))
        product = (hi + lo) @ formats.to_f32(self.wh[rows, depths], BF16).T.astype(np.float64)  # [32, rows]
        if self.split:
            product += hi @ formats.to_f32(self.wl[rows, depths], BF16).T.astype(np.float64)
        want = self.c0.copy()
        if accumulate:
            want[: self.rows, toks] = (self.c0[: self.rows, toks] + product.T).astype(np.float32)
        else:
            want[: self.rows, toks] = product.T.astype(np.float32)
        return want

    def run(self, block):
        c = self.c0.copy()
        block(self.wh, self.wl, self.split, self.j0, self.xh, self.xl, self.t0, c, self.p0, self.pairs)
        return c


def test_path_is_detected_from_the_cpu():
    features = binding.get_host_cpu_features()
    assert ("dpbf16" in cpu.host_paths()) == bool(features.get("avx512bf16") and features.get("avx512f"))


@pytest.mark.parametrize("p0,pairs,t0", [(0, 16, 0), (16, 48, 32), (0, bf16.DEPTH, 64), (256, bf16.DEPTH, 32),
                                         (5, 3, 64)])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("row_tiles", [2, 1])
def test_block_matches_reference(rng, dp, row_tiles, accumulate, split, p0, pairs, t0):
    """32 and 16 rows, stored or added, the halves of block weights or not, depths of one tile to
    DEPTH and a few pairs at an odd offset, every token block of c; the rest of c untouched."""
    case = Case(rng, row_tiles, split, p0, pairs, t0)
    got = case.run(_dp_block(row_tiles, accumulate))
    np.testing.assert_allclose(got, case.reference(accumulate), **TOL)


def test_no_pairs_stores_zero_or_leaves_c(rng, dp):
    case = Case(rng, 2, False, 0, 0, 32)
    assert np.array_equal(case.run(_dp_block(2, True)), case.c0)
    assert np.array_equal(case.run(_dp_block(2, False)), case.reference(False))  # zeros in the block


@pytest.mark.parametrize("split", [False, True])
def test_token_numbers_do_not_depend_on_the_other_tokens(rng, dp, split):
    """One arithmetic: a token's column has the same bits whatever the other 31 tokens of its block,
    its lane and the block it sits in."""
    case = Case(rng, 2, split, 0, bf16.DEPTH, 0)
    block = _dp_block(2, False)
    first = case.run(block)
    token = case.x[7].copy()
    for t0, lane in ((0, 20), (64, 3), (32, 31)):
        case.x[:] = rng.standard_normal(case.x.shape).astype(np.float32)  # other tokens everywhere
        case.x[t0 + lane] = token
        case.xh, case.xl = _pack(case.x)
        case.t0 = t0
        again = case.run(block)
        assert np.array_equal(again[:, t0 + lane], first[:, 7])


@pytest.mark.parametrize("p0,pairs", [(0, 16), (32, bf16.DEPTH)])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("row_tiles", [2, 1])
def test_block_matches_the_amx_block(rng, dp, row_tiles, accumulate, split, p0, pairs):
    if not bf16.AMX:
        pytest.skip("this CPU has no AMX-BF16 (or Linux did not grant the tile state): nothing to compare with")
    amx = {(2, False): bf16._amx_2, (2, True): bf16._amx_2_acc, (1, False): bf16._amx_1,
           (1, True): bf16._amx_1_acc}[row_tiles, accumulate]
    case = Case(rng, row_tiles, split, p0, pairs, 32)
    got, want = case.run(_dp_block(row_tiles, accumulate)), case.run(_runner(amx))
    np.testing.assert_allclose(got, want, **TOL)
