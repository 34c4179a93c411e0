"""Framing: the protocol's byte stream of msgpack maps, one per message, back to back (msgpack is
self-delimiting, so there is no length prefix)."""

from __future__ import annotations

import msgpack

from ellm.errors import BadFrame

MAX_FRAME = 16 * 2**20  # the protocol's default max_frame; `hello` reports the daemon's own
READ_SIZE = 2**16  # bytes asked of the transport per read


def pack(message: dict) -> bytes:
    """One message as bytes (str as msgpack str, bytes as bin)."""
    return msgpack.packb(message, use_bin_type=True)


class FrameDecoder:
    """Turns received bytes into messages.

    `feed` raises `BadFrame` for bytes that are not msgpack, a value that is not a map, or a
    message over `max_frame`: after that the stream has no findable message boundary.
    """

    def __init__(self, max_frame: int = MAX_FRAME):
        # Every feed is drained, so the buffer holds at most one incomplete message plus one read.
        self._unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max_frame + READ_SIZE)
        self.max_frame = max_frame

    def feed(self, data: bytes) -> list[dict]:
        """The messages completed by `data`, in order."""
        try:
            self._unpacker.feed(data)
            messages = list(self._unpacker)
        except msgpack.BufferFull:
            raise BadFrame(f"the daemon sent a message over max_frame ({self.max_frame} bytes)") from None
        except (msgpack.UnpackException, ValueError) as exc:
            raise BadFrame(f"the daemon sent bytes that are not msgpack: {exc}") from None
        for message in messages:
            if not isinstance(message, dict):
                raise BadFrame(f"the daemon sent a {type(message).__name__}, not a map")
        return messages
