"""ellm: the client of the ellm daemon (`ellmd`) over its Unix socket.

Layered like pynvim's msgpack-rpc, each layer small: `transport` (the Unix socket, asyncio),
`framing` (the stream of msgpack maps), `rpc` (request ids, events, replies, error replies as
exceptions) and the typed API, written once: `AsyncClient` and `AsyncSession` (asyncio), and
`Client` and `Session`, their blocking form (an event loop on a thread of the client's own). Needs only the standard library and msgpack; the `ellm` command line
(`ellm.cli`) adds typer and rich. PROTOCOL.md is the contract with the daemon.

    from ellm import Client

    with Client() as client:
        session = client.open_session(system="You are terse.")
        print(session.chat("What is the capital of France?").text)
        for delta in session.chat("And of Italy?", stream=True):
            print(delta, end="", flush=True)
"""

__version__ = "0.1.0"  # first: the rpc layer names itself with it in `hello`

from ellm.aio import AsyncClient, AsyncSession  # noqa: E402
from ellm.api import Generation  # noqa: E402
from ellm.client import Client, Session, Stream  # noqa: E402
from ellm.errors import (  # noqa: E402
    BadFrame,
    BadRequest,
    Busy,
    CapacityError,
    Cancelled,
    ConnectionLost,
    DaemonNotRunning,
    EllmError,
    FingerprintError,
    InternalError,
    Leased,
    NotFound,
    ProtocolVersionError,
    RequestTimeout,
    StoreError,
    UnknownOp,
)
from ellm.paths import default_socket_path  # noqa: E402
from ellm.rpc import AsyncStream  # noqa: E402

__all__ = [
    "AsyncClient", "AsyncSession", "AsyncStream", "BadFrame", "BadRequest", "Busy", "CapacityError", "Cancelled",
    "Client", "ConnectionLost", "DaemonNotRunning", "EllmError", "FingerprintError", "Generation", "InternalError",
    "Leased", "NotFound", "ProtocolVersionError", "RequestTimeout", "Session", "StoreError", "Stream", "UnknownOp",
    "default_socket_path",
]
