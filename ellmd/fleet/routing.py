"""Which replica a request goes to: its routing key, Serve's multiplexed id.

A request that names a session (a `session_id` field, an `X-Session-Id` header, a Responses
`previous_response_id`, a response's id in the path) is keyed by that session. A conversation
without one is keyed by a hash of its leading messages (up to its first user message: the system
prompt and the question), so that the turns of one conversation, each resending the whole of it,
meet on the replica whose daemon holds its prefix. Requests that carry no prompt (models, health) have no key.
"""

from __future__ import annotations

import hashlib
import json

from ellmd.server.http.responses import point_of

PREFIX_KEY = "prefix-"  # keys of conversations without a session id
LEADING_CHARS = 2048  # of a plain completion prompt
RESPONSE_PATH = "/v1/responses/"


def routing_key(headers, body, path: str = "") -> str | None:
    """The multiplexed id of a request (headers: case-insensitive mapping; body: its parsed JSON;
    path: the URL's, which names a response in GET and DELETE /v1/responses/{id})."""
    if path.startswith(RESPONSE_PATH) and (point := point_of(path.removeprefix(RESPONSE_PATH))):
        return point[0]
    if not isinstance(body, dict):
        body = {}
    session_id = body.get("session_id") or headers.get("x-session-id")
    if isinstance(session_id, str) and session_id:
        return session_id
    previous = body.get("previous_response_id")
    if isinstance(previous, str) and (point := point_of(previous)):
        return point[0]
    leading = leading_part(body)
    if leading is None:
        return None
    digest = hashlib.blake2b(json.dumps(leading, sort_keys=True).encode(), digest_size=12).hexdigest()
    return PREFIX_KEY + digest


def leading_part(body: dict):
    """What every turn of a conversation resends unchanged at its start (None: not a conversation)."""
    for name in ("messages", "input"):  # chat completions and Anthropic messages; Responses
        items = body.get(name)
        if isinstance(items, list) and items:
            first_user = next((i for i, m in enumerate(items) if isinstance(m, dict) and m.get("role") == "user"),
                              len(items) - 1)
            return [body.get("system"), body.get("instructions"), items[: first_user + 1]]
        if isinstance(items, str):
            return [body.get("instructions"), items[:LEADING_CHARS]]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[:LEADING_CHARS]
    if isinstance(prompt, list) and prompt:
        return prompt[:LEADING_CHARS]
    return None
