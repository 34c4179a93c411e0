"""ellmd: the daemon side of ellm (engine, runtime, servers)."""

from ellmd import compile_cache  # noqa: F401  numba's cache locked across processes before any kernel compiles

__version__ = "0.1.0"
