"""What the example agents share: their command line, and a chat turn that streams its reply and
says how many tokens it prefilled and how many it reused."""

from __future__ import annotations

import argparse
import json

from ellm import default_socket_path


def parser(description: str) -> argparse.ArgumentParser:
    """The options every example takes: --socket, --max-tokens, --json."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--socket", default=str(default_socket_path()), help="the daemon's socket (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per reply (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object summarising the run, not the replies")
    return p


def ask(session, content: str, args) -> dict:
    """One chat turn, streamed to the terminal (silent with --json). Returns the turn's usage."""
    if args.json:
        return session.chat(content, max_tokens=args.max_tokens).usage
    print(f"> {content}")
    stream = session.chat(content, stream=True, max_tokens=args.max_tokens)
    for delta in stream:
        print(delta, end="", flush=True)
    usage = stream.result.usage
    print(f"\n  [prefilled {usage['prefilled_tokens']} tokens, reused {usage['reused_tokens']}, "
          f"generated {usage['generated_tokens']}, first token after {usage['ttft_ms']:.0f} ms]\n")
    return usage


def turn(usage: dict, tokens_before: int, **fields) -> dict:
    """A turn for the --json summary: the session's length before it and what it prefilled and reused."""
    return {**fields, "tokens_before": tokens_before,
            **{k: usage[k] for k in ("prompt_tokens", "prefilled_tokens", "reused_tokens", "generated_tokens")}}


def say(args, text: str) -> None:
    """A progress line for people; --json keeps stdout for the summary alone."""
    if not args.json:
        print(text)


def report(args, summary: dict) -> None:
    if args.json:
        print(json.dumps(summary))
