"""Where the daemon's socket lives. The daemon imports this too, so both sides agree."""

from __future__ import annotations

import os
from pathlib import Path


def default_socket_path() -> Path:
    """The daemon's Unix socket: `$ELLM_SOCKET`, else `$XDG_RUNTIME_DIR/ellm/ellmd.sock`,
    else `/tmp/ellm-<uid>/ellmd.sock`. Empty variables count as unset."""
    if os.environ.get("ELLM_SOCKET"):
        return Path(os.environ["ELLM_SOCKET"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "ellm" / "ellmd.sock"
    return Path(f"/tmp/ellm-{os.getuid()}") / "ellmd.sock"
