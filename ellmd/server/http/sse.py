"""Server-sent event streams: OpenAI's data-only events ending in [DONE], and the named events of
the Responses and Messages APIs."""

from __future__ import annotations

import json

from aiohttp import web

from ellmd.server.http.errors import ApiError


class EventStream:
    """A server-sent event response, opened by its first event (so that an error before it is a plain reply)."""

    done: str | None = "[DONE]"  # the data of the last event (None: the stream just ends)

    def __init__(self, request: web.Request, first: dict | None = None, chunk=None, holdback=None):
        self.request, self.first = request, first
        self.chunk = chunk  # chunk(text): the data of the event carrying a piece of text
        self.holdback = holdback  # a tools.Holdback: tool-call markup never goes out as text
        self.headers: dict = {}
        self.response: web.StreamResponse | None = None

    def bind_session(self, session_id: str) -> None:
        """Name the session in the X-Session-Id header (the runtime says it before the first token)."""
        self.headers["X-Session-Id"] = session_id

    async def open(self) -> None:
        if self.response is None:
            self.response = web.StreamResponse(headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache", **self.headers})
            await self.response.prepare(self.request)
            if self.first is not None:
                await self.send(self.first)

    async def send(self, data: dict | str, event: str | None = None) -> None:
        await self.open()
        payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        named = f"event: {event}\n" if event else ""
        await self.response.write(f"{named}data: {payload}\n\n".encode())

    async def content(self, text: str) -> None:
        """A piece of generated text: what the holdback lets through goes out (none yet: the stream opens)."""
        if self.holdback is not None:
            text = self.holdback.push(text)
        if text:
            await self.text(text)
        else:
            await self.open()

    async def rest(self, content: str) -> None:
        """Once generated: what the final content adds to the text sent (after the calls, or a call that did
        not parse)."""
        if self.holdback is not None and (rest := self.holdback.rest(content)):
            await self.text(rest)

    async def text(self, text: str) -> None:
        await self.send(self.chunk(text))

    async def fail(self, error: ApiError) -> None:
        """An error once the stream is open: one last event."""
        await self.send(error.body())
        await self.finish()

    async def finish(self) -> web.StreamResponse:
        if self.done is not None:
            await self.send(self.done)
        await self.response.write_eof()
        return self.response


class NamedEventStream(EventStream):
    """Server-sent events named by their type (the Responses and Messages APIs): opened by start
    events, no [DONE], an error as an `error` event. Their blocks (output items, content blocks)
    are counted by `index`; a text block is opened by its first piece and closed later."""

    done = None

    def __init__(self, request: web.Request, holdback=None):
        super().__init__(request, holdback=holdback)
        self.index = 0  # of the next block
        self.text_open = False

    async def open(self) -> None:
        if self.response is None:
            await super().open()
            await self.started()

    async def started(self) -> None:
        """Send the events that open the stream."""

    def payload(self, kind: str, data: dict) -> dict:
        """The data of an event of this type."""
        return {"type": kind, **data}

    async def event(self, kind: str, data: dict) -> None:
        await self.open()  # the start events come first
        await self.send(self.payload(kind, data), kind)

    async def text(self, text: str) -> None:
        """A piece of the text block (opened by its first piece)."""
        if not self.text_open:
            await self.text_started()
            self.text_open = True
        await self.text_delta(text)

    async def text_started(self) -> None:
        """Send the events that open the text block."""

    async def text_delta(self, text: str) -> None:
        """Send a piece of the text block."""

    async def end_block(self, *events: tuple[str, dict]) -> None:
        """Send a block's last events; the next block takes the next index."""
        for kind, data in events:
            await self.event(kind, data)
        self.index, self.text_open = self.index + 1, False

    def error_data(self, error: ApiError) -> dict:
        """The data of the `error` event."""
        return {"error": error.body()["error"]}

    async def fail(self, error: ApiError) -> None:
        await self.event("error", self.error_data(error))
        await self.finish()
