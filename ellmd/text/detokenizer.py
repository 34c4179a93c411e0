"""Streaming text out of generated tokens: whole UTF-8 characters only, and stop strings held back."""

from __future__ import annotations

import codecs


class IncrementalDetokenizer:
    """Turn token ids into text as they come, never splitting a multi-byte character.

    A byte-level token may carry part of a character (an emoji is often two or three tokens);
    incomplete bytes are held until the character completes. Concatenating every `push` and the
    final `flush` equals `tokenizer.decode(ids, skip_special_tokens)`.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Same replacement rule as tokenizers' from_utf8_lossy: one U+FFFD per maximal invalid subpart.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        if self.skip_special_tokens and token_id in self.tokenizer.special_ids:
            return ""
        return self._decoder.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End of generation: held bytes that never completed a character become U+FFFD."""
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Cut streamed text at the first stop string.

    Text that might be the start of a stop string is held back until it is decided; on a hit the
    text before the stop string is released, the stop string is not, and `hit` names it.
    """

    def __init__(self, stop_strings):
        self.stop_strings = [s for s in stop_strings if s]
        self.hit: str | None = None
        self._held = ""

    def push(self, text: str) -> str:
        """Add text; return what is safe to emit. After a hit, everything is swallowed."""
        if self.hit is not None:
            return ""
        text = self._held + text
        found = [(text.find(s), -len(s), s) for s in self.stop_strings if s in text]
        if found:
            at, _, self.hit = min(found)
            self._held = ""
            return text[:at]
        keep = self._undecided(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def _undecided(self, text: str) -> int:
        # Length of the longest tail of `text` that could still grow into a stop string.
        longest = 0
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def flush(self) -> str:
        """End of generation without a hit: release what was held."""
        held, self._held = self._held, ""
        return held
