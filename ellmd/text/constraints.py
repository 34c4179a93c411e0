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
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading

import llguidance
import numpy as np

from ellmd.text.tokenizer import Tokenizer

log = logging.getLogger("ellmd.text")

KINDS = ("json_schema", "regex", "grammar")

# JSON the way json.dumps writes it, on one line: a model cannot wander into endless whitespace.
# A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema, regular expression or grammar that does not compile (the message says where)."""


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

    def compile(self, kind: str, source) -> Constraint:
        """A fresh constraint (one generation's state), or GrammarError saying what is wrong."""
        grammar = grammar_text(kind, source)
        matcher = llguidance.LLMatcher(self.llg_tokenizer, grammar, log_level=0)  # builds it on first use
        if matcher.is_error():
            raise GrammarError(f"{kind}: {first_line(matcher.get_error())}")
        return Constraint(matcher, self.vocab_size, self._pool)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


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
