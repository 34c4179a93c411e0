"""Constrained decoding (ellmd.text.constraints, ellmd.text.tool_grammar): compile errors, masks
that allow exactly the valid continuations, and greedy generations of the built-in SmolLM2 that
come out valid whatever the model would rather write."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from ellmd.engine import Engine
from ellmd.engine.engine import builtin_model_path
from ellmd.engine.sampling import SamplingParams
from ellmd.text import ChatTemplate, Tokenizer
from ellmd.text.constraints import GrammarError, Grammars
from ellmd.text.tool_grammar import tool_call_grammar

ROOT = Path(__file__).resolve().parent.parent
QWEN3_TOKENIZER = ROOT / "tests" / "fixtures" / "qwen3-tokenizer"

# A nested schema whose every part ends: bounded strings, an enum, bounded numbers and arrays.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smol_tokenizer():
    return Tokenizer.from_gguf(builtin_model_path())


@pytest.fixture(scope="module")
def grammars(smol_tokenizer):
    # 64 ids past the tokenizer's, as a model with padded embeddings has
    grammars = Grammars(smol_tokenizer, smol_tokenizer.vocab_size + 64, smol_tokenizer.eos_token_ids)
    yield grammars
    grammars.close()


def texts(tokenizer, allowed: np.ndarray) -> set[str]:
    return {tokenizer.decode([int(i)]) for i in np.flatnonzero(allowed)}


def walk(constraint, tokens) -> np.ndarray:
    """Consume tokens (each checked allowed first); returns the mask after them."""
    for token in tokens:
        assert constraint.allowed()[token], token
        constraint.consume(token)
    return constraint.allowed()


@pytest.mark.parametrize("kind, source, message", [
    ("json_schema", {"type": "strin"}, "json_schema: Invalid type: strin"),
    ("json_schema", {"$ref": "#/nowhere"}, "json_schema: Pointer '/nowhere' does not exist"),
    ("json_schema", [1, 2], "json_schema must be a JSON Schema object"),
    ("regex", "a(b", "regex: "),
    ("grammar", "start: missing", 'unknown name: "missing"'),
    ("grammar", 'root ::= "a" (', "grammar: "),
])
def test_bad_sources_are_one_line_errors(grammars, kind, source, message):
    with pytest.raises(GrammarError) as error:
        grammars.compile(kind, source)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_masks_allow_only_valid_continuations(grammars, smol_tokenizer):
    tok, eos = smol_tokenizer, sorted(smol_tokenizer.eos_token_ids)
    c = grammars.compile("regex", "(yes|no)")
    allowed = c.allowed()
    assert allowed.shape == (tok.vocab_size + 64,) and not allowed[tok.vocab_size:].any()
    assert texts(tok, allowed) == {"y", "ye", "yes", "n", "no"}
    assert texts(tok, walk(c, tok.encode("ye"))) == {"s"}
    after = walk(c, tok.encode("s"))  # complete: only the end of the sequence may follow
    assert np.flatnonzero(after).tolist() == eos
    c.consume(eos[0])

    c = grammars.compile("grammar", 'root ::= "x" [0-9]+')  # GBNF, converted
    assert texts(tok, walk(c, tok.encode("x7"))) >= {"0", "9"} and c.allowed()[eos].all()
    with pytest.raises(GrammarError, match="rejected token"):
        c.consume(tok.encode("a")[0])

    c = grammars.compile("json_schema", PERSON)
    assert texts(tok, c.allowed()) == {'{"'}  # one line, json.dumps's spacing: no whitespace to wander in
    allowed = walk(c, tok.encode('{"name": "Ann", "age": 4'))
    assert "," in texts(tok, allowed) and "0" in texts(tok, allowed) and not allowed[eos].any()


def test_masks_are_computed_beside_the_caller(grammars, smol_tokenizer):
    c = grammars.compile("json_schema", PERSON)
    c.start_mask()  # on the worker thread
    logits = np.zeros(smol_tokenizer.vocab_size + 64, np.float32)
    masked = c.apply(logits)
    assert np.isfinite(masked).sum() == 1 and smol_tokenizer.decode([int(np.argmax(masked))]) == '{"'
    assert logits.max() == 0  # the caller's logits are left alone


def test_a_mask_is_never_one_of_an_earlier_state(grammars, smol_tokenizer):
    """A mask started before a consume (a draft row's, in a step) belongs to the state it started in."""
    tok = smol_tokenizer
    c = grammars.compile("regex", "(yes|no)")
    c.start_mask()
    c.consume(tok.encode("ye")[0])  # without taking the mask started before
    assert texts(tok, c.allowed()) == {"s"}
    c = grammars.compile("regex", "(yes|no)")
    ye, s, no = (tok.encode(text) for text in ("ye", "s", "no"))
    assert c.accepted_prefix(ye + s + no) == len(ye + s)
    assert texts(tok, c.allowed()) == {"y", "ye", "yes", "n", "no"}  # nothing consumed by the check


@pytest.fixture(scope="module")
def engine():
    return Engine(builtin_model_path(), sequence_length=512, batch_size=1, chunk_size=64, threads=2)


def greedy(engine, constraint, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding of slot 0 under a constraint, the mask computed while the forward runs."""
    engine.rewind(0, 0)
    logits = engine.prefill(0, prompt)
    out = []
    for _ in range(max_tokens):
        token = int(np.argmax(constraint.apply(logits)))
        constraint.consume(token)
        out.append(token)
        if token in engine.spec.eos_token_id:
            break
        constraint.start_mask()
        logits = engine.decode([0], [token])[0]
    return out


def chat_prompt(engine, text: str) -> list[int]:
    template: ChatTemplate = engine.chat_template
    return engine.tokenizer.encode(template.render([{"role": "user", "content": text}], add_generation_prompt=True))


def test_a_greedy_generation_under_a_schema_is_valid_json(engine):
    grammars = Grammars(engine.tokenizer, engine.spec.vocab_size, engine.spec.eos_token_id)
    prompt = chat_prompt(engine, "Describe a person in JSON.")
    tokens = greedy(engine, grammars.compile("json_schema", PERSON), prompt, 120)
    assert tokens[-1] in engine.spec.eos_token_id  # the grammar completed and let the end of turn through
    value = json.loads(engine.tokenizer.decode(tokens[:-1]))
    jsonschema.validate(value, PERSON)
    # unconstrained, the model writes prose
    engine.rewind(0, 0)
    free = list(engine.generate(0, prompt, SamplingParams(max_tokens=20)))
    with pytest.raises(ValueError):
        json.loads(engine.tokenizer.decode(free))
    grammars.close()


# ---- strict tools: the Qwen3 tokenizer, whose call markers are tokens ----------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Berlin", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1},
                                                    "note": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
OTHER = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def qwen():
    tokenizer = Tokenizer.from_dir(QWEN3_TOKENIZER)
    grammars = Grammars(tokenizer, 151936, tokenizer.eos_token_ids)
    added = {t.content: i for i, t in tokenizer.backend.get_added_tokens_decoder().items()
             if i not in tokenizer.eos_token_ids}
    yield tokenizer, grammars, added
    grammars.close()


def accepts(qwen, fmt: str, choice: str, text: str) -> bool:
    """Whether the grammar lets a model write `text` and then end."""
    tokenizer, grammars, added = qwen
    c = grammars.compile("grammar", tool_call_grammar(fmt, [WEATHER, OTHER], choice, added))
    for token in tokenizer.encode(text):
        if not c.allowed()[token]:
            return False
        c.consume(token)
    return bool(c.allowed()[sorted(tokenizer.eos_token_ids)].any())


@pytest.mark.parametrize("fmt, choice, text", [
    ("qwen3_coder", "auto", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
                            "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    ("qwen3_coder", "auto", "<think>\nA plain answer.\n</think>\n\nIt is sunny."),
    ("qwen3_coder", "auto", "<tool_call><function=other>\n<parameter=anything>x</parameter></function></tool_call>"),
    ("qwen3_coder", "required", "<function=get_weather>\n<parameter=city>\nBerlin\n</parameter>\n</function>\n</tool_call>"),
    ("qwen3_coder", "get_weather", "<parameter=city>\nBerlin\n</parameter>\n</function>\n</tool_call>"),
    ("qwen3_coder", "get_weather", "<parameter=city>\nBerlin\n</parameter>\n<parameter=note>\nline one\na < b\n"
                                   "</parameter>\n</function>\n</tool_call>"),
    ("hermes", "auto", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
    ("hermes", "get_weather", '{"city": "Berlin", "days": 2}}\n</tool_call>'),
])
def test_strict_tool_grammars_accept_valid_calls(qwen, fmt, choice, text):
    assert accepts(qwen, fmt, choice, text)


@pytest.mark.parametrize("fmt, choice, text", [
    ("qwen3_coder", "auto", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
    ("qwen3_coder", "auto", "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    ("qwen3_coder", "auto", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"),
    ("qwen3_coder", "get_weather", "<parameter=city>\nRome\n</parameter>\n<parameter=days>\n0\n</parameter>\n</function>"),
    ("hermes", "auto", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "extra": 1}}\n</tool_call>'),
    ("hermes", "get_weather", '{"city": "Paris"}}\n</tool_call>'),
])
def test_strict_tool_grammars_refuse_invalid_calls(qwen, fmt, choice, text):
    assert not accepts(qwen, fmt, choice, text)


@pytest.mark.parametrize("kind, source, limit", [
    ("json_schema", {"enum": list(range(10_001))}, "10001 enum values is beyond the limit of 10000"),
    ("json_schema", {"anyOf": [{"type": "integer", "minimum": i} for i in range(10_001)]}, "alternatives is beyond the limit of 10000"),
    ("json_schema", {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(2_001)}, "$ref": "#/$defs/d0"},
     "2002 refs is beyond the limit of 2000"),
    ("json_schema", {"description": "x" * (512 << 10)}, "schema bytes is beyond the limit of 524288"),
    ("grammar", "start: r0\n" + "".join(f'r{i}: "a"\n' for i in range(10_001)), "10002 rules is beyond the limit"),
    ("grammar", 'start: "a"' + ' | "b"' * 10_001, "10001 alternatives is beyond the limit of 10000"),
])
def test_sources_beyond_a_limit_are_refused_naming_it(grammars, kind, source, limit):
    with pytest.raises(GrammarError, match=limit):
        grammars.compile(kind, source)


def test_compiled_constraints_are_kept_by_content(grammars):
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    first = grammars.compile("json_schema", schema)
    kept = len(grammars._cache)
    again = grammars.compile("json_schema", dict(reversed(schema.items())))  # the same content, keys reordered
    assert len(grammars._cache) == kept  # not compiled again
    first.consume(int(np.flatnonzero(first.allowed())[0]))
    assert first.matcher is not again.matcher and again.consumed == 0  # each generation its own state
    assert texts(grammars.tokenizer, again.allowed()) == {"{\""}  # the start, as the first had
