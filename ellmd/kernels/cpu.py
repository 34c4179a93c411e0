"""The CPU's dot-product instructions and the kernel paths that use them, chosen once at import.

Paths (each needs its CPU features; without them the portable f32 FMA kernels run):
  "int16"  vpdpwssd (AVX512-VNNI), or vpmaddwd (AVX2), for weights in GGUF blocks, activations
           quantized to int16 per 32 values (~1e-5 of a product: the same numbers as f32 to the
           alignment tolerances)
  "vnni"   vpdpbusd (AVX512-VNNI) for weights in GGUF blocks, activations quantized to int8 per
           32 values as llama.cpp does (~1% of a product: it changes some greedy answers)
  "bf16"   AMX tdpbf16ps for the prefill matmuls of bf16 weights (and of GGUF blocks but those
           held in lanes' tiles) and for attention's prefill, activations as two bf16 halves (~3e-6 of a product;
           bf16.py also needs Linux to grant the tile state). Opt-in, as "dpbf16" below
  "dpbf16" vdpbf16ps (AVX512-BF16) for the prefill matmuls of bf16 weights where AMX is not on
           (Zen 4/5, Xeons from Cooper Lake; "bf16" wins where both are): bf16.py's GEMM on
           dpbf16.py's block, the same two halves. Opt-in (not in DEFAULT: ELLM_KERNELS=auto or a
           list naming it): its sums are not decode's f32 FMA sums, so a token's logits would
           depend on how it was computed

ELLM_KERNELS picks them: "auto" (every path this CPU has), "portable" (none), or a comma-separated
list of paths (those this CPU lacks are left out). Unset, DEFAULT applies. Kernels test
`path in cpu.ENABLED` when they are called, so tests switch paths by setting ENABLED.
"""

import os

from llvmlite import binding, ir
from numba.core import cgutils

# path -> the sets of CPU features that each let it run
PATHS = {"int16": (("avx512vnni", "avx512bw"), ("avx2",)), "vnni": (("avx512vnni", "avx512vl"),),
         "bf16": (("amx-bf16", "amx-tile"),), "dpbf16": (("avx512bf16", "avx512f"),)}
INTEGER = frozenset({"int16", "vnni"})  # the paths of block weights; "vnni" wins when both are on
# Only paths whose prefill sums are decode's are on by default (a token's logits must not depend on
# how it was computed): int8 activations ("vnni") also move logits too far; AMX ("bf16": its tiles
# and two bf16 halves in prefill, f32 FMA in decode) trades that for faster prefill (Xeon with AMX:
# bf16 weights 1.4-1.8x, Q4_K_M 1.7-2.7x, a 256-token turn at 8k of context 3.4x).
DEFAULT = "int16"


def host_paths() -> frozenset[str]:
    """The paths whose CPU features this machine has."""
    features = binding.get_host_cpu_features()
    return frozenset(p for p, options in PATHS.items() if any(all(features.get(f) for f in needs) for needs in options))


def compiled_for(paths, codegen):
    """An intrinsic's codegen that emits the instructions of a path (or of a tuple of paths that
    share them), where this CPU has one of them; elsewhere a trap in their place: LLVM aborts the
    process on instructions the target lacks, even in code that never runs, and kernels call a path
    only when it is in ENABLED (a subset of the host's)."""
    if host_paths() & set((paths,) if isinstance(paths, str) else paths):
        return codegen

    def trap(context, builder, signature, args):
        builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.trap"), [])
        return context.get_dummy_value()

    return trap


def choose(request: str | None) -> frozenset[str]:
    """The paths an ELLM_KERNELS value turns on, on this CPU; ValueError names a bad value."""
    request = (request or "").strip().lower() or DEFAULT
    if request == "auto":
        return host_paths()
    if request == "portable":
        return frozenset()
    asked = {p.strip() for p in request.split(",") if p.strip()}
    unknown = sorted(asked - set(PATHS))
    if unknown:
        raise ValueError(f"ELLM_KERNELS={request!r}: {', '.join(unknown)} unknown (choose auto, portable or "
                         f"a list of {', '.join(PATHS)})")
    return frozenset(asked) & host_paths()


def _from_environment() -> frozenset[str]:
    try:
        return choose(os.environ.get("ELLM_KERNELS"))
    except ValueError:  # the engine reports it (Engine checks ELLM_KERNELS with choose)
        return frozenset()


ENABLED = _from_environment()


# The prefill GEMM of GGUF block weights by CPU class, where both candidates can run (steer by
# measurements: scripts/kernel_bench.py --prefill, interleaving the two, GFLOP/s of 2 threads):
#  "integer"  the integer path's GEMM (rows_vnni over tiles of rows): a token's numbers are those of
#             decode, to the bit, whatever the chunking;
#  "bf16"     the blocks decoded to bf16 halves on AMX (bf16.py; decode stays integer, so prefill and
#             decode round differently).
# avx512 (Xeon model 207 without AMX, shared and loaded: directional; --prefill 512, CPU time):
# the integer GEMM over the f32 panels Q6_K 1.49x (180 GFLOP/s), Q4_K 1.21x, Q5_K 1.09x, Q8_0
# 1.06x (129), Q4_0 0.97x, Q5_0 0.92x, Q4_1 0.88x, Q5_1 0.77x, once the one-scale types took the
# activation scale per 256 values and the GEMM's inputs stayed in L1 (before: K-quants 1.16-1.44x,
# Q8_0/Q4_0/Q5_0 0.78-0.88x, Q4_1/Q5_1 ~0.5x); the integer GEMM for all, one arithmetic with
# decode outweighing the 5-bit one-scale types' loss (the f32 panels stay on ELLM_KERNELS=portable).
# avx2 (Zen 3): not measured yet, integer by the same rule. amx: AMX's bf16 tiles (~280 GFLOP/s a
# core measured) several times the integer GEMM's rate (~45-75 a core here): blocks keep AMX there.
BLOCK_PREFILL = {"amx": "bf16", "avx512": "integer", "avx2": "integer"}


def cpu_class() -> str:
    """The class of this CPU by the paths it has: "amx", "avx512" (VNNI) or "avx2"."""
    features = binding.get_host_cpu_features()
    if features.get("amx-bf16") and features.get("amx-tile"):
        return "amx"
    return "avx512" if features.get("avx512vnni") else "avx2"


CLASS = cpu_class()
