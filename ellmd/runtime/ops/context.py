"""Ops on what sessions load: skills and retrieval indexes.

Handlers as in ops/sessions.py. Ops that run aside never touch the engine or the sessions and run
beside the engine thread, on a "write" or a "read" thread (SkillLibrary and RagLibrary are
thread-safe), so that indexing a folder never delays a decode step, nor a listing waits for an
index run.
"""

from __future__ import annotations

from pathlib import Path

from ellmd.runtime import schemas as s
from ellmd.runtime.errors import ProtocolError
from ellmd.runtime.ops.base import APPENDED, INDEX, TURN, Op
from ellmd.runtime.steps import after
from ellmd.runtime.turns import usage


def skill_list(rt, request):
    return {"skills": rt.skills.list() if rt.skills else []}


def skill_load(rt, request, session_id, name, force=False, role=None, file=None):
    session = rt.residency.session(session_id, request.owner)
    if rt.skills is None:
        raise ProtocolError("not_found", "no skill roots are configured (--skills-dir)")
    skill = rt.skills.get(name)
    key = skill.name if file is None else f"{skill.name}/{file}"
    if key in session.skills and not force:
        return {"skill": skill.name, "file": file, "loaded": False, "tokens_appended": 0,
                "tokens": session.length, "usage": usage(request, session)}
    message = {"role": rt.turns.role(role), "content": skill.message(file)}

    def loaded(result):
        session.skills.append(key)
        return {"skill": skill.name, "file": file, "loaded": True, **result}
    return after(rt.turns.append_message(request, session, message, kind="skill", name=key), loaded)


def rag_library(rt):
    if rt.rag is None:
        raise ProtocolError("not_found", "retrieval is not configured on this daemon")
    return rt.rag


def rag_index(rt, request, path, name="default", retriever=None):
    """Index a folder (aside: indexing never delays a generation)."""
    def progress(data):
        if request.emit:
            request.emit("progress", data)
    return rag_library(rt).index(Path(path), name=name, retriever=retriever, progress=progress,
                                 cancelled=request.cancelled)


def rag_list(rt, request):
    return {"indexes": rag_library(rt).list()}


def rag_remove(rt, request, name):
    return rag_library(rt).remove(name)


def rag_inject(rt, request, session_id, documents=None, query=None, k=None, index="default", role=None):
    session = rt.residency.session(session_id, request.owner)
    if query is not None:
        k = rt.rag_k if k is None else k
        passages = [p.to_dict() for p in rag_library(rt).search(query, k=k, name=index)]
        if not passages:
            return {"passages": [], "tokens_appended": 0, "tokens": session.length, "usage": usage(request, session)}
    else:
        passages = [{"text": d} if isinstance(d, str) else {k: v for k, v in d.items() if v is not None}
                    for d in documents]
    body = "\n\n".join(f"[{i + 1}] {d.get('source') or 'document'}\n{d['text'].strip()}" for i, d in enumerate(passages))
    message = {"role": rt.turns.role(role), "content": "Context passages:\n\n" + body}
    return after(rt.turns.append_message(request, session, message, kind="rag", name=query),
                 lambda result: {"passages": passages, **result})


OPS = (
    Op("skill.list", s.NoArgs, skill_list, "context", runs="read", reply=("skills",)),
    Op("skill.load", s.SkillLoad, skill_load, "context", idle=True, reply=("skill", "file", "loaded", *APPENDED),
       errors=TURN),
    Op("rag.index", s.RagIndex, rag_index, "context", runs="write",
       reply=("name", "path", "retriever", "files", "files_indexed", "files_unchanged", "files_removed",
              "files_skipped", "chunks", "seconds"), errors=("not_found",)),
    Op("rag.list", s.NoArgs, rag_list, "context", runs="read", reply=("indexes",), errors=("not_found",)),
    Op("rag.remove", s.RagRemove, rag_remove, "context", runs="write", reply=INDEX, errors=("not_found",)),
    Op("rag.inject", s.RagInject, rag_inject, "context", idle=True, reply=("passages", *APPENDED), errors=TURN),
)
