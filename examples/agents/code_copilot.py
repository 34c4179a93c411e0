"""A code copilot that reads a repository folder into a session and answers questions about it.

The files most relevant to the questions are injected once, as documents with their relative
paths as sources; every question after that prefills only its own tokens, since the files and
the earlier answers are already in the session's KV cache.

    python examples/agents/code_copilot.py --repo client/ellm -q "How do I resume a session?"
"""

from __future__ import annotations

import re
from pathlib import Path

import ellm
from ellm import Client

from common import ask, parser, report, say, turn

QUESTIONS = [
    "Which method opens a new session, and what does it return?",
    "How does a streamed chat hand back its usage once it ends?",
]
SUFFIXES = {".py", ".md", ".toml", ".txt", ".rst"}


def relevance(text: str, wanted: set[str]) -> float:
    """The share of the file's words that occur in the questions (a density, so size does not win)."""
    found = re.findall(r"[a-z_]{4,}", text.lower())
    return sum(w in wanted for w in found) / (len(found) or 1)


def pick_files(repo: Path, questions: list[str], count: int, max_chars: int) -> list[tuple[str, str]]:
    """(relative path, text) of the `count` files most relevant to the questions, each cut to its
    share of `max_chars` so that the whole fits the session."""
    wanted = set(re.findall(r"[a-z_]{4,}", " ".join(questions).lower()))
    files = [p for p in sorted(repo.rglob("*")) if p.is_file() and p.suffix in SUFFIXES
             and not any(part.startswith(".") for part in p.relative_to(repo).parts)]
    texts = {p: p.read_text(encoding="utf-8", errors="replace") for p in files}
    ranked = sorted(files, key=lambda p: relevance(texts[p], wanted), reverse=True)[:count]
    return [(p.relative_to(repo).as_posix(), texts[p][: max_chars // count]) for p in ranked]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repo", type=Path, default=Path(ellm.__file__).parent,
                   help="the folder (default: the ellm client package)")
    p.add_argument("-q", "--question", action="append", help="a question (repeatable; default: two about the client)")
    p.add_argument("--files", type=int, default=3, help="how many files to inject (default: %(default)s)")
    p.add_argument("--max-chars", type=int, default=6000, help="characters injected in all (default: %(default)s)")
    args = p.parse_args()
    questions = args.question or QUESTIONS
    with Client(args.socket) as client:
        session = client.open_session(title=f"copilot: {args.repo.resolve().name}", system=(
            "You are a code assistant. Answer from the repository files you are given and name the file."))
        files = pick_files(args.repo, questions, args.files, args.max_chars)
        injected = session.inject(documents=[{"text": text, "source": path} for path, text in files])
        say(args, f"injected {', '.join(path for path, _ in files)}: +{injected['tokens_appended']} tokens\n")
        turns, tokens = [], injected["tokens"]
        for question in questions:
            usage = ask(session, question, args)
            turns.append(turn(usage, tokens, question=question))
            tokens = session.info()["tokens"]
        report(args, {"session_id": session.id, "files": [path for path, _ in files],
                      "tokens_appended": injected["tokens_appended"], "turns": turns, "tokens": tokens})


if __name__ == "__main__":
    main()
