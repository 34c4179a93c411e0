"""The runtime: sessions resident in KV slots, one engine thread, LMDB snapshots.

One engine thread owns the Engine. Requests arrive on a queue; between two batched decode steps
(one forward over every generating session) the thread runs queued requests (appends, which
prefill, and every other op). Handlers on other threads never touch arrays: they submit a request
and wait on its future. At most `slots` sessions are resident; when another is needed, the least
recently used idle one is snapshotted and its slot reused.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import hashlib
import inspect
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ellmd.engine.sampling import Sampler, SamplingParams
from ellmd.errors import CapacityError, EllmError
from ellmd.runtime.retrieval import RetrievalError
from ellmd.runtime.session import Session
from ellmd.runtime.skills import SkillError
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


# Ops that never touch the engine run on one thread beside it (SkillLibrary and RagLibrary are
# thread-safe), so that indexing a folder never delays a decode step.
ASIDE_OPS = {"rag.index", "rag.list", "rag.remove", "skill.list"}
ANONYMOUS = "anonymous"  # the tag of sessions made by completion requests that named none
SESSION_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def not_found(session_id) -> RuntimeError_:
    return RuntimeError_("not_found", f"no session {session_id!r}")


@dataclass
class Request:
    op: str
    args: dict
    emit: object = None  # emit(event, data), called from the engine thread
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    received: float = field(default_factory=time.perf_counter)
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
        self._aside = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aside")
        self._stopped = threading.Event()

    # ---- called from other threads ----------------------------------------------------------

    def start(self) -> None:
        """Run the engine loop on a thread of its own (see `run`)."""
        self._thread.start()

    def submit(self, op: str, args: dict, emit=None) -> Request:
        """Queue a request; its future resolves to the result dict (or raises)."""
        request = Request(op, args or {}, emit)
        if op in ASIDE_OPS:
            self._aside.submit(self._handle, request)
        else:
            self.queue.put(request)
        return request

    def stop(self, timeout: float | None = None) -> None:
        """End generations cleanly, snapshot every resident session, end the engine loop."""
        self.queue.put(None)
        self._stopped.wait(timeout)
        self._aside.shutdown(wait=False, cancel_futures=True)

    # ---- the engine thread ------------------------------------------------------------------

    def run(self) -> None:
        """The engine loop, on the calling thread, until `stop`.

        The daemon runs it on its main thread, the one that loaded the model and warmed the kernels
        up: with numba's OpenMP layer, parallel kernels launched from any other thread than the
        first to launch one pay ~0.1 ms per launch, which halved the decode speed.
        """
        try:
            self._loop()
        finally:
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
                    request.future.set_exception(RuntimeError_("cancelled", "cancelled while waiting for a slot"))
                else:
                    self._handle(request)

    def _handle(self, request: Request) -> None:
        handler = getattr(self, "op_" + request.op.replace(".", "_"), None)
        try:
            if handler is None:
                raise RuntimeError_("unknown_op", f"unknown op {request.op!r}")
            try:
                inspect.signature(handler).bind(request, **request.args)
            except TypeError as e:
                raise RuntimeError_("bad_request", f"{request.op}: {e}") from None
            result = handler(request, **request.args)
            if result is not None:  # generations resolve later
                request.future.set_result(result)
        except SlotsBusy:
            self.waiting.append(request)
        except RuntimeError_ as e:
            request.future.set_exception(e)
        except StoreError as e:
            request.future.set_exception(RuntimeError_("store", str(e)))
        except (SkillError, RetrievalError) as e:
            request.future.set_exception(RuntimeError_(getattr(e, "code", "not_found"), str(e)))
        except (CapacityError, TemplateError) as e:
            request.future.set_exception(RuntimeError_("capacity" if isinstance(e, CapacityError) else "bad_request", str(e)))
        except ValueError as e:
            request.future.set_exception(RuntimeError_("bad_request", f"{request.op}: {e}"))
        except Exception as e:  # a bug: report it, keep serving
            log.exception("op %s failed", request.op)
            request.future.set_exception(RuntimeError_("internal", f"{request.op}: {type(e).__name__}: {e}"))

    def _shutdown(self) -> None:
        for gen in list(self.active):
            self._finish(gen, "cancelled")
        for session in self.slots:
            if session is not None:
                self._snapshot(session)
        while not self.queue.empty():
            self.waiting.append(self.queue.get_nowait())
        for request in self.waiting:
            if request:
                request.future.set_exception(RuntimeError_("cancelled", "the daemon is shutting down"))

    # ---- sessions and slots -----------------------------------------------------------------

    def _session(self, session_id) -> Session:
        if not isinstance(session_id, str):
            raise RuntimeError_("bad_request", "session_id must be a string")
        session = self.sessions.get(session_id)
        if session is None:
            meta = self.store.get_meta(session_id)
            if meta is None:
                raise not_found(session_id)
            self._check_fingerprint(meta)
            session = Session.from_stored(meta, [])
            session.stored_tokens = meta["tokens"]
            session.tokens = None  # loaded with the KV on resume
            self.sessions[session_id] = session
        return session

    def _check_fingerprint(self, meta: dict) -> None:
        check_fingerprint(self.fingerprint, meta)

    def _resident(self, session: Session) -> int:
        """Make a session resident and return its slot (evicting the LRU idle session if needed)."""
        if session.slot is not None:
            session.last_used = time.monotonic()
            return session.slot
        slot = self._free_slot()
        engine = self.engine
        engine.rewind(slot, 0)
        if session.tokens is None or session.stored_tokens:
            meta, tokens = self.store.load(session.session_id, lambda start, data: engine.import_kv(slot, start, data))
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
        if session.tokens is None or (not session.dirty and session.stored_tokens == len(session.tokens)):
            return {"chunks_written": 0, "bytes_written": 0, "stored_tokens": session.stored_tokens}
        slot = session.slot
        if slot is None and len(session.tokens) > session.stored_tokens:
            raise RuntimeError_("internal", f"session {session.session_id} has unsaved KV but no slot")
        result = self.store.snapshot(
            session.stored_meta(), session.tokens,
            lambda a, b: self.engine.export_kv(slot, a, b), session.stored_tokens,
        )
        session.stored_tokens = result["stored_tokens"]
        session.dirty = False
        return result

    def _after_turn(self, session: Session) -> None:
        if self.snapshot_every_turn:
            self._snapshot(session)

    def _prefill(self, request: Request, session: Session, new_tokens: list[int], need_logits: bool):
        """Append tokens (after the session's pending ones) to its KV; returns last logits or None."""
        slot = self._resident(session)
        if request.reused is None:
            request.reused = len(session.tokens)
            self.counters["reused"] += request.reused
        tokens = session.pending + list(new_tokens)
        if session.length + len(new_tokens) > self.engine.kv.sequence_length:
            raise CapacityError(
                f"session {session.session_id} holds {session.length} tokens; adding {len(new_tokens)} "
                f"would exceed the sequence length {self.engine.kv.sequence_length}"
            )
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

    def _start_generation(self, request: Request, session: Session, sampling: dict, prompt=None) -> None:
        """Prefill the generation prompt (rendered, or the given tokens) and start decoding."""
        if session.busy:
            raise RuntimeError_("busy", f"session {session.session_id} is generating")
        stream = bool(sampling.pop("stream", True))
        logprobs = sampling.pop("logprobs", 0)
        if not isinstance(logprobs, int) or not 0 <= logprobs <= 20:
            raise RuntimeError_("bad_request", "logprobs must be an integer in [0, 20]")
        params = sampling_params(sampling)
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
        start = session.length  # the turn opens with the generation prompt
        logits = self._prefill(request, session, prompt, need_logits=True)
        gen = Generation(
            request=request, session=session, sampler=Sampler(params, session.tokens), params=params,
            stream=stream, logprobs=logprobs, detok=IncrementalDetokenizer(self.engine.tokenizer, skip_special_tokens=True),
            stopper=StopMatcher(params.stop), start=start, usage=self._usage(request, session),
        )
        session.busy = True
        self.active.append(gen)
        self._accept(gen, gen.sampler(logits), logits)

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
        gens = list(self.active)
        logits = self.engine.decode([g.session.slot for g in gens], [g.next_token for g in gens])
        for gen, row in zip(gens, logits):
            gen.session.tokens.append(gen.next_token)
            self._accept(gen, gen.sampler(row), row)

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
        if tools is not None and not isinstance(tools, list):
            raise RuntimeError_("bad_request", "tools must be a list")
        session = Session.new(self.fingerprint, str(title or ""), tags, tools)
        session.tokens = []
        if system is not None:  # may wait for a slot (SlotsBusy): register the session only after
            self._append_message(request, session, {"role": "system", "content": str(system)})
        else:
            self._after_turn(session)
        self.sessions[session.session_id] = session
        return session.info(resident=session.slot is not None)

    def op_session_append(self, request, session_id, message=None, text=None, tokens=None):
        session = self._session(session_id)
        if sum(x is not None for x in (message, text, tokens)) != 1:
            raise RuntimeError_("bad_request", "session.append takes exactly one of message, text, tokens")
        if message is not None:
            return self._append_message(request, session, message)
        if text is not None:
            if not isinstance(text, str):
                raise RuntimeError_("bad_request", "text must be a string")
            return self._append(request, session, "text", self.engine.tokenizer.encode(text))
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise RuntimeError_("bad_request", "tokens must be a list of integers")
        if any(t < 0 or t >= self.engine.spec.vocab_size for t in tokens):
            raise RuntimeError_("bad_request", f"token ids must be in [0, {self.engine.spec.vocab_size})")
        return self._append(request, session, "tokens", tokens)

    def op_session_generate(self, request, session_id, **sampling):
        self._start_generation(request, self._session(session_id), sampling)

    def op_session_chat(self, request, session_id, content=None, message=None, **sampling):
        session = self._session(session_id)
        if (content is None) == (message is None):
            raise RuntimeError_("bad_request", "session.chat takes content (a user message) or message")
        self._append_message(request, session, message if message is not None else {"role": "user", "content": content})
        self._start_generation(request, session, sampling)

    def op_completion(self, request, tokens, session_id=None, messages=None, tools=None, **sampling):
        """Generate after a whole prompt, reusing the KV of its longest prefix already computed.

        With session_id, that session (created if new) is rewound to the common prefix; without, the
        resident anonymous session sharing the longest prefix is continued (see _anonymous_session),
        so plain OpenAI clients get incremental prefill too.
        """
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) for t in tokens):
            raise RuntimeError_("bad_request", "tokens must be a non-empty list of integers")
        if any(t < 0 or t >= self.engine.spec.vocab_size for t in tokens):
            raise RuntimeError_("bad_request", f"token ids must be in [0, {self.engine.spec.vocab_size})")
        if messages is not None and not isinstance(messages, list):
            raise RuntimeError_("bad_request", "messages must be a list")
        if tools is not None and not isinstance(tools, list):
            raise RuntimeError_("bad_request", "tools must be a list")
        if len(tokens) + 1 > self.engine.kv.sequence_length:
            raise CapacityError(f"the prompt holds {len(tokens)} tokens: no room left to generate within "
                                f"the sequence length {self.engine.kv.sequence_length}")
        session = self._bound_session(session_id) if session_id is not None else self._anonymous_session(tokens)
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

    def _bound_session(self, session_id) -> Session:
        if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
            raise RuntimeError_("bad_request", "session_id must match [A-Za-z0-9_.-]{1,64}")
        if session_id in self.sessions or self.store.get_meta(session_id) is not None:
            return self._session(session_id)
        session = Session.new(self.fingerprint, title=session_id)
        session.session_id, session.tokens = session_id, []
        return session

    def _anonymous_session(self, tokens: list[int]) -> Session:
        """The anonymous session to continue: the resident one sharing the longest prefix, or a new one."""
        shared, best = max(((common_prefix(s.tokens, tokens), s) for s in self.slots
                            if s is not None and not s.busy and ANONYMOUS in s.tags),
                           key=lambda pair: pair[0], default=(0, None))
        free = self.slots.index(None) if None in self.slots else None
        if shared and shared == len(best.tokens):
            return best  # the prompt extends that conversation
        if shared and free is None and 2 * shared >= len(best.tokens):
            return best  # most of it is shared (a retry, an edited turn) and no slot to fork into: drop its tail
        shared = shared if free is not None else 0  # else a new session, in the slot of the LRU idle one
        session = Session.new(self.fingerprint, title="anonymous", tags=[ANONYMOUS])
        session.tokens = []
        if shared:  # fork the shared part into the free slot: a memory copy, no recomputation
            self.engine.copy_slot(best.slot, free)
            self.engine.rewind(free, shared)
            session.tokens, session.slot = best.tokens[:shared], free
            self.slots[free] = session
        return session

    def op_session_fork(self, request, session_id, title=None):
        source = self._session(session_id)
        if source.busy:
            raise RuntimeError_("busy", f"session {session_id} is generating")
        if source.slot is not None:
            self._snapshot(source)
        fork = Session.new(self.fingerprint, str(title or f"fork of {source.title or source.session_id}"),
                           source.tags, source.tools)
        for name in ("pending", "turns", "messages", "skills"):
            setattr(fork, name, copy.deepcopy(getattr(source, name)))
        self.store.copy(source.session_id, fork.session_id, fork.stored_meta())
        fork.tokens, fork.stored_tokens, fork.dirty = None, source.stored_tokens, False
        self.sessions[fork.session_id] = fork
        return fork.info(resident=False)

    def op_session_rewind(self, request, session_id, turn=None, tokens=None):
        session = self._session(session_id)
        if session.busy:
            raise RuntimeError_("busy", f"session {session_id} is generating")
        if (turn is None) == (tokens is None):
            raise RuntimeError_("bad_request", "session.rewind takes turn or tokens")
        if turn is not None:
            if not isinstance(turn, int) or not 0 <= turn < len(session.turns):
                raise RuntimeError_("not_found", f"session {session_id} has no turn {turn!r}")
            length = session.turns[turn]["start"]
        else:
            if not isinstance(tokens, int) or not 0 <= tokens <= session.length:
                raise RuntimeError_("bad_request", f"tokens must be in [0, {session.length}]")
            length = tokens
        slot = self._resident(session)
        session.truncate(length)
        self.engine.rewind(slot, len(session.tokens))
        self._after_turn(session)
        return session.info(resident=True)

    def op_session_snapshot(self, request, session_id):
        session = self._session(session_id)
        began = time.perf_counter()
        session.dirty = True  # an explicit snapshot always rewrites the metadata
        result = self._snapshot(session)
        return {**result, "ms": round((time.perf_counter() - began) * 1000, 2)}

    def op_session_resume(self, request, session_id):
        session = self._session(session_id)
        began = time.perf_counter()
        self._resident(session)
        return {"session_id": session_id, "tokens": session.length, "ms": round((time.perf_counter() - began) * 1000, 2)}

    def op_session_close(self, request, session_id):
        session = self._session(session_id)
        if session.busy:
            raise RuntimeError_("busy", f"session {session_id} is generating")
        snapshotted = session.slot is not None
        if snapshotted:
            self._snapshot(session)
            self.slots[session.slot], session.slot = None, None
        del self.sessions[session_id]
        return {"session_id": session_id, "snapshotted": snapshotted}

    def op_session_delete(self, request, session_id):
        session = self._session(session_id)
        if session.busy:
            raise RuntimeError_("busy", f"session {session_id} is generating")
        if session.slot is not None:
            self.slots[session.slot] = None
        del self.sessions[session_id]
        self.store.delete(session_id)
        return {"session_id": session_id}

    def op_session_info(self, request, session_id):
        session = self._session(session_id)
        return session.info(resident=session.slot is not None)

    def op_session_list(self, request):
        listed = {}
        for meta in self.store.list_meta():
            listed[meta["session_id"]] = Session.from_stored(meta, []).info(resident=False, with_turns=False)
            listed[meta["session_id"]]["tokens"] = meta["tokens"] + len(meta.get("pending", []))
        for session in self.sessions.values():
            if session.tokens is not None:
                listed[session.session_id] = session.info(resident=session.slot is not None, with_turns=False)
        return {"sessions": sorted(listed.values(), key=lambda s: s["updated"], reverse=True)}

    def op_skill_list(self, request):
        return {"skills": self.skills.list() if self.skills else []}

    def op_skill_load(self, request, session_id, name, force=False, role=None, file=None):
        session = self._session(session_id)
        if not isinstance(name, str):
            raise RuntimeError_("bad_request", "name must be a string")
        if file is not None and not isinstance(file, str):
            raise RuntimeError_("bad_request", "file must be a string")
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
        return self._rag().index(Path(str(path)), name=str(name), retriever=retriever, progress=progress)

    def op_rag_list(self, request):
        return {"indexes": self._rag().list()}

    def op_rag_remove(self, request, name):
        return self._rag().remove(str(name))

    def op_rag_inject(self, request, session_id, documents=None, query=None, k=None, index="default", role=None):
        session = self._session(session_id)
        if (documents is None) == (query is None):
            raise RuntimeError_("bad_request", "rag.inject takes documents or a query")
        if query is not None:
            if not isinstance(query, str):
                raise RuntimeError_("bad_request", "query must be a string")
            k = self.rag_k if k is None else k
            if not isinstance(k, int) or not 1 <= k <= 100:
                raise RuntimeError_("bad_request", "k must be an integer in [1, 100]")
            passages = [p.to_dict() for p in self._rag().search(query, k=k, name=str(index))]
            if not passages:
                return {"passages": [], "tokens_appended": 0, "tokens": session.length,
                        "usage": self._usage(request, session)}
        else:
            if not isinstance(documents, list) or not all(isinstance(d, (str, dict)) for d in documents):
                raise RuntimeError_("bad_request", "documents must be a list of strings or maps with a text")
            passages = [{"text": d} if isinstance(d, str) else d for d in documents]
            if not all(isinstance(d.get("text"), str) for d in passages):
                raise RuntimeError_("bad_request", "every document needs a text")
        body = "\n\n".join(f"[{i + 1}] {d.get('source') or 'document'}\n{d['text'].strip()}" for i, d in enumerate(passages))
        message = {"role": self._role(role), "content": "Context passages:\n\n" + body}
        result = self._append_message(request, session, message, kind="rag", name=query)
        return {"passages": passages, **result}

    def _role(self, role) -> str:
        if role is not None and not isinstance(role, str):
            raise RuntimeError_("bad_request", "role must be a string")
        return role or self.context_role

    def _rag(self):
        if self.rag is None:
            raise RuntimeError_("not_found", "retrieval is not configured on this daemon")
        return self.rag

    def op_session_export(self, request, session_id):
        session = self._session(session_id)
        if session.slot is not None:
            self._snapshot(session)
        return {"session_id": session_id, "tokens": session.length, "blob": self.store.export_blob(session_id)}

    def op_session_import(self, request, data):
        if not isinstance(data, bytes):
            raise RuntimeError_("bad_request", "data must be binary")
        meta = self.store.import_blob(data, check=self._check_fingerprint)
        return self._session(meta["session_id"]).info(resident=False)

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
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RuntimeError_("bad_request", "message must be a map with a string role")
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
        self._prefill(request, session, tokens, need_logits=False)
        if message is not None:
            session.messages.append(message)
        session.add_turn(kind, start, role=role, name=name, messages=messages_before)
        self._after_turn(session)
        return {"tokens_appended": len(tokens), "tokens": session.length, "usage": self._usage(request, session)}

    def _usage(self, request: Request, session: Session) -> dict:
        """Usage of this request so far: what it prefilled and what it found already computed."""
        return {"prompt_tokens": session.length, "prefilled_tokens": request.prefilled,
                "reused_tokens": request.reused, "prefill_ms": round((time.perf_counter() - request.received) * 1000, 2)}


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


def sampling_params(args: dict) -> SamplingParams:
    """SamplingParams from protocol arguments, with clear errors for unknown or ill-typed ones."""
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(args) - known
    if unknown:
        raise RuntimeError_("bad_request", f"unknown argument(s): {', '.join(sorted(unknown))}")
    if "logit_bias" in args and isinstance(args["logit_bias"], dict):
        args = {**args, "logit_bias": {int(k): float(v) for k, v in args["logit_bias"].items()}}
    try:
        return SamplingParams(**args)
    except (TypeError, ValueError) as e:
        raise RuntimeError_("bad_request", str(e)) from None


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
