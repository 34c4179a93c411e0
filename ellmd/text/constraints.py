"""Constrained decoding: a JSON Schema, a regular expression or a grammar limits what may be sampled.

The engine of it is llguidance (the library behind llama.cpp's and vLLM's structured output): a
grammar is compiled against the tokenizer into a matcher, which gives, for the next position, the
bitmask of the tokens that keep the text within the grammar, and consumes the sampled token.

Shapes: bitmask [W] int32 (W = ceil(V / 32), bit i of word w allows token 32 w + i); logits [V].

The mask of the next position depends only on the tokens consumed so far, so a generation starts
computing it on a worker thread (llguidance releases the GIL) before the forward pass that produces
that position's logits, and applies it after: the mask is ready by then, at no cost to the decode.
The matcher lets the model's end-of-sequence tokens through once the grammar is complete, and only
them once nothing more can follow.

Compiling is bounded and isolated. llguidance's compiler recurses once per `$ref` of a chain and per
rule of a chain of rules: past the 8 MiB stack of an ordinary thread that is a SIGSEGV, whatever
catches exceptions. So a source is first measured against `LIMITS` (bytes, `$ref`s, rules,
alternatives, enum values: counted in Python, before llguidance sees it), then compiled on one
thread of its own whose stack (`COMPILE_STACK`) holds the deepest source the limits let through
several times over, never on a server's event loop nor on the engine thread. Compiled matchers are
kept by content (`CACHE_SIZE`): a schema sent again is a copy, not a compile; so is a refusal.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import logging
import queue
import re
import threading
import time

import llguidance
import msgspec
import numpy as np

from ellmd.text.tokenizer import Tokenizer

log = logging.getLogger("ellmd.text")

KINDS = ("json_schema", "regex", "grammar")

# JSON the way json.dumps writes it, on one line: a model cannot wander into endless whitespace.
# A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# The bounds a constraint must keep to before it is compiled (a request beyond one is refused
# naming it). Measured with the built-in model's tokenizer: a `$ref` chain costs the compiler
# up to 16 KiB of stack per link (1,000 links overflow 8 MiB) and 0.2 s per 1,000 links; a chain
# of Lark rules up to 6.4 KiB per rule; 10,000 alternatives compile in 0.3 s, 50,000 in 9 s;
# 50,000 enum values (0.5 MB) in 0.3 s.
LIMITS = {
    "schema_bytes": 512 << 10,  # a JSON Schema as compact JSON text (OpenAI allows ~5,000 properties)
    "grammar_bytes": 1 << 20,  # a Lark or GBNF grammar's text (also the argument's own bound)
    "refs": 2_000,  # `$ref`s in a schema or grammar: the longest chain is at most this
    "rules": 10_000,  # rules of a grammar
    "alternatives": 10_000,  # `|` of a grammar, anyOf/oneOf/allOf branches of a schema
    "enum_values": 10_000,  # enum and const values of a schema, together
    "compile_seconds": 10.0,  # beyond it the source is refused (and remembered as refused)
}
COMPILE_STACK = 256 << 20  # the compile thread's stack: refs x 16 KiB = 32 MiB, rules x 6.4 KiB = 64 MiB
CACHE_SIZE = 64  # compiled constraints kept by content
RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(?:\.[0-9]+[ \t]*)?(?::|::=)", re.M)  # `name:` / `name ::=`


class GrammarError(ValueError):
    """A schema, regular expression or grammar that does not compile (the message says where)."""


def schema_counts(schema: dict) -> collections.Counter:
    """How many `$ref`s, branches and enum values a JSON Schema holds (every nested map counted)."""
    counts, stack = collections.Counter(), [schema]
    while stack:  # iterative: no recursion limit to rely on
        value = stack.pop()
        if isinstance(value, dict):
            counts["refs"] += "$ref" in value
            counts["enum_values"] += len(value["enum"]) if isinstance(value.get("enum"), list) else 0
            counts["enum_values"] += "const" in value
            counts["alternatives"] += sum(len(value[k]) for k in ("anyOf", "oneOf", "allOf")
                                          if isinstance(value.get(k), list))
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return counts


def check_limits(kind: str, source) -> None:
    """GrammarError naming the first limit of LIMITS that `source` goes beyond."""
    if kind == "json_schema" and isinstance(source, dict):
        counts = schema_counts(source)
        counts["schema_bytes"] = len(msgspec.json.encode(source))  # json.dumps holds the GIL 15 times longer
    elif kind == "grammar" and isinstance(source, str):
        counts = collections.Counter(grammar_bytes=len(source.encode("utf-8", "replace")),
                                     refs=source.count('"$ref"'), rules=len(RULE.findall(source)),
                                     alternatives=source.count("|"))
    else:
        return
    for name, count in counts.items():
        if count > LIMITS[name]:
            raise GrammarError(f"{kind}: {count} {name.replace('_', ' ')} is beyond the limit of {LIMITS[name]}")


def grammar_text(kind: str, source) -> str:
    """llguidance's grammar for a `json_schema` (a map: a JSON Schema), a `regex` or a `grammar`
    (Lark in llguidance's dialect, or llama.cpp's GBNF)."""
    try:
        if kind == "json_schema":
            if not isinstance(source, dict):
                raise GrammarError("json_schema must be a JSON Schema object")
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(source), defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        if kind == "grammar":
            return llguidance.grammar_from("grammar", source)  # GBNF is converted to Lark, Lark kept
    except GrammarError:
        raise
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{kind}: {first_line(e)}") from None
    raise GrammarError(f"unknown constraint kind {kind!r} (known: {', '.join(KINDS)})")


def first_line(error) -> str:
    """llguidance's message without the excerpt of the grammar it draws below the first line."""
    return str(error).strip().splitlines()[0]


class Grammars:
    """Compiles constraints for one model: its tokenizer, vocabulary size and end-of-sequence tokens.

    llguidance's view of the tokenizer takes a fraction of a second to build (longer for large
    vocabularies): it is built once, by `warm_up` or the first constrained request. Thread-safe.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer = tokenizer
        self.model_vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids)) or None  # None: the tokenizer's own
        self.vocab_size = 0  # the masks' width, once llguidance's tokenizer is built
        self._llg_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # computes masks beside the forward
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (future, kind, source, check) for the compile thread; None ends it
        self._compiler: threading.Thread | None = None
        self._compiler_lock = threading.Lock()
        self._cache: collections.OrderedDict = collections.OrderedDict()  # content_key -> LLMatcher | GrammarError

    @property
    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._llg_tokenizer is None:
                # The model's logits may be wider than the tokenizer (padded embeddings): those ids
                # have no text, and the masks never allow them.
                vocab_size = max(self.model_vocab_size, self.tokenizer.vocab_size)
                try:
                    self._llg_tokenizer = llguidance.LLTokenizer(
                        self.tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=self.eos_token_ids)
                except (ValueError, RuntimeError) as e:
                    raise GrammarError(f"this model's tokenizer cannot take constraints: {first_line(e)}") from None
                self.vocab_size = vocab_size
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="constraint")
            return self._llg_tokenizer

    def warm_up(self) -> None:
        """Build llguidance's tokenizer on a thread of its own now, so that the first constrained
        request does not wait for it on the thread that validates it (a server's event loop)."""
        def build():
            try:
                self.llg_tokenizer
            except Exception as e:  # the requests that ask for a constraint will say why
                log.warning("constrained decoding is unavailable: %s", e)

        threading.Thread(target=build, name="constraint-warm-up", daemon=True).start()

    def submit(self, kind: str, source, check=None) -> concurrent.futures.Future:
        """Compile on the compile thread: a future of a fresh Constraint (one generation's state),
        or of GrammarError saying what is wrong or which limit the source is beyond. `check()`, if
        given, runs there first (the caller's validation of a source too large for its thread)."""
        future = concurrent.futures.Future()
        with self._compiler_lock:  # not self._lock: that one is held while the tokenizer is built
            if self._compiler is None:
                self._compiler = start_thread(self._compile_jobs, "constraint-compile", COMPILE_STACK)
        self._jobs.put((future, kind, source, check))
        return future

    def compile(self, kind: str, source) -> Constraint:
        """`submit`, waited for."""
        return self.submit(kind, source).result()

    def _compile_jobs(self) -> None:
        """The compile thread: one job at a time (a compile is bounded by LIMITS)."""
        while (job := self._jobs.get()) is not None:
            future, kind, source, check = job
            if future.set_running_or_notify_cancel():
                try:
                    if check is not None:
                        check()
                    future.set_result(Constraint(self._matcher(kind, source).deep_copy(), self.vocab_size, self._pool))
                except BaseException as e:
                    future.set_exception(e)

    def _matcher(self, kind: str, source) -> llguidance.LLMatcher:
        """The pristine matcher of a source, from the cache or compiled; GrammarError is cached too."""
        key = content_key(kind, source)
        kept = self._cache.get(key)
        if kept is None:
            began = time.perf_counter()
            try:
                kept = self._compiled(kind, source)
            except GrammarError as e:
                kept = e
            seconds = time.perf_counter() - began
            if seconds > LIMITS["compile_seconds"]:
                kept = GrammarError(f"{kind}: compiling took {seconds:.1f} s, beyond the limit of "
                                    f"{LIMITS['compile_seconds']:g} s")
            self._cache[key] = kept
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        if isinstance(kept, GrammarError):
            raise GrammarError(str(kept))
        return kept

    def _compiled(self, kind: str, source) -> llguidance.LLMatcher:
        check_limits(kind, source)
        grammar = grammar_text(kind, source)
        matcher = llguidance.LLMatcher(self.llg_tokenizer, grammar, log_level=0)  # builds it on first use
        if matcher.is_error():
            raise GrammarError(f"{kind}: {first_line(matcher.get_error())}")
        return matcher

    def close(self) -> None:
        if self._compiler is not None:
            self._jobs.put(None)
            self._compiler.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def content_key(kind: str, source) -> str:
    """A constraint's cache key: the hash of its kind and canonical text."""
    text = source.encode("utf-8", "surrogatepass") if isinstance(source, str) else msgspec.json.encode(source, order="sorted")
    return hashlib.sha256(kind.encode() + b"\0" + text).hexdigest()


def start_thread(target, name: str, stack_size: int) -> threading.Thread:
    """A daemon thread with a stack of its own size (threading's setting is global: restored at once)."""
    previous = threading.stack_size(stack_size)
    try:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
    finally:
        threading.stack_size(previous)
    return thread


class Constraint:
    """One generation's grammar state: the mask of the next position, and the tokens consumed.

    Per position: `start_mask()` (before the forward pass), `apply(logits)` (after it), then
    `consume(token)` with the sampled token. The mask is tagged with the count of tokens consumed
    when it was computed, so that `allowed()` never gives one of an earlier state: the draft rows
    of a step (speculative decoding) each take the mask of the state their previous row's token
    left, computed then.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, pool: concurrent.futures.Executor):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.pool = pool
        self.bitmask = np.zeros((vocab_size + 31) // 32, np.int32)  # [W]
        self.consumed = 0  # tokens consumed: the matcher's state (it only moves forward)
        self.filled = -1  # the state self.bitmask belongs to (-1: none yet)
        self.pending: concurrent.futures.Future | None = None  # filling self.bitmask on the worker

    def _fill(self, state: int) -> None:
        # Writes the mask of the next position into self.bitmask (without the GIL).
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)
        self.filled = state

    def _settle(self) -> None:
        """Wait for the worker (nothing else may touch the matcher meanwhile)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def start_mask(self) -> None:
        """Begin computing the next position's mask on the worker thread."""
        if self.pending is None and self.filled != self.consumed:
            self.pending = self.pool.submit(self._fill, self.consumed)

    def allowed(self) -> np.ndarray:
        """The next position's allowed tokens [V] bool (waits for the mask, or computes it)."""
        self._settle()
        if self.filled != self.consumed:  # none started, or started before the last consume
            self._fill(self.consumed)
        bits = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little", count=self.vocab_size)  # [V]
        return bits.view(bool)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` [V] with every token the grammar forbids at -inf."""
        allowed = self.allowed()[: len(logits)]
        return np.where(allowed, logits, np.float32(-np.inf))  # [V]

    def accepted_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar would take from here (none consumed)."""
        if not tokens:
            return 0
        self._settle()
        return self.matcher.validate_tokens(tokens)

    def consume(self, token: int) -> None:
        """Advance past a sampled token; GrammarError if the grammar does not allow it."""
        self._settle()
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the constraint rejected token {token}: {self.matcher.get_error()}")
        self.consumed += 1
