"""Storage formats of weights and of the KV cache, and their conversions.

numba has no float16 on the CPU, so bf16 and f16 values are stored as their uint16 bit patterns;
activations are always float32. The numpy helpers convert whole arrays (load time, tests); the
njit helpers convert one value inside kernels and compile to a few vector instructions.

Inside kernels the format is carried by the dtype, so that numba compiles one loop per format:
float32 is f32, uint16 is bf16, and f16 storage is viewed as int16 (kernel_view) by the kernel
entry points, plain Python functions, before they call the njit code; decode / encode pick the
conversion from the type. (A `fmt` test inside a loop is not hoisted by LLVM and leaves the loop
scalar; an njit entry point that branches on fmt would compile every format's loops.)

Shape legend: any shape; conversions are elementwise.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

F32 = 0
BF16 = 1
F16 = 2
FORMAT_NAMES = {"f32": F32, "bf16": BF16, "f16": F16}


def storage_dtype(fmt):
    """numpy dtype that holds values of storage format `fmt`."""
    return np.dtype(np.float32) if fmt == F32 else np.dtype(np.uint16)


def bytes_per_element(fmt):
    """Bytes one value takes in storage format `fmt`."""
    return 4 if fmt == F32 else 2


def kernel_view(a, fmt):
    """The array a kernel loop takes for storage a: f16 bits viewed as int16 (see above).

    Block arrays (quant.py) carry their format in their dtype and pass unchanged.
    """
    return a.view(np.int16) if fmt == F16 and a.dtype == np.uint16 else a


def to_storage(x, fmt):
    """float32 array -> storage array (float32, or uint16 bits rounded to nearest even)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if fmt == F32:
        return x.copy()
    if fmt == F16:
        return x.astype(np.float16).view(np.uint16)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    # NaN would round into the exponent (or to inf); keep it a quiet NaN with its sign.
    quiet = ((bits >> 16) | 0x0040).astype(np.uint16)
    return np.where(np.isnan(x), quiet, rounded)


def to_f32(a, fmt):
    """Storage array -> float32 array (a copy); block arrays (quant.py) whatever fmt."""
    if a.dtype.names is not None:
        from ellmd.kernels import quant

        return quant.dequantize(a)
    if fmt == F32:
        return np.array(a, dtype=np.float32)
    if fmt == F16:
        return a.view(np.float16).astype(np.float32)
    return (a.astype(np.uint32) << 16).view(np.float32)


@intrinsic
def _bitcast_f32(typingctx, bits):
    """Reinterpret uint32 bits as float32 (a register move, vectorizes)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _bitcast_u32(typingctx, value):
    """Reinterpret float32 as its uint32 bits."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def bf16_to_f32(h):
    """bf16 bits (uint16) -> float32: the bf16 bits are the top half of the f32."""
    return _bitcast_f32(np.uint32(h) << np.uint32(16))


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def f16_to_f32(h):
    """f16 bits (uint16) -> float32, exact for every pattern (subnormals, inf, NaN)."""
    u = np.uint32(h)
    mag = (u & np.uint32(0x7FFF)) << np.uint32(13)
    # Moving the 5-bit exponent to an 8-bit one is a multiply by 2**112, which also normalizes
    # f16 subnormals (this relies on the default MXCSR: no denormals-are-zero).
    v = _bitcast_u32(_bitcast_f32(mag) * np.float32(5.192296858534828e33))
    # inf/NaN (exponent all ones): the +0x400 carries into bit 15, then exponent 143 -> 255;
    # integer arithmetic instead of a branch keeps the loops that call this vectorized.
    v += (((u & np.uint32(0x7C00)) + np.uint32(0x400)) & np.uint32(0x8000)) * np.uint32(0x7000)
    return _bitcast_f32(v | ((u & np.uint32(0x8000)) << np.uint32(16)))


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def f32_to_bf16(x):
    """float32 -> bf16 bits, round to nearest even; NaN stays a quiet NaN."""
    b = _bitcast_u32(x)
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((b >> np.uint32(16)) | np.uint32(0x0040))
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def f32_to_f16(x):
    """float32 -> f16 bits, round to nearest even like numpy's astype(float16)."""
    b = _bitcast_u32(x)
    sign = np.uint32((b >> np.uint32(16)) & np.uint32(0x8000))
    a = b & np.uint32(0x7FFFFFFF)
    if a > np.uint32(0x7F800000):  # NaN: keep the top mantissa bits, force quiet
        return np.uint16(sign | np.uint32(0x7E00) | ((a >> np.uint32(13)) & np.uint32(0x3FF)))
    if a >= np.uint32(0x477FF000):  # rounds past 65504: inf
        return np.uint16(sign | np.uint32(0x7C00))
    if a < np.uint32(0x38800000):  # below 2**-14: f16 subnormal or zero
        if a < np.uint32(0x33000000):  # at most 2**-25 (half the smallest subnormal): zero
            return np.uint16(sign)
        e = a >> np.uint32(23)
        m = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
        shift = np.uint32(126) - e
        half = np.uint32(1) << (shift - np.uint32(1))
        q = m >> shift
        rem = m & ((np.uint32(1) << shift) - np.uint32(1))
        if rem > half or (rem == half and (q & np.uint32(1)) == np.uint32(1)):
            q += np.uint32(1)
        return np.uint16(sign | q)
    # normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to even
    r = a - np.uint32(0x38000000) + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))
    return np.uint16(sign | (r >> np.uint32(13)))


def decode(v):
    """Storage scalar -> float32, inside kernels: uint16 is bf16, int16 is f16, floats as is."""
    raise NotImplementedError("numba only")


@overload(decode, jit_options={"fastmath": True, "nogil": True})
def _decode_overload(v):
    if v == types.uint16:
        return lambda v: bf16_to_f32(v)
    if v == types.int16:
        return lambda v: f16_to_f32(v)
    if isinstance(v, types.Float):
        return lambda v: np.float32(v)
    return None


def encode(x, dst):
    """float32 -> a scalar of storage array dst's type (uint16: bf16, int16: f16, float32)."""
    raise NotImplementedError("numba only")


@overload(encode, jit_options={"fastmath": True, "nogil": True})
def _encode_overload(x, dst):
    if dst.dtype == types.uint16:
        return lambda x, dst: f32_to_bf16(x)
    if dst.dtype == types.int16:
        return lambda x, dst: np.int16(f32_to_f16(x))
    if isinstance(dst.dtype, types.Float):
        return lambda x, dst: np.float32(x)
    return None
