"""Multi-turn agent work over the OpenAI-compatible API: time to first token with and without KV reuse.

An agent resends its whole conversation every turn (a long system prompt, then tool results and
replies). Each turn is sent twice through the real `openai` client: as the conversation goes on
(ellm finds the session it extends and prefills only the new turn), and under a fresh session id
(the whole prompt prefilled, what a server without prefix reuse does every turn). The fresh
sessions are deleted afterwards through the daemon's Unix socket.

    .venv/bin/ellmd start --http 127.0.0.1:8080 --detach
    .venv/bin/python scripts/bench_turns.py --url http://127.0.0.1:8080/v1 --system-words 1500 --turns 5
"""

from __future__ import annotations

import argparse
import time
import uuid

from ellm import Client, default_socket_path
from openai import OpenAI
from rich.console import Console
from rich.table import Table

WORDS = ("file", "window", "cursor", "scroll", "button", "menu", "report", "column", "value", "error",
         "screen", "click", "type", "open", "close", "save", "search", "result", "page", "table")


def filler(n: int, seed: int) -> str:
    """n words of tool-output-like text, different for each seed."""
    return " ".join(WORDS[(i * 7 + seed * 13 + i // 5) % len(WORDS)] for i in range(n))


def timed(client, model, messages, max_tokens, session_id) -> tuple[float, str, int, int]:
    """(seconds to the first token, reply, prompt tokens, cached tokens) of one streamed request."""
    start = time.perf_counter()
    first, text, usage = None, [], None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"session_id": session_id})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return (first or time.perf_counter()) - start, "".join(text), usage.prompt_tokens, \
        usage.prompt_tokens_details.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080/v1")
    parser.add_argument("--system-words", type=int, default=1500, help="words of the system prompt")
    parser.add_argument("--turn-words", type=int, default=150, help="words of each tool result")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--socket", default=str(default_socket_path()), help="the daemon's socket, to delete fresh sessions")
    args = parser.parse_args()
    client = OpenAI(base_url=args.url, api_key="none")
    model = client.models.list().data[0].id
    conversation = f"agent-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": "You operate a computer. Tools: " + filler(args.system_words, 0)}]
    table = Table("turn", "prompt tokens", "reused", "TTFT reused (ms)", "TTFT full prefill (ms)", "speed-up",
                  title=f"{model}: time to first token per turn")
    fresh = []
    for turn in range(1, args.turns + 1):
        messages.append({"role": "user", "content": f"Tool result {turn}: " + filler(args.turn_words, turn)})
        fresh.append(f"fresh-{uuid.uuid4().hex[:8]}")
        cold, *_ = timed(client, model, messages, args.max_tokens, fresh[-1])
        warm, reply, prompt, cached = timed(client, model, messages, args.max_tokens, conversation)
        messages.append({"role": "assistant", "content": reply})
        table.add_row(str(turn), str(prompt), str(cached), f"{warm * 1000:.0f}", f"{cold * 1000:.0f}",
                      f"{cold / warm:.1f}x")
    Console().print(table)
    with Client(args.socket) as ellm:
        for session_id in fresh:
            ellm.session(session_id).delete()


if __name__ == "__main__":
    main()
