"""Tokenizer: a `tokenizers.Tokenizer` plus the special tokens and chat template a model ships with.

Two sources: a Hugging Face checkpoint directory (tokenizer.json, tokenizer_config.json,
chat_template.jinja, generation_config.json) or the metadata of a GGUF file, from which a
byte-level BPE tokenizer is rebuilt the way llama.cpp and transformers read it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from functools import cached_property, lru_cache
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED ones are added
# tokens that are always matched whole but not special.
_CONTROL = 3
_USER_DEFINED = 4
# Texts longer than this (characters) are encoded with the GIL released (a 4 MB text takes ~4 s):
# the servers' event loop goes on meanwhile. Shorter ones take the plain call, which is cheaper.
LONG_TEXT = 1 << 16

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's "smollm"/"starcoder" split: every digit alone, then GPT-2's regex; this is also
    # what SmolLM2's own tokenizer.json says.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


# tokenizer.ggml.pre -> pre-tokenizer, after llama.cpp's llama-vocab.cpp.
_GGUF_PRE_TOKENIZERS = {
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-v3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
    "deepseek-r1-qwen": lambda: _split_then_bytes(_QWEN2_SPLIT),
}
# Qwen's tokenizer.json normalizes to NFC; llama.cpp skips it, but the model was trained on NFC text.
_NFC_PRE = {"qwen2", "deepseek-r1-qwen"}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _token_content(value) -> str | None:
    # tokenizer_config.json spells a token as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A byte-level BPE tokenizer with the model's special tokens and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        extra_eos_ids: tuple[int, ...] | list[int] = (),
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.bos_token_id = self._id_of(bos_token)
        self.pad_token_id = self._id_of(pad_token)
        eos_id = self._id_of(eos_token)
        self.eos_token_ids = {i for i in (eos_id, *extra_eos_ids) if i is not None}
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, tok in added.items() if tok.special)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json."""
        path = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):
            template = {t["name"]: t["template"] for t in template}.get("default")
        if (path / "chat_template.jinja").is_file():
            # transformers prefers the standalone file over the config entry.
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        bos = _token_content(config.get("bos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No flag: add BOS when the tokenizer.json post-processor does (Llama 3 style).
            bos_id = backend.token_to_id(bos) if bos is not None else None
            add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        eos_ids = _read_json(path / "generation_config.json").get("eos_token_id")
        if isinstance(eos_ids, int):
            eos_ids = [eos_ids]
        return cls(
            backend,
            bos_token=bos,
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            add_bos_token=bool(add_bos),
            extra_eos_ids=eos_ids or (),
            chat_template=template,
        )

    @classmethod
    def from_gguf(cls, source) -> Tokenizer:
        """Rebuild the tokenizer from GGUF metadata.

        `source` is a `gguf.GGUFReader`, a path to a GGUF file, or a mapping of metadata keys
        ("tokenizer.ggml.tokens", ...) to values.
        """
        if isinstance(source, Mapping):
            metadata = source
        else:
            if not hasattr(source, "fields"):
                import gguf

                source = gguf.GGUFReader(str(source))
            metadata = {k: f.contents() for k, f in source.fields.items() if k.startswith("tokenizer.")}
        field = metadata.get

        model = field("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE: 'gpt2')")
        pre = field("tokenizer.ggml.pre", "default")
        if pre not in _GGUF_PRE_TOKENIZERS:
            known = ", ".join(sorted(_GGUF_PRE_TOKENIZERS))
            raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (known: {known})")
        tokens = field("tokenizer.ggml.tokens")
        types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {}
        for index, (token, kind) in enumerate(zip(tokens, types)):
            if kind not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
                # A normal token stored as plain text: respell it in the byte alphabet, as transformers does.
                token = "".join(spelling[b] for b in token.encode("utf-8"))
            vocab[token] = index
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
        backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))
        if pre in _NFC_PRE:
            backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = _GGUF_PRE_TOKENIZERS[pre]()
        backend.decoder = decoders.ByteLevel()
        typed = list(zip(tokens, types))
        control = [AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL]
        backend.add_special_tokens(control)
        backend.add_tokens([AddedToken(t, normalized=False) for t, k in typed if k == _USER_DEFINED])

        def token_at(key):
            index = field(key)
            return None if index is None or index >= len(tokens) else tokens[index]

        # End-of-turn / end-of-message tokens also end generation (llama.cpp's "end of generation").
        extra_eos = [field(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
        return cls(
            backend,
            bos_token=token_at("tokenizer.ggml.bos_token_id"),
            eos_token=token_at("tokenizer.ggml.eos_token_id"),
            pad_token=token_at("tokenizer.ggml.padding_token_id"),
            add_bos_token=bool(field("tokenizer.ggml.add_bos_token", False)),
            extra_eos_ids=[i for i in extra_eos if i is not None],
            chat_template=field("tokenizer.chat_template"),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids.

        `add_special_tokens` prepends BOS when the model asks for it (`add_bos_token`).
        """
        if len(text) > LONG_TEXT:  # tokenizers' encode holds the GIL throughout; encode_batch lets it go
            ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (possibly part of a UTF-8 character)."""
        return self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b""

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        # tokenizers' ByteLevel decoder rule, applied to every token (added ones too): a token spelled
        # entirely in the byte alphabet maps back to bytes, any other token is its own UTF-8.
        decoder = self.backend.decoder
        if decoder is None or b"ByteLevel" not in decoder.__getstate__():
            raise ValueError("token_bytes needs a byte-level BPE tokenizer (ByteLevel decoder)")
        to_byte = {c: b for b, c in bytes_to_unicode().items()}
        vocab = self.backend.get_vocab(with_added_tokens=True)
        table = [b""] * (max(vocab.values(), default=-1) + 1)
        for token, i in vocab.items():
            if all(c in to_byte for c in token):
                table[i] = bytes(to_byte[c] for c in token)
            else:
                table[i] = token.encode("utf-8")
        return table

    @cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes one token spells (None: not known, the tokenizer is not byte-level)."""
        try:
            return max(map(len, self._token_bytes), default=0) or None
        except ValueError:
            return None

    def cannot_fit(self, text: str, room: int) -> bool:
        """True when `text` surely encodes to more than `room` tokens, found without encoding it:
        a token spells at most max_token_bytes bytes, a character at least one (halved for the
        normalizer, which may join characters)."""
        return self.max_token_bytes is not None and len(text) > 2 * room * self.max_token_bytes

    def fingerprint(self) -> str:
        """sha256 hex over vocabulary, merges, added tokens, special tokens and chat template."""
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> str:
        # Serializing a large vocabulary takes a fraction of a second: done once.
        h = hashlib.sha256()
        h.update(self.backend.to_str().encode("utf-8"))
        special = [self.bos_token, self.eos_token, sorted(self.eos_token_ids), self.add_bos_token]
        h.update(json.dumps([*special, self.chat_template]).encode("utf-8"))
        return h.hexdigest()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
