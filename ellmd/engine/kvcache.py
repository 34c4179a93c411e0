"""The preallocated KV tensor and slot bookkeeping.

Shapes:
  K, V   [layers, slots, kv_heads, sequence_length, head_dim]   storage format (f32 | bf16 | f16 bits)
         [layers, slots, kv_heads, sequence_length, blocks]     blocks (q8_0 | q4_0: kv_blocks.py); K and V
                                                                may hold two block formats ("q8_0/q4_0")
  lengths [slots]                                               tokens held by each slot
  key_mean [layers, kv_heads, head_dim] float32                 the mean key subtracted from q4_0 keys
                                                                (kv_blocks.py), [layers, 0, head_dim] else
"""

from __future__ import annotations

import numpy as np

from ellmd.errors import CapacityError, InvariantError
from ellmd.kernels import aligned, formats, kv_blocks


def available_memory() -> int:
    """Bytes the kernel says can still be allocated without swapping (MemAvailable)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("MemAvailable not found in /proc/meminfo")


def element(fmt: int, head_dim: int) -> tuple[np.dtype, int]:
    """(dtype, elements) of one head's row of a token in the format fmt of keys or of values."""
    if kv_blocks.is_block_format(fmt):
        return kv_blocks.storage(fmt, head_dim)
    return formats.storage_dtype(fmt), head_dim


def row_bytes(fmt: int, head_dim: int) -> int:
    """Bytes of one head's key row plus its value row in KV format fmt (a pair: keys/values)."""
    return sum(dtype.itemsize * count for dtype, count in
               (element(part, head_dim) for part in kv_blocks.key_value_formats(fmt)))


def capacity(layers: int, kv_heads: int, head_dim: int, sequence_length: int, memory: int,
             disk: int | None = None) -> dict[str, dict]:
    """Per KV format (bf16, q8_0, q4_0): bytes per token, tokens per GiB, and how many sessions of
    sequence_length tokens fit in `memory` bytes and in `disk` bytes (None: not asked)."""
    out = {}
    for name in ("bf16", "q8_0", "q8_0/q4_0", "q4_0"):
        fmt = kv_blocks.KV_DTYPES[name]
        if kv_blocks.is_block_format(fmt) and head_dim % kv_blocks.BLOCK:
            continue
        per_token = KVCache.nbytes_for(layers, 1, kv_heads, 1, head_dim, fmt)
        session = per_token * sequence_length
        out[name] = {"bytes_per_token": per_token, "tokens_per_gib": 2**30 // per_token,
                     "sessions_in_memory": memory // session}
        if disk is not None:
            out[name]["sessions_on_disk"] = disk // session
    return out


class KVCache:
    """K and V for every layer and slot, allocated once and never grown."""

    def __init__(self, layers: int, slots: int, kv_heads: int, sequence_length: int, head_dim: int, fmt: int):
        self.fmt = fmt
        self.shape = (layers, slots, kv_heads, sequence_length, head_dim)
        self.sequence_length = sequence_length
        self.slots = slots
        self.k, self.v = (aligned.empty((*self.shape[:-1], count), dtype) for dtype, count in
                          (element(part, head_dim) for part in kv_blocks.key_value_formats(fmt)))
        # the same memory as bytes [layers, slots, kv_heads, S, row bytes]: copies of blocks go through
        # these (numpy copies a record dtype's fields one element at a time: q8_0 ran at 3.7 GB/s)
        self.k_bytes, self.v_bytes = self.k.view(np.uint8), self.v.view(np.uint8)
        self.lengths = np.zeros(slots, np.int64)
        centred = kv_heads if kv_blocks.centred_keys(fmt) else 0
        self.key_mean = np.zeros((layers, centred, head_dim), np.float32)  # set by the engine at load

    @staticmethod
    def nbytes_for(layers, slots, kv_heads, sequence_length, head_dim, fmt) -> int:
        return layers * slots * kv_heads * sequence_length * row_bytes(fmt, head_dim)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_per_token(self) -> int:
        layers, _, kv_heads, _, _ = self.shape
        return layers * kv_heads * (self.k[0, 0, 0, 0].nbytes + self.v[0, 0, 0, 0].nbytes)

    def commit(self, progress=None) -> None:
        """Touch every page now, so the memory is really ours before the first request."""
        for layer in range(self.shape[0]):
            self.k_bytes[layer].fill(0)
            self.v_bytes[layer].fill(0)
            if progress:
                progress(layer + 1, self.shape[0])

    def check_room(self, slot: int, extra: int) -> None:
        """Raise CapacityError unless `extra` more tokens fit in `slot` (InvariantError: no such slot)."""
        if not 0 <= slot < self.slots:
            raise InvariantError(f"slot {slot} does not exist (slots: 0..{self.slots - 1})")
        needed = int(self.lengths[slot]) + extra
        if needed > self.sequence_length:
            raise CapacityError(
                f"slot {slot} would hold {needed} tokens, over the sequence length {self.sequence_length}"
            )

    def rewind(self, slot: int, length: int) -> None:
        """Forget everything after `length` tokens: O(1), the stale entries are simply overwritten later."""
        if not 0 <= length <= self.lengths[slot]:
            raise InvariantError(f"cannot rewind slot {slot} to {length} tokens: it holds {self.lengths[slot]}")
        self.lengths[slot] = length

    def copy_slot(self, src: int, dst: int, length: int | None = None) -> None:
        """Make dst hold src's first `length` tokens (all of them by default)."""
        n = int(self.lengths[src]) if length is None else length
        if not 0 <= n <= self.lengths[src]:
            raise InvariantError(f"cannot copy {n} tokens of slot {src}: it holds {self.lengths[src]}")
        self.k_bytes[:, dst, :, :n] = self.k_bytes[:, src, :, :n]
        self.v_bytes[:, dst, :, :n] = self.v_bytes[:, src, :, :n]
        self.lengths[dst] = n

    def export(self, slot: int, start: int, stop: int) -> np.ndarray:
        """K then V of tokens [start, stop) as bytes (a flat uint8 array, gathered in one copy),
        laid out [layers, kv_heads, tokens, head_dim]."""
        if not 0 <= start <= stop <= self.lengths[slot]:
            raise InvariantError(f"range [{start}, {stop}) is outside slot {slot}'s {self.lengths[slot]} tokens")
        out = np.empty((stop - start) * self.bytes_per_token, np.uint8)
        keys, values = self._halves(out, stop - start)
        keys[:] = self.k_bytes[:, slot, :, start:stop]
        values[:] = self.v_bytes[:, slot, :, start:stop]
        return out

    def _halves(self, data, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Byte views of exported data (count tokens): keys [layers, kv_heads, count, row bytes], then
        values."""
        layers, _, kv_heads, _, _ = self.shape
        split = layers * kv_heads * count * self.k_bytes.shape[-1]
        keys = np.frombuffer(data, np.uint8, split)
        values = np.frombuffer(data, np.uint8, offset=split)
        return (keys.reshape(layers, kv_heads, count, self.k_bytes.shape[-1]),
                values.reshape(layers, kv_heads, count, self.v_bytes.shape[-1]))

    def import_(self, slot: int, start: int, data) -> int:
        """Write exported bytes (any buffer: read in place) at `start` (which must not leave a gap);
        returns the new length."""
        per_token = self.bytes_per_token
        if len(data) % per_token:
            raise InvariantError(f"KV data of {len(data)} bytes is not a whole number of {per_token}-byte tokens")
        count = len(data) // per_token
        if start > self.lengths[slot]:
            raise InvariantError(f"import at {start} would leave a gap after slot {slot}'s {self.lengths[slot]} tokens")
        if start + count > self.sequence_length:
            raise CapacityError(f"{start + count} tokens exceed the sequence length {self.sequence_length}")
        keys, values = self._halves(data, count)
        self.k_bytes[:, slot, :, start : start + count] = keys
        self.v_bytes[:, slot, :, start : start + count] = values
        self.lengths[slot] = start + count
        return start + count
