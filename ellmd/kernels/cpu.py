"""The CPU's dot-product instructions and the kernel paths that use them, chosen once at import.

Paths (each needs its CPU features; without them the portable f32 FMA kernels run):
  "int16"  vpdpwssd (AVX512-VNNI), or vpmaddwd (AVX2), for weights in GGUF blocks, activations
           quantized to int16 per 32 values (~1e-5 of a product: the same numbers as f32 to the
           alignment tolerances)
  "vnni"   vpdpbusd (AVX512-VNNI) for weights in GGUF blocks, activations quantized to int8 per
           32 values as llama.cpp does (~1% of a product: it changes some greedy answers)
  "int8"   with "int16" on AVX2 CPUs (those without "vnni"): vpmaddubsw for the tiles of 4- to 6-bit
           codes (lanes.INT8_BLOCKS: Q4_0, Q4_1, Q5_0, Q4_K, Q6_K; Q8_0 stays on int16), activations
           quantized to int8 per 32 values as "vnni" (prefill and decode alike). Opt-in, as "vnni":
           llama.cpp's arithmetic rate on AVX2 (1.2-1.75x int16's on Zen 1), and its precision
  "bf16"   AMX tdpbf16ps for the matmuls of bf16 weights and for attention over bf16 KV, prefill
           and decode alike (bf16.py, attention.py; decode's few tokens on the same tiles in the
           same order: a token's numbers whatever its chunk), activations and queries as two bf16
           halves (~3e-6 of a product; bf16.py also needs Linux to grant the tile state)
  "bf16-prefill"  AMX in prefill only, where decode does not follow: GGUF blocks that lanes.py does
           not tile (decoded, split into halves). Opt-in: a token's logits would depend on how it
           was computed
  "dpbf16" vdpbf16ps (AVX512-BF16) for the matmuls of bf16 weights where AMX's "bf16" is not on
           (Zen 4/5, Xeons from Cooper Lake; "bf16" wins where both are), prefill and decode alike
           (dpbf16.py: weights packed at load as "bf16" packs them, outputs in lanes; a token's
           numbers whatever its chunk), the same two halves
  "bf16-round"  with the paths above: activations rounded once to bf16 (as transformers' bf16 and
           llama.cpp's F16 matmuls round them) in place of two halves, half the products
           (~2e-3 of a product, logits moved as far as by the bf16 KV cache, a third of transformers'
           own bf16 forward's distance from fp32); prefill and decode alike. On by default: bf16
           weights are computed in bf16, as every bf16 runtime does, at twice two halves' rate

ELLM_KERNELS picks them: "auto" (every path this CPU has), "portable" (none), or a comma-separated
list of paths (those this CPU lacks are left out). Unset, DEFAULT applies. Kernels test
`path in cpu.ENABLED` when they are called, so tests switch paths by setting ENABLED.
"""

import os

from llvmlite import binding, ir
from numba.core import cgutils

# path -> the sets of CPU features that each let it run
_AMX = (("amx-bf16", "amx-tile"),)
PATHS = {"int16": (("avx512vnni", "avx512bw"), ("avx2",)), "vnni": (("avx512vnni", "avx512vl"),), "int8": (("avx2",),),
         "bf16": _AMX, "bf16-prefill": _AMX, "dpbf16": (("avx512bf16", "avx512f"),),
         "bf16-round": (*_AMX, ("avx512bf16", "avx512f"))}
INTEGER = frozenset({"int16", "vnni"})  # the paths of block weights; "vnni" wins when both are on
# Only paths whose prefill sums are decode's are on by default (a token's logits must not depend on
# how it was computed): int8 activations ("vnni", "int8") also move logits too far (on the built-in
# SmolLM2-135M, "int8" answers the capital of France with "L'Étoile, la Marseillaise,"); "bf16-prefill"
# trades that for faster prefill. Without "bf16-round" (e.g. ELLM_KERNELS=int16,bf16,dpbf16), bf16
# products take activations as two halves: ~1e-5 of fp32's logits at half the rate.
DEFAULT = "int16,bf16,dpbf16,bf16-round"


def host_paths() -> frozenset[str]:
    """The paths whose CPU features this machine has."""
    features = binding.get_host_cpu_features()
    paths = frozenset(p for p, options in PATHS.items() if any(all(features.get(f) for f in needs) for needs in options))
    return paths - {"int8"} if "vnni" in paths else paths  # "int8" is AVX2's int8 activations; VNNI has its own


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


def cpu_class() -> str:
    """The class of this CPU by the paths it has: "amx", "avx512" (VNNI) or "avx2"."""
    features = binding.get_host_cpu_features()
    if features.get("amx-bf16") and features.get("amx-tile"):
        return "amx"
    return "avx512" if features.get("avx512vnni") else "avx2"


CLASS = cpu_class()
