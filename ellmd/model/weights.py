"""Checkpoint readers: safetensors directories and GGUF files, both memory-mapped.

Both expose tensors under Hugging Face names, as numpy arrays in a requested storage format
(ellmd.kernels.formats: F32 float32, BF16/F16 uint16 bit patterns). A tensor already in the
requested format comes straight from the memory map, so a bf16 checkpoint stays bf16. GGUF
tensors in a block format (Q8_0, Q4_K, ...) come as block arrays (ellmd.kernels.quant) when the
caller keeps blocks, again straight from the memory map, or dequantized otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ellmd.errors import ModelError
from ellmd.kernels import cache_base, formats, quant
from ellmd.model import registry
from ellmd.model.spec import ModelSpec

# safetensors dtype -> (numpy dtype of the raw bytes, storage format or None if unsupported)
SAFETENSORS_DTYPES = {
    "F32": (np.float32, formats.F32),
    "BF16": (np.uint16, formats.BF16),
    "F16": (np.uint16, formats.F16),
}

GGUF_SUPPORTED_TYPES = ("F32", "F16", "BF16", *quant.BLOCK_DTYPES)


def convert(array: np.ndarray, src_fmt: int, dst_fmt: int) -> np.ndarray:
    """Convert a storage array between formats (no copy when they already agree)."""
    if src_fmt == dst_fmt:
        return array
    return formats.to_storage(formats.to_f32(array, src_fmt), dst_fmt)


class SafetensorsCheckpoint:
    """A Hugging Face checkpoint directory: config.json plus one or many *.safetensors."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.spec = ModelSpec.from_file(self.directory / "config.json")
        self._tensors: dict[str, tuple[Path, str, list[int], int, int]] = {}
        files = sorted(self.directory.glob("*.safetensors"))
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ModelError(f"{index}: not a valid safetensors index ({e})") from None
            files = sorted({self.directory / f for f in weight_map.values()})
        if not files:
            raise ModelError(f"{self.directory}: no *.safetensors file")
        self._maps: dict[Path, np.memmap] = {}
        for file in files:
            self._read_header(file)

    def _read_header(self, file: Path) -> None:
        # Parsed here because safetensors' numpy backend cannot hand out bf16 tensors as raw bits.
        if not file.exists():
            raise ModelError(f"{file}: no such file (listed in model.safetensors.index.json)")
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelError(f"{file}: truncated safetensors file (no header)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                raise ModelError(f"{file}: corrupt safetensors header (length {header_len} > file size)")
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ModelError(f"{file}: corrupt safetensors header (not JSON)") from None
        data_start = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = info.get("dtype")
            if dtype not in SAFETENSORS_DTYPES:
                raise ModelError(f"{file}: tensor {name} has unsupported dtype {dtype} (supported: F32, BF16, F16)")
            begin, end = info["data_offsets"]
            np_dtype = SAFETENSORS_DTYPES[dtype][0]
            expected = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(np_dtype).itemsize
            if end - begin != expected:
                raise ModelError(f"{file}: tensor {name} has {end - begin} bytes, its shape {info['shape']} needs {expected}")
            if data_start + end > size:
                raise ModelError(f"{file}: truncated (tensor {name} ends past the end of the file)")
            self._tensors[name] = (file, dtype, info["shape"], data_start + begin, data_start + end)

    def names(self) -> list[str]:
        return list(self._tensors)

    def digest(self) -> str:
        return files_digest({file for file, *_ in self._tensors.values()})

    def native_format(self) -> int:
        """The storage format of most 2-D tensors: the checkpoint's own precision."""
        counts = Counter(dtype for _, dtype, shape, _, _ in self._tensors.values() if len(shape) >= 2)
        return SAFETENSORS_DTYPES[counts.most_common(1)[0][0]][1]

    def get(self, name: str, fmt: int, keep_blocks: bool = False) -> np.ndarray:
        """Tensor `name` in storage format fmt (a safetensors file has no blocks to keep)."""
        if name not in self._tensors:
            raise ModelError(f"{self.directory}: tensor {name} is missing")
        file, dtype, shape, begin, end = self._tensors[name]
        if file not in self._maps:
            self._maps[file] = np.memmap(file, dtype=np.uint8, mode="r")
        np_dtype, src_fmt = SAFETENSORS_DTYPES[dtype]
        array = self._maps[file][begin:end].view(np_dtype).reshape(shape)
        return convert(array, src_fmt, fmt)


class GGUFTensor(msgspec.Struct, frozen=True):
    """A tensor of a GGUF file: its name, GGUF type name, dimensions (innermost first, as GGUF
    lists them) and where its bytes lie in the file."""

    name: str
    kind: str
    dims: list[int]
    offset: int
    nbytes: int


class GGUFIndex(msgspec.Struct):
    """What a GGUF file says before its tensors' bytes: its metadata values and its tensor table."""

    fields: dict[str, Any]
    tensors: list[GGUFTensor]


def gguf_index(file: Path) -> GGUFIndex:
    """The metadata and tensor table of a GGUF file, read by the gguf package once and cached
    (XDG_CACHE_HOME/ellm/gguf-index, an entry per path, size and time of change): the package
    slices the file once per metadata value, ~250,000 times for a 49k-token vocabulary and its
    merges (5-10 s on a slow core, at every start); the cached index decodes in milliseconds. A
    cache that cannot be read or written only costs the parse."""
    import gguf

    stat = file.stat()
    key = hashlib.sha256(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    path = cache_base() / "gguf-index" / f"{key[:24]}.msgpack"
    try:
        return msgspec.msgpack.decode(path.read_bytes(), type=GGUFIndex)
    except (OSError, msgspec.DecodeError):
        pass
    try:
        reader = gguf.GGUFReader(file)
    except Exception as e:  # the gguf package raises bare ValueError/IndexError on corrupt input
        raise ModelError(f"{file}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    if reader.byte_order != "I":  # the tensors are read in place, in this machine's byte order
        raise ModelError(f"{file}: a big-endian GGUF file (ellm reads little-endian ones)")
    fields = {}
    for name, field in reader.fields.items():
        try:
            fields[name] = field.contents()
        except Exception:
            raise ModelError(f"{file}: corrupt GGUF metadata field {name}") from None
    index = GGUFIndex(fields, [GGUFTensor(t.name, t.tensor_type.name, [int(d) for d in t.shape], int(t.data_offset),
                                          int(t.n_bytes)) for t in reader.tensors])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial")
        partial.write_bytes(msgspec.msgpack.encode(index))
        partial.replace(path)  # whole or absent: a reader never sees half an entry
    except OSError:
        pass
    return index


class GGUFCheckpoint:
    """A single GGUF file: metadata, tokenizer and (possibly quantized) tensors."""

    def __init__(self, file: Path):
        self.file = Path(file)
        if not self.file.exists():
            raise ModelError(f"{self.file}: no such file")
        index = gguf_index(self.file)
        self.fields = index.fields
        self.spec = ModelSpec.from_gguf(self.fields)
        self.family = registry.family(self.spec.model_type)
        self._tensors = {}
        for tensor in index.tensors:
            hf_name = self.family.gguf_name(tensor.name)
            if hf_name is None:
                continue
            if tensor.kind not in GGUF_SUPPORTED_TYPES:
                raise ModelError(
                    f"{self.file}: tensor {tensor.name} has unsupported type {tensor.kind} "
                    f"(supported: {', '.join(GGUF_SUPPORTED_TYPES)})"
                )
            self._tensors[hf_name] = tensor
        self.spec.tie_word_embeddings = "lm_head.weight" not in self._tensors
        self._map = np.memmap(self.file, dtype=np.uint8, mode="r")

    def names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> GGUFTensor:
        """The table entry of tensor `name` (a Hugging Face name)."""
        return self._tensors[name]

    def digest(self) -> str:
        return files_digest([self.file])

    def native_format(self) -> int:
        counts = Counter(t.kind for t in self._tensors.values() if len(t.dims) >= 2)
        kind = counts.most_common(1)[0][0]
        return {"F32": formats.F32, "F16": formats.F16}.get(kind, formats.BF16)

    def block_type(self, name: str) -> str | None:
        """The block format of a tensor (Q4_K, ...), None for F32/F16/BF16."""
        kind = self._tensors[name].kind
        return kind if kind in quant.BLOCK_DTYPES else None

    def get(self, name: str, fmt: int, keep_blocks: bool = False) -> np.ndarray:
        """Tensor `name` in storage format fmt, or as blocks (a view of the file) if keep_blocks."""
        if name not in self._tensors:
            raise ModelError(f"{self.file}: tensor {name} is missing")
        tensor = self._tensors[name]
        shape = tensor.dims[::-1]  # GGUF lists dimensions innermost first
        kind = tensor.kind
        raw = np.asarray(self._map[tensor.offset : tensor.offset + tensor.nbytes])  # short in a truncated file
        try:
            if kind == "F32":
                array, src = raw.view(np.float32).reshape(shape), formats.F32
            elif kind in ("F16", "BF16"):
                array = raw.view(np.uint16).reshape(shape)
                src = formats.F16 if kind == "F16" else formats.BF16
            else:
                array, src = quant.from_bytes(raw, kind, shape), None
        except ValueError as e:
            raise ModelError(f"{self.file}: tensor {tensor.name} is corrupt ({e})") from None
        if self.family.gguf_permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.spec.num_attention_heads if "q_proj" in name else self.spec.num_key_value_heads
            array = _unpermute_rope_rows(array, heads)  # whole rows: blocks move with them
        array = np.ascontiguousarray(array)
        if src is None:
            if keep_blocks:
                return array
            array, src = quant.dequantize(array), formats.F32
        return convert(array, src, fmt)


def quantize_weight(array: np.ndarray, src_fmt: int, name: str) -> np.ndarray:
    """A float weight [..., k] quantized to block type name, as llama-quantize falls back.

    A width that Q4_K's 256-value super-blocks do not divide gets Q5_0 (llama.cpp's choice); a
    width that 32 does not divide stays in its float format. Rows go by chunks, to bound the
    float32 copy.
    """
    k = array.shape[-1]
    if name == "Q4_K" and k % quant.QK:
        name = "Q5_0"
    if k % quant.BLOCK_SIZES[name]:
        return array
    rows = array.reshape(-1, k)
    out = np.empty((len(rows), k // quant.BLOCK_SIZES[name]), quant.BLOCK_DTYPES[name])
    step = max(1, (1 << 22) // k)
    for r in range(0, len(rows), step):
        out[r : r + step] = quant.quantize(formats.to_f32(rows[r : r + step], src_fmt), name)
    return out.reshape(*array.shape[:-1], out.shape[-1])


def files_digest(files) -> str:
    """A cheap identity of weight files: sizes plus their first and last MiB (not a full hash,
    which would cost seconds per GiB at every start)."""
    digest = hashlib.sha256()
    for file in sorted(files):
        size = file.stat().st_size
        with open(file, "rb") as f:
            digest.update(f"{file.name}:{size}".encode())
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (it interleaves each head's two rope halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_checkpoint(path: Path) -> SafetensorsCheckpoint | GGUFCheckpoint:
    """Open a checkpoint directory or a .gguf file."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such file or directory")
    if path.is_dir():
        return SafetensorsCheckpoint(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path}: not a GGUF file (bad magic) nor a checkpoint directory")
    return GGUFCheckpoint(path)


class RandomCheckpoint:
    """Random weights at the shapes of a config.json: for benchmarks and memory planning only."""

    def __init__(self, config_file: Path, seed: int = 0, layers: int | None = None):
        self.spec = ModelSpec.from_file(config_file)
        if layers:  # a truncated model, so that big configs fit in memory
            self.spec.num_hidden_layers = min(layers, self.spec.num_hidden_layers)
        self.seed = seed
        self._shapes = _hf_shapes(self.spec)

    def names(self) -> list[str]:
        return list(self._shapes)

    def native_format(self) -> int:
        return formats.BF16

    def digest(self) -> str:
        return hashlib.sha256(repr((self.spec, self.seed)).encode()).hexdigest()

    def get(self, name: str, fmt: int, keep_blocks: bool = False) -> np.ndarray:
        shape = self._shapes[name]
        rng = np.random.default_rng([self.seed, len(name), sum(map(ord, name))])
        if len(shape) == 1:  # norm weights: near 1, as trained models have them
            return convert(1.0 + 0.1 * rng.standard_normal(shape, np.float32), formats.F32, fmt)
        fan_in = shape[-1]
        return convert(rng.standard_normal(shape, np.float32) * fan_in**-0.5, formats.F32, fmt)


def _hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes implied by a spec (its family's layer shapes)."""
    h, V = spec.hidden_size, spec.vocab_size
    shapes = {"model.embed_tokens.weight": (V, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, h)
    layer_shapes = registry.family(spec.model_type).layer_shapes
    for i in range(spec.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer_shapes(spec, i).items()})
    return shapes
