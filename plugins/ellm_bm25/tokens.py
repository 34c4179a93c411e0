"""Tokens for BM25 over prose and code: lowercase words, identifiers whole and in parts, no stop words."""

from __future__ import annotations

import re

WORD = re.compile(r"\w+")  # letters, digits and underscores: a word or an identifier
PART = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")  # HTTPServer -> HTTP Server; parse_json2 -> parse json 2
STOP_WORDS = frozenset(
    "a an and are as at be but by do does for from has have how i if in into is it its not of on or "
    "so than that the their then there these they this to was we were what when where which who will "
    "with you your".split()
)


def tokenize(text: str) -> list[str]:
    """Each word lowercased, and for an identifier (snake_case, camelCase) also its parts, so that
    "parse config" finds parseConfig and parse_config; stop words and one-letter parts dropped."""
    tokens = []
    for word in WORD.findall(text):
        whole = word.strip("_").lower()
        if whole and whole not in STOP_WORDS:
            tokens.append(whole)
        if word.isascii():
            parts = PART.findall(word)
            if len(parts) > 1:
                tokens.extend(p for p in map(str.lower, parts) if len(p) > 1 and p not in STOP_WORDS)
    return tokens
