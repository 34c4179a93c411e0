"""Arrays whose first element starts a cache line. An AMX tile row, a zmm load or a store that
straddles two lines costs two accesses: the bf16 GEMM ran 1.5x faster with its operands on 64-byte
boundaries than at numpy's usual 16 (docs/engine.md). Rows stay aligned where their bytes are a
multiple of 64, as every AMX operand's are."""

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

LINE = 64


def empty(shape, dtype) -> np.ndarray:
    """np.empty on a cache line: a view into a buffer one line larger (the view keeps it alive)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buffer = np.empty(nbytes + LINE, np.uint8)
    skip = -buffer.ctypes.data % LINE
    return buffer[skip : skip + nbytes].view(dtype).reshape(shape)


def zeros(shape, dtype) -> np.ndarray:
    a = empty(shape, dtype)
    a[...] = 0
    return a


def on_line(a: np.ndarray) -> np.ndarray:
    """a itself where it starts a cache line, else a C-contiguous copy that does."""
    if a.ctypes.data % LINE == 0 and a.flags.c_contiguous:
        return a
    out = empty(a.shape, a.dtype)
    out[...] = a
    return out


@intrinsic
def address(typingctx, a):
    """The address of an array's first element."""
    if not isinstance(a, types.Array):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, context.get_value_type(types.intp))

    return types.intp(a), codegen


@numba.njit(cache=True, nogil=True, fastmath=False, inline="always")
def line_start(raw):
    """raw (1-D float32) from its first element on a cache line: up to 15 fewer elements (numba's
    arrays start 32 bytes into one as often as not)."""
    return raw[(-address(raw) % LINE) // 4 :]
