"""ellmd: the daemon side of ellm (engine, runtime, servers)."""

__version__ = "0.1.0"
