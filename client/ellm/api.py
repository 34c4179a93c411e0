"""What the blocking and asyncio clients share: the Generation result and request arguments."""

from __future__ import annotations

import os

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

UPLOAD_PIECE = 4 * 2**20  # bytes of a session blob per session.import request, well under max_frame


@dataclass
class Generation:
    """The result of `session.generate` or `session.chat`."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "cancelled"
    tool_calls: list[dict] = field(default_factory=list)
    usage: dict = field(default_factory=dict)  # prompt/prefilled/reused/generated tokens and timings
    logprobs: list[dict] | None = None  # per token {token, logprob, top: [[id, logprob], ...]} when asked

    def json(self):
        """The text parsed as JSON (as a `json_schema` constraint makes it, once finished with "stop")."""
        return json.loads(self.text)

    @classmethod
    def from_result(cls, result: dict) -> Generation:
        return cls(
            text=result.get("text", ""),
            token_ids=result.get("token_ids") or [],
            finish_reason=result.get("finish_reason"),
            tool_calls=result.get("tool_calls") or [],
            usage=result.get("usage") or {},
            logprobs=result.get("logprobs"),
        )


def present(**args) -> dict:
    """The arguments that were given (not None): absent ones take the daemon's defaults."""
    return {k: v for k, v in args.items() if v is not None}


def chat_args(session_id: str, content: str | dict, stream: bool, sampling: dict) -> dict:
    """session.chat arguments: a str is a user message's content, a map is a whole message."""
    message = {"message": content} if isinstance(content, dict) else {"content": content}
    return {"session_id": session_id, **message, **sampling, "stream": stream}


def inject_args(session_id: str, query: str | None, documents: list | None, k: int | None,
                index: str | None, role: str | None) -> dict:
    """rag.inject arguments; a document given as a str is `{text: str}`."""
    if documents is not None:
        documents = [{"text": d} if isinstance(d, str) else d for d in documents]
    return present(session_id=session_id, query=query, documents=documents, k=k, index=index, role=role)


def index_args(path, name: str | None, retriever: str | None) -> dict:
    """rag.index arguments: the daemon reads the folder itself, so the path is made absolute here."""
    return present(path=os.path.abspath(os.fspath(path)), name=name, retriever=retriever)


def progress_data(event: str, data: dict) -> dict | None:
    """Stream item of long work (rag.index): the data of each `progress` event."""
    return data if event == "progress" else None


def token_text(event: str, data: dict) -> str | None:
    """Stream item of a generation: the text of each `token` event."""
    return data.get("text") if event == "token" else None


def chunk_bytes(event: str, data: dict) -> bytes | None:
    """Stream item of session.export: the bytes of each `chunk` event."""
    return data.get("data") if event == "chunk" else None


def upload_pieces(source: bytes | BinaryIO, size: int) -> Iterator[tuple[bytes, bool]]:
    """`(piece, more)` pairs of at most `size` bytes of a session blob, `more` false on the last."""
    read = io.BytesIO(source).read if isinstance(source, (bytes, bytearray, memoryview)) else source.read
    piece = read(size)
    while following := read(size):
        yield piece, True
        piece = following
    yield piece, False
