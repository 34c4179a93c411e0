"""numba kernels, each beside a numpy reference of the same signature (`<name>_ref`)."""

import hashlib
import os
from pathlib import Path

import numba
import numba.core.caching


def cache_base() -> Path:
    """The folder of ellm's caches: XDG_CACHE_HOME (or ~/.cache), then "ellm"."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ellm"


def cache_dir(sources: Path) -> str:
    """Where the compiled kernels are cached: one folder per state of this package's sources.
    numba checks a cached function against its own file only, not the files whose functions it
    inlines, so an edit of quant.py left layer.py's cached decode running the old code (once a
    trap: SIGILL). NUMBA_CACHE_DIR, when set, wins."""
    digest = hashlib.sha1(numba.__version__.encode())
    for source in sorted(sources.glob("*.py")):
        digest.update(source.name.encode() + source.read_bytes())
    return str(cache_base() / "numba" / digest.hexdigest()[:16])


class CheckoutLocator(numba.core.caching.UserProvidedCacheLocator):
    """Keeps the kernels' cache entries in CACHE_DIR/kernels wherever this checkout lives: the
    folder already names the sources' digest, so a fresh clone or venv of the same sources loads
    them. numba's own locator adds a hash of the absolute path, and every clone compiled anew."""

    @classmethod
    def get_suitable_cache_subpath(cls, py_file):
        return "kernels"

    @classmethod
    def from_function(cls, py_func, py_file):
        if Path(py_file).resolve().parent != Path(__file__).resolve().parent:
            return None  # not a kernel: numba's locators place it
        return super().from_function(py_func, py_file)


if not os.environ.get("NUMBA_CACHE_DIR"):  # a folder of the user's own is theirs to lay out
    numba.config.CACHE_DIR = cache_dir(Path(__file__).parent)
    numba.core.caching.CacheImpl._locator_classes.insert(0, CheckoutLocator)

# the kernels' cache=True decorators read numba.config.CACHE_DIR: imported after it is set

from ellmd.kernels.activations import silu_mul
from ellmd.kernels.attention import attention_decode, attention_prefill, decode_scratch_shapes, store_kv
from ellmd.kernels.matmul import embed, linear_rows, matmul, prefill_scratch_size
from ellmd.kernels.quant import BLOCK_DTYPES, decode_row, is_blocks
from ellmd.kernels.moe import moe_experts, moe_scratch, route
from ellmd.kernels.norm import rmsnorm, rmsnorm_heads
from ellmd.kernels.rope import rope, rope_tables
