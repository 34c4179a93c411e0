"""Question answering over a docs folder with retrieval (RAG).

The daemon indexes the folder itself, incrementally: a second run re-indexes only the files that
changed. For each question the agent injects the k best passages into the session, then asks;
the passages and the earlier answers stay in the KV cache, so each question prefills only its
own passages and words.

    python examples/agents/rag_qa.py --docs examples/agents/docs -q "How much is the Team plan?"
"""

from __future__ import annotations

from pathlib import Path

from ellm import Client

from common import ask, parser, report, say, turn

QUESTIONS = [
    "How do I install Quillbox on a Raspberry Pi?",
    "What happens when two devices edit the same note?",
    "How much does the Team plan cost?",
]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--docs", type=Path, default=Path(__file__).parent / "docs",
                   help="the folder to index (default: the Quillbox docs beside this script)")
    p.add_argument("--index", default="quillbox-docs", help="the index name (default: %(default)s)")
    p.add_argument("-q", "--question", action="append", help="a question (repeatable; default: three about Quillbox)")
    p.add_argument("-k", type=int, default=3, help="passages per question (default: %(default)s)")
    args = p.parse_args()
    with Client(args.socket) as client:
        index = client.rag_index(str(args.docs.resolve()), name=args.index)  # the daemon reads the folder
        say(args, f"index {index['name']}: {index['files_indexed']} files indexed, "
                  f"{index['files_unchanged']} unchanged, {index['chunks']} chunks\n")
        session = client.open_session(title="docs Q&A", system=(
            "Answer the user's question from the context documents only, in one or two sentences."))
        answers = []
        for question in args.question or QUESTIONS:
            injected = session.inject(query=question, k=args.k, index=args.index)
            sources = [passage["source"] for passage in injected["passages"]]
            say(args, f"passages from {', '.join(sources)}: +{injected['tokens_appended']} tokens")
            usage = ask(session, question, args)
            answers.append(turn(usage, injected["tokens"], question=question, sources=sources,
                                tokens_appended=injected["tokens_appended"]))
        report(args, {"session_id": session.id,
                      "index": {k: index[k] for k in ("name", "files", "files_indexed", "files_unchanged", "chunks")},
                      "questions": answers, "tokens": session.info()["tokens"]})


if __name__ == "__main__":
    main()
