"""The runtime: sessions resident in KV slots, one engine thread, LMDB snapshots.

One engine thread owns the Engine. Requests arrive on a queue; between two batched decode steps
(one forward over every generating session) the thread runs queued requests (appends, which
prefill, and every other op). Handlers on other threads never touch arrays: they submit a request
and wait on its future. At most `slots` sessions are resident; when another is needed, the least
recently used idle one is snapshotted and its slot reused.

Arguments are validated at `submit` (schemas.py) before a request is queued, so handlers see only
well-typed values. A request that fails is answered with its error (`protocol_error` maps
exceptions to PROTOCOL.md codes) and leaves its session as it found it (`_restore`); a generation
that fails ends alone (`_fail`); the loop itself failing snapshots every session first (`run`).
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ellmd.engine.sampling import Sampler, SamplingParams
from ellmd.errors import BadRequest, CapacityError, EllmError
from ellmd.runtime import schemas
from ellmd.runtime.retrieval import RetrievalError
from ellmd.runtime.session import Session
from ellmd.runtime.store import Store, StoreError
from ellmd.text import IncrementalDetokenizer, StopMatcher, TemplateError, detect_format, parse_tool_calls

log = logging.getLogger("ellmd.runtime")


class RuntimeError_(EllmError):
    """An error with a protocol error code (PROTOCOL.md)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class SlotsBusy(Exception):
    """Every slot holds a generating session: the request waits for one to finish."""


# Ops that never touch the engine run beside it (SkillLibrary and RagLibrary are thread-safe), so
# that indexing a folder never delays a decode step: those that write an index on one thread, those
# that read on another, so that a listing never waits for an index run.
ASIDE_OPS = {"rag.index": "write", "rag.remove": "write", "rag.list": "read", "skill.list": "read"}
ANONYMOUS = "anonymous"  # the tag of sessions made by completion requests that named none


def not_found(session_id) -> RuntimeError_:
    return RuntimeError_("not_found", f"no session {session_id!r}")


def protocol_error(e: Exception) -> RuntimeError_:
    """The one table from exceptions to PROTOCOL.md's error codes (EllmError subclasses carry theirs)."""
    if isinstance(e, RuntimeError_):
        return e
    if isinstance(e, TemplateError):
        return RuntimeError_("bad_request", str(e))
    if isinstance(e, RetrievalError):  # an unknown index, unless it says otherwise
        return RuntimeError_(e.__dict__.get("code", "not_found"), str(e))
    if isinstance(e, EllmError):
        return RuntimeError_(getattr(e, "code", "internal"), str(e))
    return RuntimeError_("internal", f"{type(e).__name__}: {e}")


def reply(request, result=None, error: Exception | None = None) -> None:
    """Resolve a request's future once (a request answered already, e.g. at shutdown, stays so)."""
    try:
        if error is not None:
            request.future.set_exception(protocol_error(error))
        else:
            request.future.set_result(result)
    except concurrent.futures.InvalidStateError:  # answered already (stop answers aside ops at once)
        pass


@dataclass
class Request:
    op: str
    args: dict
    emit: object = None  # emit(event, data), called from the engine thread
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    received: float = field(default_factory=time.perf_counter)
    owner: str | None = None  # set by the HTTP layer: sessions stored with another owner are not found
    prefilled: int = 0  # tokens this request ran through the model
    reused: int | None = None  # tokens already computed when it first touched the session


@dataclass
class Generation:
    """A generating session between decode steps."""

    request: Request
    session: Session
    sampler: Sampler
    params: SamplingParams
    stream: bool
    logprobs: int  # top log-probabilities to report per generated token (0: none)
    detok: IncrementalDetokenizer
    stopper: StopMatcher
    start: int  # session length when generation began (after the prompt)
    usage: dict
    next_token: int = -1
    generated: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    token_logprobs: list[dict] = field(default_factory=list)
    first_token_at: float | None = None
    restore: tuple = ()  # the session before the op (Runtime._before): a failure goes back to it


class Runtime:
    """Sessions over an Engine and a Store, served by one engine thread."""

    def __init__(self, engine, store: Store, skills=None, rag=None, rag_k: int = 4,
                 snapshot_every_turn: bool = True, context_role: str = "user"):
        self.engine = engine
        self.store = store
        self.skills = skills  # SkillLibrary
        self.rag = rag  # RagLibrary
        self.rag_k = rag_k  # passages per query by default
        self.snapshot_every_turn = snapshot_every_turn
        self.context_role = context_role  # the role of skill and document messages
        template = engine.chat_template
        self.tool_format = detect_format(template.source) if template else None
        self.sessions: dict[str, Session] = {}
        self.slots: list[Session | None] = [None] * engine.kv.slots
        self.queue: queue.Queue[Request | None] = queue.Queue()
        self.active: list[Generation] = []
        self.waiting: list[Request] = []  # requests that need a slot while every slot is generating
        self.started = time.time()
        self.fingerprint = model_fingerprint(engine)
        self.counters = {"prefilled": 0, "reused": 0, "generated": 0}
        self.observers: list = []  # callables given the final usage of every generation (engine thread)
        self._thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self._aside = {kind: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"aside-{kind}")
                       for kind in ("write", "read")}
        self._aside_pending: dict[int, Request] = {}  # aside requests waiting or running
        self._stopped = threading.Event()
        self._closed = False  # set once shutdown begins: later requests are cancelled at once

    # ---- called from other threads ----------------------------------------------------------

    def start(self) -> None:
        """Run the engine loop on a thread of its own (see `run`)."""
        self._thread.start()

    def submit(self, op: str, args: dict, emit=None) -> Request:
        """Queue a request; its future resolves to the result dict (or raises RuntimeError_).

        The arguments are validated here, against the op's schema (schemas.py), before anything
        runs: a bad request is answered at once and changes nothing.
        """
        request = Request(op, {}, emit)
        try:
            if op not in schemas.OPS:
                raise RuntimeError_("unknown_op", f"unknown op {op!r}")
            request.args = schemas.validate(op, args, self.engine.spec.vocab_size)
            request.owner = request.args.pop("owner", None)
            if self._closed:
                raise RuntimeError_("cancelled", "the daemon is shutting down")
        except (RuntimeError_, BadRequest) as e:
            reply(request, error=e)
            return request
        except Exception as e:  # a bug in validation: this request fails, nothing else
            log.exception("validating %s failed", op)
            reply(request, error=e)
            return request
        if op in ASIDE_OPS:
            self._aside_pending[id(request)] = request
            self._aside[ASIDE_OPS[op]].submit(self._run_aside, request)
        else:
            self.queue.put(request)
        return request

    def stop(self, timeout: float | None = None) -> None:
        """End generations cleanly, snapshot every resident session, end the engine loop.

        Aside ops still waiting are dropped and those running cancelled (an index run stops at its
        next file, leaving the index as it was), all answered `cancelled` now."""
        self.queue.put(None)
        self._stopped.wait(timeout)
        for pool in self._aside.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for request in list(self._aside_pending.values()):
            request.cancelled.set()
            reply(request, error=RuntimeError_("cancelled", "the daemon is shutting down"))

    def _run_aside(self, request: Request) -> None:
        try:
            self._handle(request)
        finally:
            self._aside_pending.pop(id(request), None)

    # ---- the engine thread ------------------------------------------------------------------

    def run(self) -> None:
        """The engine loop, on the calling thread, until `stop`.

        The daemon runs it on its main thread, the one that loaded the model and warmed the kernels
        up: with numba's OpenMP layer, parallel kernels launched from any other thread than the
        first to launch one pay ~0.1 ms per launch, which halved the decode speed.

        A failure of one request or generation ends only that one (see _handle and _fail). Should
        the loop itself fail, every session is snapshotted and every waiting request answered
        before the error goes up (the daemon then exits non-zero).
        """
        try:
            self._loop()
        except BaseException as e:
            log.critical("the engine loop failed; snapshotting every session", exc_info=e)
            self._shutdown()
            raise EllmError(f"the engine loop failed ({type(e).__name__}: {e}); sessions were snapshotted") from e
        finally:
            self._closed = True
            self._stopped.set()

    def _loop(self) -> None:
        while True:
            self._retry_waiting()
            try:
                request = self.queue.get(block=not self.active)
            except queue.Empty:
                request = False
            if request is None:
                break
            if request:
                self._handle(request)
                continue  # drain the queue before the next decode step
            self._decode_step()
        self._shutdown()

    def _retry_waiting(self) -> None:
        """Run the requests that waited for a slot, once one may be free (in arrival order)."""
        if self.waiting and any(s is None or not s.busy for s in self.slots):
            waiting, self.waiting = self.waiting, []
            for request in waiting:
                if request.cancelled.is_set():
                    reply(request, error=RuntimeError_("cancelled", "cancelled while waiting for a slot"))
                else:
                    self._handle(request)

    def _handle(self, request: Request) -> None:
        """Run one validated request; any failure becomes its error reply, never the loop's."""
        handler = getattr(self, "op_" + request.op.replace(".", "_"))
        try:
            result = handler(request, **request.args)
            if result is not None:  # generations resolve later
                reply(request, result)
        except SlotsBusy:
            self.waiting.append(request)
        except Exception as e:
            if not isinstance(e, EllmError):  # a bug: report it with its request, keep serving
                log.exception("op %s failed (args %s)", request.op, brief(request.args))
            reply(request, error=e)

    def _shutdown(self) -> None:
        """Finish generations, snapshot every resident session (each on its own: one failure does
        not stop the others) and answer every request still waiting."""
        self._closed = True
        for gen in list(self.active):
            try:
                self._finish(gen, "cancelled")
            except Exception as e:
                self._fail(gen, e)
        for session in self.slots:
            if session is not None:
                try:
                    self._snapshot(session)
                except Exception:
                    log.exception("shutdown: snapshot of session %s failed", session.session_id)
        while not self.queue.empty():
            self.waiting.append(self.queue.get_nowait())
        for request in self.waiting:
            if request:
                reply(request, error=RuntimeError_("cancelled", "the daemon is shutting down"))
        self.waiting = []

    # ---- sessions and slots -----------------------------------------------------------------

    def _session(self, session_id: str, owner: str | None = None) -> Session:
        """The session named by a request (loaded from the store if need be). A session stored
        with an owner is found only by that owner's requests, or by requests without one."""
        session = self.sessions.get(session_id)
        if session is None:
            meta = self.store.get_meta(session_id)
            if meta is None:
                raise not_found(session_id)
            if not visible(meta.get("owner"), owner):
                raise not_found(session_id)
            self._check_fingerprint(meta)
            session = Session.from_stored(meta, [])
            session.stored_tokens = meta["tokens"]
            session.tokens = None  # loaded with the KV on resume
            self.sessions[session_id] = session
        if not visible(session.owner, owner):
            raise not_found(session_id)
        return session

    def _check_fingerprint(self, meta: dict) -> None:
        check_fingerprint(self.fingerprint, meta)

    def _resident(self, session: Session) -> int:
        """Make a session resident and return its slot (evicting the LRU idle session if needed).

        A stored session whose KV does not load whole (a missing or damaged chunk, a length that is
        not its tokens') raises StoreError and takes no slot.
        """
        if session.slot is not None:
            session.last_used = time.monotonic()
            return session.slot
        slot = self._free_slot()
        engine = self.engine
        engine.rewind(slot, 0)
        if session.tokens is None or session.stored_tokens:
            meta, tokens = self.store.load(session.session_id, lambda start, data: engine.import_kv(slot, start, data),
                                           bytes_per_token=engine.kv.bytes_per_token)
            if int(engine.kv.lengths[slot]) != len(tokens):
                engine.rewind(slot, 0)
                raise StoreError(f"session {session.session_id} is damaged: its KV covers "
                                 f"{int(engine.kv.lengths[slot])} of its {len(tokens)} tokens")
            session.tokens = tokens
            session.stored_tokens = len(tokens)
        session.slot = slot
        self.slots[slot] = session
        session.last_used = time.monotonic()
        return slot

    def _free_slot(self) -> int:
        for slot, owner in enumerate(self.slots):
            if owner is None:
                return slot
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            raise SlotsBusy()
        victim = min(idle, key=lambda s: s.last_used)
        self._snapshot(victim)
        slot, victim.slot = victim.slot, None
        self.slots[slot] = None
        log.info("evicted session %s from slot %d", victim.session_id, slot)
        return slot

    def _snapshot(self, session: Session) -> dict:
        """Write a session's changed chunks and metadata. A session that is generating is written
        as of its last whole turn (the generation's tokens join the next snapshot)."""
        gen = next((g for g in self.active if g.session is session), None)
        tokens = session.tokens if gen is None else session.tokens[:gen.start]
        if tokens is None or (not session.dirty and session.stored_tokens == len(tokens) and gen is None):
            return {"chunks_written": 0, "bytes_written": 0, "stored_tokens": session.stored_tokens}
        meta = session.stored_meta()
        if gen is not None:  # during a generation, pending tokens are in the KV already
            meta["pending"] = []
        slot = session.slot

        def export(start, stop):
            if slot is None:
                raise CapacityError(f"session {session.session_id} is not resident")
            return self.engine.export_kv(slot, start, stop)

        result = self.store.snapshot(meta, tokens, export, session.stored_tokens, self.engine.kv.bytes_per_token)
        session.stored_tokens = result["stored_tokens"]
        session.dirty = gen is not None  # the generation's turn is still to be written
        return result

    def _after_turn(self, session: Session) -> None:
        if self.snapshot_every_turn:
            self._snapshot(session)

    def _prefill(self, request: Request, session: Session, new_tokens: list[int], need_logits: bool):
        """Append tokens (after the session's pending ones) to its KV; returns last logits or None."""
        if session.length + len(new_tokens) > self.engine.kv.sequence_length:  # before it takes a slot
            raise CapacityError(
                f"session {session.session_id} holds {session.length} tokens; adding {len(new_tokens)} "
                f"would exceed the sequence length {self.engine.kv.sequence_length}"
            )
        slot = self._resident(session)
        if request.reused is None:
            request.reused = len(session.tokens)
            self.counters["reused"] += request.reused
        tokens = session.pending + list(new_tokens)
        if not tokens:
            if not need_logits:
                return None
            if not session.tokens:
                raise RuntimeError_("bad_request", f"session {session.session_id} is empty: append something first")
            # Nothing new: recompute the last position's logits by running its token again.
            tokens = [session.tokens.pop()]
            self.engine.rewind(slot, len(session.tokens))
            request.reused = min(request.reused, len(session.tokens))
        logits = self.engine.prefill(slot, tokens, logits="last" if need_logits else "none")
        session.tokens.extend(tokens)
        session.pending = []
        request.prefilled += len(tokens)
        self.counters["prefilled"] += len(tokens)
        return logits

    # ---- generation -------------------------------------------------------------------------

    def _start_generation(self, request: Request, session: Session, sampling: dict, prompt=None,
                          restore: tuple | None = None) -> None:
        """Prefill the generation prompt (rendered, or the given tokens) and start decoding.

        restore: the session before the op (`_before`); if the generation fails, from its prompt to
        its last token, the session goes back to it (default: as it is now).
        """
        if session.busy:
            raise RuntimeError_("busy", f"session {session.session_id} is generating")
        restore = restore or self._before(session)
        stream = sampling.pop("stream", True)
        logprobs = sampling.pop("logprobs", 0)
        params = SamplingParams(**sampling)
        start = session.length  # the turn opens with the generation prompt
        try:
            logits = self._prefill_prompt(request, session, prompt)
        except SlotsBusy:
            raise
        except Exception:
            self._restore(session, restore)
            raise
        gen = Generation(
            request=request, session=session, sampler=Sampler(params, session.tokens), params=params,
            stream=stream, logprobs=logprobs, detok=IncrementalDetokenizer(self.engine.tokenizer, skip_special_tokens=True),
            stopper=StopMatcher(params.stop), start=start, usage=self._usage(request, session), restore=restore,
        )
        session.busy = True
        self.active.append(gen)
        try:
            self._accept(gen, gen.sampler(logits), logits)
        except Exception as e:
            self._fail(gen, e)

    def _prefill_prompt(self, request: Request, session: Session, prompt):
        """Prefill the generation prompt; returns the logits of its last position."""
        if prompt is None and self.engine.chat_template is not None and session.messages:
            text = self.engine.chat_template.render_fragment(
                session.messages, [], tools=session.tools, add_generation_prompt=True, allow_rewrite=True)
            prompt = self.engine.tokenizer.encode(text)
        prompt = prompt or []
        if session.length + len(prompt) + 1 > self.engine.kv.sequence_length:
            raise CapacityError(
                f"session {session.session_id} holds {session.length} tokens: no room left to generate "
                f"within the sequence length {self.engine.kv.sequence_length}"
            )
        return self._prefill(request, session, prompt, need_logits=True)

    def _fail(self, gen: Generation, error: Exception) -> None:
        """End one generation that raised: the session goes back to where the op found it, the
        request gets the error (internal unless it is the client's), every other generation goes on."""
        request, session = gen.request, gen.session
        if not isinstance(error, EllmError):
            log.error("generation failed: op %s, session %s, args %s", request.op, session.session_id,
                      brief(request.args), exc_info=error)
            error = RuntimeError_("internal", f"{request.op}: the generation failed: {type(error).__name__}: {error}")
        if gen in self.active:
            self.active.remove(gen)
        session.busy = False
        try:
            self._restore(session, gen.restore)
            self._after_turn(session)
        except Exception:
            log.exception("session %s: restoring after a failed generation failed", session.session_id)
        reply(request, error=error)

    @staticmethod
    def _before(session: Session) -> tuple:
        """What _restore needs to put a session back as it is now."""
        return session.length, len(session.messages), session.updated

    def _restore(self, session: Session, restore: tuple) -> None:
        """Put a session back as it was before a failed op (`_before`): a cut, no recompute."""
        length, messages, updated = restore
        if session.tokens is None:
            return
        if length < session.length:
            session.truncate(length)
        del session.messages[messages:]
        session.updated = updated
        if session.slot is not None:
            self.engine.rewind(session.slot, min(len(session.tokens), int(self.engine.kv.lengths[session.slot])))

    def _accept(self, gen: Generation, token: int, logits) -> None:
        """Take a sampled token: stream its text, then finish or keep it for the next decode step."""
        gen.first_token_at = gen.first_token_at or time.perf_counter()
        if gen.logprobs:
            gen.token_logprobs.append(top_logprobs(logits, token, gen.logprobs))
        gen.sampler.accept(token)
        gen.generated.append(token)
        self.counters["generated"] += 1
        self._emit(gen, gen.stopper.push(gen.detok.push(token)), [token])
        stops = set(gen.params.stop_token_ids)
        if not gen.params.ignore_eos:
            stops |= set(self.engine.spec.eos_token_id)
        if token in stops or gen.stopper.hit:
            self._finish(gen, "stop")
        elif len(gen.generated) >= gen.params.max_tokens or gen.session.length + 1 >= self.engine.kv.sequence_length:
            self._finish(gen, "length")
        elif gen.request.cancelled.is_set():
            self._finish(gen, "cancelled")
        else:
            gen.next_token = token

    def _emit(self, gen: Generation, text: str, token_ids: list[int]) -> None:
        if text:
            gen.text.append(text)
            if gen.stream and gen.request.emit:
                gen.request.emit("token", {"text": text, "token_ids": token_ids})

    def _decode_step(self) -> None:
        """One forward over every generating session; a failure ends the generations it touched."""
        gens = list(self.active)
        try:
            logits = self.engine.decode([g.session.slot for g in gens], [g.next_token for g in gens])
        except Exception as e:
            for gen in gens:
                self._fail(gen, e)
            return
        for gen, row in zip(gens, logits):
            try:
                gen.session.tokens.append(gen.next_token)
                self._accept(gen, gen.sampler(row), row)
            except Exception as e:
                self._fail(gen, e)

    def _finish(self, gen: Generation, reason: str) -> None:
        """End a generation: close the assistant turn as the template would, log it, reply."""
        self.active.remove(gen)
        session = gen.session
        self._emit(gen, gen.stopper.push(gen.detok.flush()) + gen.stopper.flush(), [])
        text = "".join(gen.text)
        # The last sampled token is not in the KV yet: it joins the next prefill, with the turn's end.
        session.pending = [gen.generated[-1]]
        messages_before = len(session.messages)
        tool_calls = []
        template = self.engine.chat_template
        if template is not None and session.messages:
            generated_text = self.engine.tokenizer.decode(gen.generated)
            session.pending += self.engine.tokenizer.encode(template.end_of_turn(generated_text))
            message = {"role": "assistant", "content": text}
            if self.tool_format:
                content, tool_calls = parse_tool_calls(text, self.tool_format, session.tools)
                if tool_calls:
                    message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
            session.messages.append(message)
        session.add_turn("generation", gen.start, role="assistant", messages=messages_before)
        session.busy = False
        now = time.perf_counter()
        count = len(gen.generated)
        usage = {**gen.usage, "generated_tokens": count,
                 "ttft_ms": round((gen.first_token_at - gen.request.received) * 1000, 2),
                 "decode_tok_s": round((count - 1) / (now - gen.first_token_at), 2) if count > 1 else None}
        try:
            self._after_turn(session)
        except StoreError as e:  # the generation itself succeeded; the next snapshot retries
            log.error("snapshot after generation failed: %s", e)
        for observe in self.observers:
            try:
                observe(usage)
            except Exception:
                log.exception("usage observer failed")
        gen.request.future.set_result({
            "session_id": session.session_id, "text": text, "token_ids": gen.generated,
            "finish_reason": reason, "tool_calls": tool_calls, "usage": usage,
            **({"content": session.messages[-1]["content"]} if tool_calls else {}),
            **({"logprobs": gen.token_logprobs} if gen.logprobs else {}),
        })

    # ---- ops: each runs on the engine thread and returns the reply's result -----------------

    def op_session_open(self, request, title=None, tags=None, system=None, tools=None):
        session = Session.new(self.fingerprint, title or "", tags, tools, owner=request.owner)
        session.tokens = []
        try:
            if system is not None:  # may wait for a slot (SlotsBusy): register the session only after
                self._append_message(request, session, {"role": "system", "content": system})
            else:
                self._after_turn(session)
        except BaseException:  # no ghost: a session that failed to open holds no slot
            if session.slot is not None:
                self.slots[session.slot], session.slot = None, None
            raise
        self.sessions[session.session_id] = session
        return session.info(resident=session.slot is not None)

    def op_session_append(self, request, session_id, message=None, text=None, tokens=None):
        session = self._session(session_id, request.owner)
        if message is not None:
            return self._append_message(request, session, message)
        if text is not None:
            return self._append(request, session, "text", self.engine.tokenizer.encode(text))
        return self._append(request, session, "tokens", tokens)

    def op_session_generate(self, request, session_id, **sampling):
        self._start_generation(request, self._session(session_id, request.owner), sampling)

    def op_session_chat(self, request, session_id, content=None, message=None, **sampling):
        session = self._session(session_id, request.owner)
        if session.busy:
            raise RuntimeError_("busy", f"session {session_id} is generating")
        before = self._before(session)
        self._append_message(request, session, message if message is not None else {"role": "user", "content": content})
        self._start_generation(request, session, sampling, restore=before)

    def op_completion(self, request, tokens, session_id=None, messages=None, tools=None, **sampling):
        """Generate after a whole prompt, reusing the KV of its longest prefix already computed.

        With session_id, that session (created if new) is rewound to the common prefix; without, the
        resident anonymous session sharing the longest prefix is continued (see _anonymous_session),
        so plain OpenAI clients get incremental prefill too.
        """
        if len(tokens) + 1 > self.engine.kv.sequence_length:
            raise CapacityError(f"the prompt holds {len(tokens)} tokens: no room left to generate within "
                                f"the sequence length {self.engine.kv.sequence_length}")
        owner = request.owner
        session = self._bound_session(session_id, owner) if session_id is not None else self._anonymous_session(tokens, owner)
        if session.busy:
            raise RuntimeError_("busy", f"session {session.session_id} is generating")
        slot = self._resident(session)
        self.sessions.setdefault(session.session_id, session)  # new sessions once they hold a slot
        # Keep the longest common prefix that is in the KV (pending tokens are not), and at least
        # one prompt token to run, whose logits start the generation.
        keep = min(common_prefix(session.tokens, tokens), len(tokens) - 1)
        if keep < len(session.tokens) or session.pending:
            session.truncate(keep)
            self.engine.rewind(slot, keep)
        session.messages, session.tools = list(messages or []), tools
        if request.emit and sampling.get("stream", True):  # the caller may not know which session it got
            request.emit("session", {"session_id": session.session_id})
        self._start_generation(request, session, sampling, prompt=tokens[keep:])

    def _bound_session(self, session_id: str, owner: str | None) -> Session:
        if session_id in self.sessions or self.store.get_meta(session_id) is not None:
            return self._session(session_id, owner)
        session = Session.new(self.fingerprint, title=session_id, owner=owner)
        session.session_id, session.tokens = session_id, []
        return session

    def _anonymous_session(self, tokens: list[int], owner: str | None) -> Session:
        """The anonymous session to continue: the resident one (of the same owner) sharing the
        longest prefix, or a new one."""
        shared, best = max(((common_prefix(s.tokens, tokens), s) for s in self.slots
                            if s is not None and not s.busy and ANONYMOUS in s.tags and s.owner == owner),
                           key=lambda pair: pair[0], default=(0, None))
        free = self.slots.index(None) if None in self.slots else None
        if shared and shared == len(best.tokens):
            return best  # the prompt extends that conversation
        if shared and free is None and 2 * shared >= len(best.tokens):
            return best  # most of it is shared (a retry, an edited turn) and no slot to fork into: drop its tail
        shared = shared if free is not None else 0  # else a new session, in the slot of the LRU idle one
        session = Session.new(self.fingerprint, title="anonymous", tags=[ANONYMOUS], owner=owner)
        session.tokens = []
        if shared:  # fork the shared part into the free slot: a memory copy, no recomputation
            self.engine.copy_slot(best.slot, free)
            self.engine.rewind(free, shared)
            session.tokens, session.slot = best.tokens[:shared], free
            self.slots[free] = session
        return session

    def op_session_fork(self, request, session_id, title=None):
        source = self._session(session_id, request.owner)
        if source.busy:
            raise RuntimeError_("busy", f"session {session_id} is generating")
        if source.slot is not None:
            self._snapshot(source)
        fork = Session.new(self.fingerprint, title or f"fork of {source.title or source.session_id}",
                           source.tags, source.tools, owner=source.owner)
        for name in ("pending", "turns", "messages", "skills"):
            setattr(fork, name, copy.deepcopy(getattr(source, name)))
        self.store.copy(source.session_id, fork.session_id, fork.stored_meta())
        fork.tokens, fork.stored_tokens, fork.dirty = None, source.stored_tokens, False
        self.sessions[fork.session_id] = fork
        return fork.info(resident=False)

    def op_session_rewind(self, request, session_id, turn=None, tokens=None):
        session = self._session(session_id, request.owner)
        if session.busy:
            raise RuntimeError_("busy", f"session {session_id} is generating")
        if turn is not None:
            if not turn < len(session.turns):
                raise RuntimeError_("not_found", f"session {session_id} has no turn {turn!r}")
            length = session.turns[turn]["start"]
        else:
            if not tokens <= session.length:
                raise RuntimeError_("bad_request", f"tokens must be in [0, {session.length}]")
            length = tokens
        slot = self._resident(session)
        session.truncate(length)
        self.engine.rewind(slot, len(session.tokens))
        self._after_turn(session)
        return session.info(resident=True)

    def op_session_snapshot(self, request, session_id):
        session = self._session(session_id, request.owner)
        began = time.perf_counter()
        session.dirty = True  # an explicit snapshot always rewrites the metadata
        result = self._snapshot(session)
        return {**result, "ms": round((time.perf_counter() - began) * 1000, 2)}

    def op_session_resume(self, request, session_id):
        session = self._session(session_id, request.owner)
        began = time.perf_counter()
        self._resident(session)
        return {"session_id": session_id, "tokens": session.length, "ms": round((time.perf_counter() - began) * 1000, 2)}

    def op_session_close(self, request, session_id):
        session = self._session(session_id, request.owner)
        if session.busy:
            raise RuntimeError_("busy", f"session {session_id} is generating")
        snapshotted = session.slot is not None
        if snapshotted:
            self._snapshot(session)
            self.slots[session.slot], session.slot = None, None
        del self.sessions[session_id]
        return {"session_id": session_id, "snapshotted": snapshotted}

    def op_session_delete(self, request, session_id):
        session = self._session(session_id, request.owner)
        if session.busy:
            raise RuntimeError_("busy", f"session {session_id} is generating")
        if session.slot is not None:
            self.slots[session.slot] = None
        del self.sessions[session_id]
        self.store.delete(session_id)
        return {"session_id": session_id}

    def op_session_info(self, request, session_id):
        session = self._session(session_id, request.owner)
        return session.info(resident=session.slot is not None)

    def op_session_list(self, request):
        listed = {}
        for meta in self.store.list_meta():
            if visible(meta.get("owner"), request.owner):
                listed[meta["session_id"]] = Session.from_stored(meta, []).info(resident=False, with_turns=False)
                listed[meta["session_id"]]["tokens"] = meta["tokens"] + len(meta.get("pending", []))
        for session in self.sessions.values():
            if session.tokens is not None and visible(session.owner, request.owner):
                listed[session.session_id] = session.info(resident=session.slot is not None, with_turns=False)
        return {"sessions": sorted(listed.values(), key=lambda s: s["updated"], reverse=True)}

    def op_skill_list(self, request):
        return {"skills": self.skills.list() if self.skills else []}

    def op_skill_load(self, request, session_id, name, force=False, role=None, file=None):
        session = self._session(session_id, request.owner)
        if self.skills is None:
            raise RuntimeError_("not_found", "no skill roots are configured (--skills-dir)")
        skill = self.skills.get(name)
        key = skill.name if file is None else f"{skill.name}/{file}"
        if key in session.skills and not force:
            return {"skill": skill.name, "file": file, "loaded": False, "tokens_appended": 0,
                    "tokens": session.length, "usage": self._usage(request, session)}
        message = {"role": self._role(role), "content": skill.message(file)}
        result = self._append_message(request, session, message, kind="skill", name=key)
        session.skills.append(key)
        return {"skill": skill.name, "file": file, "loaded": True, **result}

    def op_rag_index(self, request, path, name="default", retriever=None):
        """Index a folder (runs beside the engine thread: indexing never delays a generation)."""
        def progress(data):
            if request.emit:
                request.emit("progress", data)
        return self._rag().index(Path(path), name=name, retriever=retriever, progress=progress,
                                 cancelled=request.cancelled)

    def op_rag_list(self, request):
        return {"indexes": self._rag().list()}

    def op_rag_remove(self, request, name):
        return self._rag().remove(name)

    def op_rag_inject(self, request, session_id, documents=None, query=None, k=None, index="default", role=None):
        session = self._session(session_id, request.owner)
        if query is not None:
            k = self.rag_k if k is None else k
            passages = [p.to_dict() for p in self._rag().search(query, k=k, name=index)]
            if not passages:
                return {"passages": [], "tokens_appended": 0, "tokens": session.length,
                        "usage": self._usage(request, session)}
        else:
            passages = [{"text": d} if isinstance(d, str) else {k: v for k, v in d.items() if v is not None}
                        for d in documents]
        body = "\n\n".join(f"[{i + 1}] {d.get('source') or 'document'}\n{d['text'].strip()}" for i, d in enumerate(passages))
        message = {"role": self._role(role), "content": "Context passages:\n\n" + body}
        result = self._append_message(request, session, message, kind="rag", name=query)
        return {"passages": passages, **result}

    def _role(self, role) -> str:
        return role or self.context_role

    def _rag(self):
        if self.rag is None:
            raise RuntimeError_("not_found", "retrieval is not configured on this daemon")
        return self.rag

    def op_session_export(self, request, session_id):
        session = self._session(session_id, request.owner)
        if session.slot is not None:
            self._snapshot(session)
        stored = self.store.get_meta(session_id)  # a generating session is exported as of its last turn
        return {"session_id": session_id, "tokens": stored["tokens"] + len(stored["pending"]),
                "blob": self.store.export_blob(session_id)}

    def op_session_import(self, request, data):
        kv = self.engine.kv
        meta = self.store.import_blob(data, check=self._check_fingerprint, vocab_size=self.engine.spec.vocab_size,
                                      bytes_per_token=kv.bytes_per_token, owner=request.owner)
        return self._session(meta["session_id"], request.owner).info(resident=False)

    def op_stats(self, request):
        kv = self.engine.kv
        used = int(sum(kv.lengths[s.slot] for s in self.slots if s is not None))
        return {
            "model": str(self.engine.model_path), "model_type": self.engine.spec.model_type,
            "slots": kv.slots, "sequence_length": kv.sequence_length, "kv_bytes": kv.nbytes,
            "kv_bytes_per_token": kv.bytes_per_token, "kv_bytes_used": used * kv.bytes_per_token,
            "kv_bytes_free": kv.nbytes - used * kv.bytes_per_token,
            "sessions_resident": sum(s is not None for s in self.slots),
            "sessions_stored": self.store.count(), "generating": len(self.active),
            "uptime_s": round(time.time() - self.started, 1), "counters": dict(self.counters),
            "store": self.store.stats(),
        }

    # ---- appends ----------------------------------------------------------------------------

    def _append_message(self, request, session: Session, message, kind="message", name=None) -> dict:
        template = self.engine.chat_template
        if template is None:
            raise RuntimeError_("bad_request", "this model has no chat template: append text or tokens")
        text = template.render_fragment(session.messages, [message], tools=session.tools,
                                        add_generation_prompt=False, allow_rewrite=True)
        return self._append(request, session, kind, self.engine.tokenizer.encode(text), role=message["role"],
                            name=name, message=message)

    def _append(self, request, session: Session, kind: str, tokens: list[int], role=None, name=None, message=None) -> dict:
        """Prefill a turn's tokens now and log the turn."""
        if session.busy:
            raise RuntimeError_("busy", f"session {session.session_id} is generating")
        start, messages_before = session.length, len(session.messages)
        before = self._before(session)
        try:
            self._prefill(request, session, tokens, need_logits=False)
            if message is not None:
                session.messages.append(message)
            session.add_turn(kind, start, role=role, name=name, messages=messages_before)
            self._after_turn(session)
        except SlotsBusy:
            raise
        except Exception:  # a turn that reports an error has not been appended
            self._restore(session, before)
            raise
        return {"tokens_appended": len(tokens), "tokens": session.length, "usage": self._usage(request, session)}

    def _usage(self, request: Request, session: Session) -> dict:
        """Usage of this request so far: what it prefilled and what it found already computed."""
        return {"prompt_tokens": session.length, "prefilled_tokens": request.prefilled,
                "reused_tokens": request.reused, "prefill_ms": round((time.perf_counter() - request.received) * 1000, 2)}


def brief(args: dict) -> str:
    """A request's arguments for a log line (long values cut)."""
    return ", ".join(f"{k}={str(v)[:80]}" for k, v in args.items())


def visible(stored_owner: str | None, owner: str | None) -> bool:
    """May a request by `owner` name a session stored with `stored_owner`? (None: no restriction)"""
    return stored_owner is None or owner is None or stored_owner == owner


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0])


def check_fingerprint(ours: dict, meta: dict) -> None:
    """Refuse a stored session whose KV was made under another model, tokenizer, template or layout."""
    theirs = meta.get("fingerprint", {})
    for part in ("model", "tokenizer", "template", "kv"):
        if theirs.get(part) != ours[part]:
            raise RuntimeError_(
                "fingerprint",
                f"session {meta['session_id']} was made under another {part} "
                f"({theirs.get(part)} != {ours[part]}); it cannot be resumed by this daemon",
            )


def top_logprobs(logits, token: int, count: int) -> dict:
    """The chosen token's log-probability and the `count` most likely tokens' (model distribution)."""
    shifted = logits - logits.max()
    logp = shifted - np.log(np.exp(shifted).sum())
    top = np.argpartition(-logp, count - 1)[:count]
    top = top[np.argsort(-logp[top], kind="stable")]
    return {"token": token, "logprob": float(logp[token]), "top": [[int(t), float(logp[t])] for t in top]}


def model_fingerprint(engine) -> dict:
    """What a session's KV depends on: model and weight precision, tokenizer, template, KV layout."""
    from ellmd.kernels.formats import FORMAT_NAMES

    names = {v: k for k, v in FORMAT_NAMES.items()}
    spec = engine.spec
    model = hashlib.sha256(repr((dataclasses.asdict(spec), names[engine.fmt], engine.weights_digest)).encode())
    template = engine.chat_template.source if engine.chat_template else ""
    return {
        "model": model.hexdigest()[:16],
        "tokenizer": engine.tokenizer.fingerprint()[:16] if engine.tokenizer else "none",
        "template": hashlib.sha256(template.encode()).hexdigest()[:16],
        "kv": f"{names[engine.kv.fmt]}:{spec.num_hidden_layers}x{spec.num_key_value_heads}x{spec.head_dim}",
    }
