"""The runtime: the engine loop over its parts.

One engine thread owns the Engine. Requests arrive on a queue; the thread runs every queued
request, then one chunk of a prefill (if any is in progress), then one batched decode step (one
forward over every generating session), and again: a long prefill delays the others' tokens by
one chunk at most, and a cancelled one stops at its next chunk. Handlers on other threads never
touch arrays: they submit a request and wait on its future.

What reaches the loop is data: requests; the job records in the steps a handler returns
(steps.Then: turns.Encode, a text to render and tokenize on the text thread, so no decode step
waits for it; turns.Prefill, tokens to run chunk by chunk; turns.Acknowledge, a finished turn to
snapshot; a StoreWrite to wait for), each job's outcome given to its step's function (`_run`, the
one place an op's steps are sequenced); records coming back from the other threads (the writer's
StoreWrite, the text thread's Encode, a Compiled constraint); and Generations' `ended` records,
which the loop acknowledges and answers (`_settle`). A session's state (session.py: idle,
prefilling, generating, writing) is set here alone, as those jobs start and end. The parts:

  ops/            the ops, each declared once beside its handler (where it runs, its schema), by area
  steps.py        Then: a job an op waits for and what it does next; chaining (after, guarded)
  residency.py    sessions in slots, eviction, snapshots: the only code that talks to the store
  store/          the session store and its writer thread (snapshots are written beside this one)
  context/        what sessions load: skill libraries, retrieval indexes
  turns.py        appends (their Encode, Prefill and Acknowledge jobs), usage from a request's log of
                  prefills, and putting a session back after a failure
  generations.py  the generation state machine, turn closing, tool calls
  scheduler.py    the policy: chunk budget, which prefill runs next, which idle session to evict
  errors.py       the error a request is answered with (codes: the one table, ellmd/errors.py CODES)

Arguments are validated at `submit` (schemas.py) before a request is queued, so handlers see only
well-typed values. A request that fails is answered with its error and leaves its session as it
found it; a generation that fails ends alone; the loop itself failing snapshots every session
first (`run`).

Snapshots: a turn's snapshot is copied out of the KV on this thread and written by the writer
(store/writer.py), so no decode step waits on LMDB. When the writer is done, it puts the StoreWrite
on the queue and the loop settles it. `snapshot_ack` is when a turn is acknowledged: "written"
(the default) replies once its snapshot is on disk, the op waiting as for a prefill (the
loop goes on with the others; a failed write is the request's error, `store`, and the turn is
undone: the session stays resident, its unsaved state written by its next snapshot); "queued"
replies at once, a failed write then only logged and written again at the session's next snapshot.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ellmd.errors import BadRequest, EllmError
from ellmd.runtime import schemas
from ellmd.runtime.errors import ProtocolError, SlotsBusy, cancelled, protocol_error
from ellmd.runtime.generations import Generation, Generations, brief
from ellmd.runtime.store.leases import Leases
from ellmd.runtime.ops import RUNTIME_OPS
from ellmd.runtime.residency import Residency
from ellmd.runtime.scheduler import DecodeStep, Policy, PrefillChunk
from ellmd.runtime.session import GENERATING, IDLE, PREFILLING, WRITING
from ellmd.runtime.steps import Then, wait
from ellmd.runtime.store.base import SessionStore, StoreError
from ellmd.runtime.turns import Acknowledge, Encode, Prefill, Turns
from ellmd.runtime.store.writer import StoreWrite
from ellmd.text.constraints import GrammarError, Grammars

SNAPSHOT_ACKS = ("written", "queued")

log = logging.getLogger("ellmd.runtime")


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
    prefilled: list = field(default_factory=list)  # what each of its prefills did (turns.Prefilled): its usage
    compiling: concurrent.futures.Future | None = None  # its constraint, on the compile thread


@dataclass(eq=False)
class Compiled:
    """The compile thread is done with a request's constraint (queued for the loop to settle)."""

    request: Request


class Runtime:
    """Sessions over an Engine and a Store, served by one engine thread."""

    def __init__(self, engine, store: SessionStore, skills=None, rag=None, rag_k: int = 4,
                 snapshot_every_turn: bool = True, context_role: str = "user", policy: Policy | None = None,
                 snapshot_ack: str = "written", leases: Leases | None = None, key_owners: dict | None = None):
        if snapshot_ack not in SNAPSHOT_ACKS:
            raise EllmError(f"snapshot_ack must be one of {', '.join(SNAPSHOT_ACKS)}, not {snapshot_ack!r}")
        self.engine = engine
        self.skills = skills  # SkillLibrary
        self.rag = rag  # RagLibrary
        self.rag_k = rag_k  # passages per query by default
        self.snapshot_every_turn = snapshot_every_turn
        self.snapshot_ack = snapshot_ack
        self.key_owners = dict(key_owners or {})  # API key name -> owner (session.grant)
        self.policy = policy or Policy(engine.chunk_size)
        # StoreWrite: the writer is done with it; Encode: the text thread is
        self.queue: queue.Queue[Request | StoreWrite | Encode | Compiled | None] = queue.Queue()
        self.residency = Residency(engine, store, self.policy, written=self.queue, leases=leases)
        self.turns = Turns(engine, self.residency, context_role)
        self.generations = Generations(engine)
        # the matcher lets through the tokens that end a generation (Generations.accept)
        self.grammars = Grammars(engine.tokenizer, engine.spec.vocab_size, engine.spec.eos_token_id) \
            if engine.tokenizer is not None else None
        self.ops = dict(RUNTIME_OPS)
        self.fingerprint = self.residency.fingerprint
        self.tool_format = self.generations.tool_format
        self.observers = self.generations.observers  # callables given the final usage of every generation
        self.waiting: list[Request] = []  # requests that need a slot while every slot is busy
        self.prefills: list[Prefill] = []  # prefills in progress, in arrival order (their sessions busy)
        self.encoding: list[Encode] = []  # texts the text thread renders and tokenizes (their sessions busy)
        self.deferred: dict[str, list[Request]] = {}  # session id -> requests queued behind its prefill or write
        self.compiling: list[Request] = []  # requests that reached the loop before their constraint compiled
        self.awaiting: dict[StoreWrite, list[tuple]] = {}  # write -> (request, step, session marked busy) waiting for it
        self.replies_after: dict[StoreWrite, list[tuple]] = {}  # write -> generations' (request, result, session, restore)
        self.started = time.time()
        self._thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self._aside = {kind: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"aside-{kind}")
                       for kind in ("write", "read", "text")}  # text: Encode jobs
        self._aside_pending: dict[int, Request] = {}  # aside requests waiting or running
        self._stopped = threading.Event()
        self._closed = False  # set once shutdown begins: later requests are cancelled at once
        self.unsaved: dict[str, Exception] = {}  # set at shutdown: sessions whose last state is not in the store

    @property
    def store(self) -> SessionStore:
        return self.residency.store

    @property
    def sessions(self) -> dict:
        return self.residency.sessions

    @property
    def counters(self) -> dict:
        """Totals since start, each kept where it happens: prefills' (Turns), generations' (Generations)."""
        return {**self.turns.counters, **self.generations.counters}

    # ---- called from other threads ----------------------------------------------------------

    def start(self) -> None:
        """Run the engine loop on a thread of its own (see `run`)."""
        if self.grammars is not None:
            self.grammars.warm_up()
        self._thread.start()

    def submit(self, op: str, args: dict, emit=None) -> Request:
        """Queue a request; its future resolves to the result dict (or raises ProtocolError).

        The arguments are validated here, against the op's schema (schemas.py), before anything
        runs: a bad request is answered at once and changes nothing.
        """
        request = Request(op, {}, emit)
        try:
            if op not in self.ops:
                raise ProtocolError("unknown_op", f"unknown op {op!r}")
            request.args = self.ops[op].arguments(args, self.engine.spec.vocab_size)
            request.owner = request.args.pop("owner", None)
            request.compiling = self._compile_constraint(op, request.args)
            if self._closed:
                raise cancelled("the daemon is shutting down")
        except (ProtocolError, BadRequest) as e:
            reply(request, error=e)
            return request
        except Exception as e:  # a bug in validation: this request fails, nothing else
            log.exception("validating %s failed", op)
            reply(request, error=e)
            return request
        aside = self.ops[op].aside
        if aside:
            self._aside_pending[id(request)] = request
            self._aside[aside].submit(self._run_aside, request)
        else:
            self.queue.put(request)  # before its Compiled: the loop parks it until that comes
            if request.compiling is not None:
                request.compiling.add_done_callback(lambda _: self.queue.put(Compiled(request)))
        return request

    def _compile_constraint(self, op: str, args: dict) -> concurrent.futures.Future | None:
        """Start compiling a json_schema, regex or grammar argument on the compile thread (never on
        the caller's, a server's event loop): the loop settles it (`_compiled`)."""
        kind = next((name for name in schemas.CONSTRAINTS if name in args), None)
        if kind is None:
            return None
        if self.grammars is None:
            raise BadRequest(f"{op}: {kind}: this model has no tokenizer to constrain text with")
        source = args.pop(kind)
        check = (lambda: schemas.json_safe(source, f"{op}: {kind}")) if kind == "json_schema" else None
        return self.grammars.submit(kind, source, check)

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
            reply(request, error=cancelled("the daemon is shutting down"))

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

        A failure of one request or generation ends only that one. Should the loop itself fail,
        every session is snapshotted and every waiting request answered before the error goes up
        (the daemon then exits non-zero).
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
        """Take what the queue holds, one item at a time, until it is empty; then run the jobs the
        policy hands out (a prefill chunk, a decode step); and again."""
        while True:
            self._settle()
            self._retry_waiting()
            try:
                item = self.queue.get(block=not (self.generations.active or self.prefills))
            except queue.Empty:
                self._step()
                continue
            if item is None:
                break
            self._take(item)
        self._shutdown()

    def _take(self, item) -> None:
        """A request, or a record another thread hands back: a write the writer has run, a text
        the text thread has tokenized, a constraint compiled."""
        if isinstance(item, StoreWrite):
            self._written(item)
        elif isinstance(item, Encode):
            self._encoded(item)
        elif isinstance(item, Compiled):
            self._compiled(item.request)
        else:
            self._handle(item)

    def _retry_waiting(self) -> None:
        """Run the requests that waited for a slot, once one may be free (in arrival order)."""
        if self.waiting and self.policy.admit(self.residency.slots):
            waiting, self.waiting = self.waiting, []
            for request in waiting:
                if request.cancelled.is_set():
                    reply(request, error=cancelled("cancelled while waiting for a slot"))
                else:
                    self._handle(request)

    def _handle(self, request: Request) -> None:
        """Run one validated request; any failure becomes its error reply, never the loop's.

        A request naming a session that is prefilling, or whose op waits for one of its writes,
        waits for that to end, so that requests on one session run in their order (an append
        pipelined behind another is not busy).
        """
        if request.future.done():  # answered while it waited (a constraint that did not compile)
            return
        session_id = request.args.get("session_id")
        if session_id is not None and self._blocked(session_id):
            self.deferred.setdefault(session_id, []).append(request)
            return
        if request.compiling is not None:  # later requests on its session wait behind it
            self.compiling.append(request)
            return
        try:
            step = self.ops[request.op].handler(self, request, **request.args)
        except Exception as e:
            return self._failed(request, e)
        self._run(request, step)

    def _blocked(self, session_id: str) -> bool:
        """Do requests naming this session wait? (while it prefills, or a write of its is awaited,
        even once it has left memory; or a request on it waits for its constraint to compile)"""
        session = self.residency.sessions.get(session_id)
        return (session is not None and session.state in (PREFILLING, WRITING)) or \
            any(write.session_id == session_id for write in (*self.awaiting, *self.replies_after)) or \
            any(request.args.get("session_id") == session_id for request in self.compiling)

    def _compiled(self, request: Request) -> None:
        """Settle a request's constraint: its argument, or its bad_request; then run it, and the
        requests deferred behind it, if it was parked waiting for it."""
        future, request.compiling = request.compiling, None
        try:
            request.args["constraint"] = future.result()
        except GrammarError as e:
            reply(request, error=BadRequest(f"{request.op}: {e}"))
        except BadRequest as e:  # not JSON (json_safe)
            reply(request, error=e)
        except Exception as e:  # a bug in compiling: this request fails, nothing else
            log.error("compiling the constraint of %s failed", request.op, exc_info=e)
            reply(request, error=e)
        parked = [r for r in self.compiling if r is not request]  # by identity: Requests compare by value
        if len(parked) < len(self.compiling):
            self.compiling = parked
            self._handle(request)
            self._run_deferred(request.args.get("session_id"))

    def _run_deferred(self, session_id: str | None) -> None:
        """Run the requests deferred behind a session, in order, once nothing blocks it."""
        if session_id is not None and not self._closed and not self._blocked(session_id):
            for request in self.deferred.pop(session_id, []):
                self._handle(request)  # in order; each may wait again behind a new prefill

    def _run(self, request: Request, step) -> None:
        """Run an op's steps (steps.py) on to the first job that waits: an Encode (to the text
        thread), a Prefill (queued), a StoreWrite (waited for), an Acknowledge (its turn's snapshot,
        waited for with ack "written", else gone on from at once); or to their end: the reply's
        result, or a Generation the op started."""
        try:
            while isinstance(step, Then) and isinstance(step.job, Acknowledge):
                write, error = self._acknowledge(step.job)
                if write is not None:
                    step = Then(write, step.then, step.fail)
                    break
                step = step.resume(error=error)
        except Exception as e:
            return self._failed(request, e)
        if isinstance(step, Then):
            self._wait(request, step)
        elif isinstance(step, Generation):
            self._generating(step)
        elif step is not None:
            reply(request, step)

    def _resume(self, request: Request, step: Then, outcome=None, error: Exception | None = None) -> None:
        """Give an op the outcome (or the error) of the job it waited for, and run its next steps."""
        try:
            step = step.resume(outcome, error)
        except Exception as e:
            return self._failed(request, e)
        self._run(request, step)

    def _wait(self, request: Request, step: Then) -> None:
        """Hand out the job an op's step waits for; `_resume` takes the op on when it ends."""
        job = step.job
        if isinstance(job, StoreWrite):
            return self._await(request, step, job)
        job.waiter = step
        if isinstance(job, Encode):
            return self._encode(job)
        job.session.state = PREFILLING  # no other request changes it, nor evicts it, until the job ends
        self.prefills.append(job)

    def _acknowledge(self, job: Acknowledge) -> tuple:
        """Snapshot a finished turn per the policy: (the write to wait for first (ack "written"),
        None), or (None, the error that stops it: None once it is acknowledged)."""
        try:
            write = self.snapshot_turn(job.session)
        except Exception as e:  # nothing was queued: the turn cannot be acknowledged
            return None, e
        if write is not None and self.snapshot_ack == "written":
            return write, None
        return None, None

    def _failed(self, request: Request, e: Exception) -> None:
        if isinstance(e, SlotsBusy):
            self.waiting.append(request)
            return
        if not isinstance(e, EllmError):  # a bug: report it with its request, keep serving
            log.exception("op %s failed (args %s)", request.op, brief(request.args))
        reply(request, error=e)

    def _generating(self, gen) -> None:
        """A handler started a generation: its session generates until the generation ends."""
        gen.session.state = GENERATING
        self._settle()  # its first token may have ended it

    def _settle(self) -> None:
        """Take the generations that ended: acknowledge each finished turn (with ack "written", once
        its snapshot is on disk: `_written`); put a failed one's session back and reply its error."""
        while self.generations.ended:
            ended = self.generations.ended.pop(0)
            gen, session = ended.gen, ended.gen.session
            session.state = IDLE
            if ended.error is not None:
                self._undo(gen)
                reply(gen.request, error=ended.error)
                continue
            try:
                write = self.snapshot_turn(session)
            except EllmError as e:  # nothing was queued: the turn cannot be acknowledged
                self.turns.restore(session, gen.restore)
                reply(gen.request, error=e)
                continue
            if write is not None and self.snapshot_ack == "written":
                session.state = WRITING  # not evicted; requests naming it wait their turn
                self.replies_after.setdefault(write, []).append((gen.request, ended.result, session, gen.restore))
            else:
                reply(gen.request, ended.result)

    def _undo(self, gen) -> None:
        """Put a failed generation's session back where its op found it, and store that."""
        try:
            self.turns.restore(gen.session, gen.restore)
            self.snapshot_turn(gen.session)
        except Exception:
            log.exception("session %s: restoring after a failed generation failed", gen.session.session_id)

    def _decode_step(self) -> None:
        began = time.perf_counter()
        self.generations.step()
        self.policy.observe_decode(time.perf_counter() - began, self.generations.draft_rows)

    def _step(self) -> None:
        """Run the jobs the policy hands out: a prefill chunk and the generating sessions' decode
        step (the chunk inside it, when it rides)."""
        decoding = len(self.generations.active)
        room = self.engine.step_rows - decoding if decoding else 0
        rode = False
        for job in self.policy.next_jobs(self.prefills, decoding, room):
            if isinstance(job, PrefillChunk):
                rode = self._prefill_chunk(job)
            elif isinstance(job, DecodeStep) and not rode and self.generations.active:
                self._decode_step()

    def _prefill_chunk(self, chunk: PrefillChunk) -> bool:
        """Run one chunk of a prefill; returns whether it rode the decode step. A chunk that fails
        ends its job alone: the step runs without it."""
        job = chunk.job
        if job.request.cancelled.is_set():
            self._end_prefill(job, error=cancelled("cancelled during its prefill"))
            return False
        began, done = time.perf_counter(), job.done
        try:
            if chunk.ride:
                logits = job.ride(self.generations, chunk.budget)
                rows = job.done - done + self.generations.draft_rows
                self.policy.observe_ride(rows, time.perf_counter() - began)
            else:
                logits = job.run(self.engine, chunk.budget)
                self.policy.observe_prefill(job.done - done, time.perf_counter() - began)
        except Exception as e:
            self._end_prefill(job, error=e)
            return False
        if not job.left:
            self._end_prefill(job, logits=logits)
        return chunk.ride

    def _end_prefill(self, job: Prefill, logits=None, error: Exception | None = None) -> None:
        """Hand a finished job's logits (or its error, which puts the session back) to its op."""
        self.prefills.remove(job)
        job.session.state = IDLE
        self._resume(job.request, job.waiter, logits, error)
        if not self._closed:
            for request in self.deferred.pop(job.session.session_id, []):
                self._handle(request)  # in order; each may wait again behind a new prefill

    def _encode(self, job: Encode) -> None:
        """Hand a text to the text thread; its session is busy (prefilling) until `_encoded`."""
        job.session.state = PREFILLING
        self.encoding.append(job)
        job.future = self._aside["text"].submit(job.run, self.engine)
        job.future.add_done_callback(lambda _: self.queue.put(job))

    def _encoded(self, job: Encode, error: Exception | None = None) -> None:
        """Take an op on with its token ids (or the text's error), then the requests deferred
        behind its session. A job ended already (at shutdown) is ignored."""
        if job not in self.encoding:
            return
        self.encoding.remove(job)
        job.session.state = IDLE
        error = error or job.future.exception()
        self._resume(job.request, job.waiter, None if error is not None else job.future.result(), error)
        self._run_deferred(job.session.session_id)

    def _await(self, request: Request, step: Then, write: StoreWrite) -> None:
        """Park an op's step until the writer is done with `write` (_written resumes it). Its session
        is busy meanwhile (not evicted; requests naming it wait), unless it was already."""
        residency = self.residency
        session = residency.sessions.get(write.session_id) or next(  # a session being opened is not listed yet
            (s for s in residency.resident_sessions() if s.session_id == write.session_id), None)
        marked = session if session is not None and not session.busy else None
        if marked is not None:
            marked.state = WRITING
        self.awaiting.setdefault(write, []).append((request, step, marked))

    def _written(self, write: StoreWrite) -> None:
        """The writer is done with a write: settle it, send the replies that waited for it, resume
        the ops' steps that did (with its result or its error), then the requests deferred behind them."""
        self.residency.settle(write)
        for request, result, session, restore in self.replies_after.pop(write, ()):
            session.state = IDLE
            if write.error is None:
                reply(request, result)
            else:  # not on disk: not acknowledged, so not kept
                self.turns.restore(session, restore)
                reply(request, error=StoreError(f"{write.error}; the turn is undone"))
        for request, step, marked in self.awaiting.pop(write, ()):
            if marked is not None:
                marked.state = IDLE
            self._resume(request, step, write.result, write.error)
        self._run_deferred(write.session_id)

    def _drain(self) -> None:
        """At shutdown: settle the writes the writer is done with; park queued requests in `waiting`."""
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, StoreWrite):
                self._written(item)
            elif isinstance(item, Request):  # not a Compiled: its request is answered as it waits
                self.waiting.append(item)

    def _shutdown(self) -> None:
        """Finish generations and the ops waiting for a write, snapshot every resident session
        (each on its own: one failure does not stop the others), flush every write and answer
        every request still waiting."""
        self._closed = True
        for deferred in self.deferred.values():
            self.waiting.extend(deferred)
        self.deferred = {}
        self.waiting.extend(self.compiling)
        self.compiling = []
        while True:  # an op resumed after its write may go on to a prefill: cancelled in turn
            for job in [*self.prefills, *self.encoding]:
                end = self._end_prefill if isinstance(job, Prefill) else self._encoded
                end(job, error=cancelled("the daemon is shutting down"))
            self.generations.end_all()
            self._settle()
            if not self.awaiting and not self.replies_after:
                break
            self.residency.writer.flush()
            self._drain()
        for session in self.residency.resident_sessions():
            try:
                self.snapshot(session)
            except Exception:
                log.exception("shutdown: snapshot of session %s failed", session.session_id)
        self.residency.writer.flush()
        self._drain()  # a failed write is logged as it settles
        self.unsaved = dict(self.residency.unsaved)
        for session_id, error in self.unsaved.items():
            log.critical("shutdown: session %s could not be saved: %s", session_id, error)
        self.residency.close()
        if self.grammars is not None:
            self.grammars.close()
        for request in self.waiting:
            reply(request, error=cancelled("the daemon is shutting down"))
        self.waiting = []

    # ---- snapshots ----------------------------------------------------------------------------

    def snapshot(self, session) -> StoreWrite | None:
        """Queue a write of a session's changed chunks; a generating one as of its last whole turn."""
        gen = self.generations.of(session)
        return self.residency.snapshot(session, upto=None if gen is None else gen.start)

    def snapshot_turn(self, session) -> StoreWrite | None:
        """The snapshot policy: a finished turn's snapshot, queued (None: none is taken)."""
        return self.snapshot(session) if self.snapshot_every_turn else None

    def acknowledged(self, write: StoreWrite):
        """The step an op takes before its reply, per the ack policy: wait for `write` (ack
        "written"), or nothing (None)."""
        return wait(write) if self.snapshot_ack == "written" else None

    def stored(self, session):
        """The steps that wait until the store holds the session as it is now: its pending writes,
        then a snapshot of what they left unsaved (that one's failure is the op's); their result
        is the snapshot's."""
        return self._stored(session, self.residency.pending_writes(session.session_id))

    def _stored(self, session, pending: list[StoreWrite]):
        if pending:
            def settled(error):  # what it left unsaved is in the snapshot taken after
                if not isinstance(error, StoreError):
                    raise error
                return self._stored(session, pending[1:])
            return Then(pending[0], lambda _: self._stored(session, pending[1:]), settled)
        write = self.snapshot(session)
        if write is None:
            return {"chunks_written": 0, "bytes_written": 0, "stored_tokens": session.stored_tokens}
        return wait(write)
