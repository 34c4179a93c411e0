"""The protocol's ops, each declared once beside its handler (an Op: name, argument schema,
handler, where it runs, whether its session must be idle), grouped by area:

  base.py        the Op record and the guards handlers share
  sessions.py    open, append, fork, rewind, snapshot, resume, close, release, delete, grant, info, list, export,
                 import, turns
  generation.py  session.generate, session.chat, completion, session.continue, session.point
  context.py     skills and retrieval (skill.*, rag.*)
  admin.py       stats, live, and hello, cancel, shutdown (run by the socket server on the connection)

OPS is every op by name; RUNTIME_OPS those the Runtime runs (on its engine thread or aside).
"""

from __future__ import annotations

from ellmd.runtime.ops import admin, context, generation, sessions
from ellmd.runtime.ops.base import Op

OPS: dict[str, Op] = {op.name: op for area in (sessions, generation, context, admin) for op in area.OPS}
RUNTIME_OPS: dict[str, Op] = {name: op for name, op in OPS.items() if op.runs != "connection"}

__all__ = ["OPS", "RUNTIME_OPS", "Op"]
