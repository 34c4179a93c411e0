"""The OpenAI-compatible HTTP API of the real daemon, driven by the real `openai` client.

Two daemons: the built-in SmolLM2 (a trained model, greedy) for chat, completions, sessions,
metrics and errors; and a one-layer Qwen3 checkpoint with the real Qwen3-Coder tokenizer and
template whose weights make it write one fixed tool call, for the tool-call paths (SmolLM2's
template has no tool-call format).
"""

from __future__ import annotations

import itertools
import json
import shutil
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import save_file

from ellmd.text import Tokenizer

from daemon import Daemon

ROOT = Path(__file__).resolve().parent.parent
QWEN3_TOKENIZER = ROOT / "tests" / "fixtures" / "qwen3-tokenizer"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(tmp: Path, slots: int, extra=()) -> tuple[Daemon, int]:
    port = free_port()
    daemon = Daemon(tmp, slots=slots, extra=[*extra, "--http", f"127.0.0.1:{port}"]).start()
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as reply:
                assert json.load(reply) == {"status": "ok"}
            return daemon, port
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    daemon, port = start_daemon(tmp_path_factory.mktemp("http"), slots=2)
    yield daemon, port
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
def client(smol):
    return OpenAI(base_url=f"http://127.0.0.1:{smol[1]}/v1", api_key="none", max_retries=0)


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}") as reply:
        return reply.read().decode()


def post(port: int, path: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def scrape(port: int) -> dict[str, float]:
    """The unlabelled samples of /metrics (counters, gauges, histogram counts and sums)."""
    families = text_string_to_metric_families(get(port, "/metrics"))
    return {s.name: s.value for family in families for s in family.samples if not s.labels}


# ---- the built-in model --------------------------------------------------------------------


def test_models_and_health(smol, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert models[0].owned_by == "ellm" and models[0].max_model_len == 2048
    assert json.loads(get(smol[1], "/health")) == {"status": "ok"}


def test_chat_plain_and_streamed_agree(client):
    raw = client.chat.completions.with_raw_response.create(
        model="smol", messages=QUESTION, max_tokens=12, temperature=0)
    reply = raw.parse()
    message = reply.choices[0].message
    assert message.role == "assistant" and "Paris" in message.content and message.tool_calls is None
    assert reply.object == "chat.completion" and reply.model == "smol"
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert 0 < reply.usage.completion_tokens <= 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert raw.headers["X-Session-Id"] == reply.session_id

    chunks = list(client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reply.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_second_turn_reuses_the_first(client):
    """A plain client resending its conversation: everything up to the reply's last token is reused.

    The first turn's last generated token is not in the KV yet (it is sampled, not run through the
    model), so the second turn finds prompt + completion - 1 tokens already computed.
    """
    first = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=10, temperature=0)
    messages = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(model="smol", messages=messages, max_tokens=10, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.usage.prompt_tokens - cached < 20  # the new user turn and the generation prompt


def test_session_binding_by_field_and_header(smol, client):
    first = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=8, temperature=0,
                                           extra_body={"session_id": "http-bound"})
    assert first.session_id == "http-bound"
    # A new session: what it reuses is a prefix another session holds (the same question was
    # asked before, or the template's default system prompt), never more than its prompt but one.
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    messages = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Why?"}]
    raw = client.chat.completions.with_raw_response.create(
        model="smol", messages=messages, max_tokens=8, temperature=0, extra_headers={"X-Session-Id": "http-bound"})
    second = raw.parse()
    assert raw.headers["X-Session-Id"] == second.session_id == "http-bound"
    assert (second.usage.prompt_tokens_details.cached_tokens
            == first.usage.prompt_tokens + first.usage.completion_tokens - 1)
    with smol[0].client() as unix:  # the same session, seen over the Unix socket
        info = unix.session("http-bound").info()
    assert info["tokens"] >= second.usage.prompt_tokens and not info["busy"]


def test_streamed_header_names_the_session(smol):
    client = OpenAI(base_url=f"http://127.0.0.1:{smol[1]}/v1", api_key="none", max_retries=0)
    with client.chat.completions.with_streaming_response.create(
            model="smol", messages=QUESTION, max_tokens=4, temperature=0, stream=True,
            extra_body={"session_id": "http-streamed"}) as raw:
        assert raw.headers["X-Session-Id"] == "http-streamed"
        chunks = list(raw.parse())
    assert chunks[-1].session_id == "http-streamed"
    # Without a session named, the header still says which session the runtime chose.
    with client.completions.with_streaming_response.create(
            model="smol", prompt="The capital of Italy is", max_tokens=4, temperature=0, stream=True) as raw:
        chunks = list(raw.parse())
        assert raw.headers["X-Session-Id"] == chunks[-1].session_id


def test_disconnect_cancels_the_generation(smol, client):
    stream = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=1000, temperature=0,
                                            stream=True, extra_body={"session_id": "http-gone", "ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()
    with smol[0].client() as unix:
        deadline = time.monotonic() + 60
        while (info := unix.session("http-gone").info())["busy"] and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not info["busy"] and info["tokens"] < 500  # well short of the 1000 tokens asked for


def test_completions_plain_streamed_and_reused(client):
    prompt = "The capital of France is"
    first = client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0)
    assert first.object == "text_completion" and first.choices[0].text
    chunks = list(client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == first.choices[0].text
    assert chunks[-1].choices[0].finish_reason == first.choices[0].finish_reason
    longer = client.completions.create(model="smol", prompt=prompt + first.choices[0].text + " Its", max_tokens=4,
                                       temperature=0, logprobs=2)
    assert longer.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    logprobs = longer.choices[0].logprobs
    assert len(logprobs.tokens) == longer.usage.completion_tokens
    assert all(len(top) == 2 and lp <= 0 for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))


def test_chat_logprobs(client):
    reply = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=3, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:  # greedy: the chosen token is the most likely one
        assert [t.token for t in entry.top_logprobs][0] == entry.token and len(entry.top_logprobs) == 3


def test_a_new_conversation_copies_the_system_prompt_another_one_holds(smol, client):
    system = {"role": "system", "content": "You are a terse assistant for a weather station. " * 12}
    before = scrape(smol[1])
    first = client.chat.completions.create(model="smol", messages=[system, *QUESTION], max_tokens=6, temperature=0,
                                           extra_body={"session_id": "station-1"})
    second = client.chat.completions.create(model="smol", messages=[system, *QUESTION], max_tokens=6, temperature=0,
                                            extra_body={"session_id": "station-2"})
    other = client.chat.completions.create(model="smol", max_tokens=6, temperature=0,
                                           messages=[system, {"role": "user", "content": "Is it raining?"}])
    after = scrape(smol[1])
    # station-2 asks what station-1 asked: all of its prompt but the last token is copied, and the
    # copy computes what station-1's prefill did
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert second.choices[0].message.content == first.choices[0].message.content
    # another question after the same system prompt: at least the system prompt is copied
    assert 120 < other.usage.prompt_tokens_details.cached_tokens < other.usage.prompt_tokens
    shared = after["ellm_prompt_tokens_shared_total"] - before["ellm_prompt_tokens_shared_total"]
    assert shared >= second.usage.prompt_tokens_details.cached_tokens + other.usage.prompt_tokens_details.cached_tokens


def test_metrics_move(smol, client):
    """Two turns of one conversation move every counter, reuse included (the second turn reuses the
    first): the test makes its own figures, alone or after others."""
    before = scrape(smol[1])
    messages = [{"role": "user", "content": "Count to five."}]
    first = client.chat.completions.create(model="smol", messages=messages, max_tokens=6, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Go on."}]
    second = client.chat.completions.create(model="smol", messages=messages, max_tokens=6, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    reused = first.usage.prompt_tokens_details.cached_tokens + second.usage.prompt_tokens_details.cached_tokens
    after = scrape(smol[1])
    for name in ("ellm_prompt_tokens_prefilled_total", "ellm_generated_tokens_total",
                 "ellm_time_to_first_token_seconds_count", "ellm_decode_tokens_per_second_count"):
        assert after[name] > before[name], name
    assert after["ellm_prompt_tokens_reused_total"] - before["ellm_prompt_tokens_reused_total"] == reused
    assert after["ellm_time_to_first_token_seconds_sum"] > 0 and after["ellm_last_decode_tokens_per_second"] > 0
    assert 1 <= after["ellm_sessions_resident"] <= 2 and after["ellm_sessions_stored"] >= 1
    assert 0 < after["ellm_kv_bytes_used"] < after["ellm_kv_bytes_capacity"]
    assert after["ellm_generations_active"] == 0


def test_errors_are_openai_errors_and_the_server_keeps_serving(smol, client):
    port = smol[1]
    status, body = post(port, "/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = post(port, "/v1/chat/completions", json.dumps({"model": "smol"}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = post(port, "/v1/nowhere", b"{}")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model="smol", messages=QUESTION, n=2)
    with pytest.raises(openai.BadRequestError, match="temperature must be a number"):
        client.chat.completions.create(model="smol", messages=QUESTION, extra_body={"temperature": "hot"})
    with pytest.raises(openai.BadRequestError, match="tool-call format"):
        client.chat.completions.create(model="smol", messages=QUESTION, tools=[WEATHER], tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="echo is not supported"):
        client.completions.create(model="smol", prompt="Hi", echo=True)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="smol", prompt="word " * 2100, max_tokens=4)
    assert error.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="session_id must match"):
        client.chat.completions.create(model="smol", messages=QUESTION, extra_body={"session_id": "no spaces"})
    reply = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=2, temperature=0)
    assert reply.choices[0].message.content


def test_no_tokens_asked_is_refused_as_openai_does(smol):
    """max_tokens 0 used to generate one token (finish "length"); OpenAI refuses it with a 400
    naming the field, and so do the chat, completions, Responses and Messages APIs here."""
    port = smol[1]
    asked = [("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
             ("/v1/chat/completions", {"messages": QUESTION, "max_completion_tokens": 0}, "max_completion_tokens"),
             ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
             ("/v1/responses", {"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
             ("/v1/messages", {"messages": QUESTION, "max_tokens": 0}, "max_tokens")]
    for path, body, name in asked:
        status, reply = post(port, path, json.dumps({"model": "smol", **body}).encode())
        assert status == 400, (path, reply)
        assert f"{name} must be >= 1" in json.dumps(reply), (path, reply)
    status, reply = post(port, "/v1/chat/completions", json.dumps(
        {"model": "smol", "messages": QUESTION, "max_tokens": 1, "temperature": 0}).encode())
    assert status == 200 and reply["usage"]["completion_tokens"] == 1


# ---- tool calls: a model that always calls get_weather -------------------------------------

CALL_HEAD = "<tool_call><function=get_weather>\n"
CALL_REST = "<parameter=city>Paris</parameter></function></tool_call>"


def distinct_pieces(parts: list[str], vocab: dict[bytes, int], taken: set[int]) -> list[list[int]]:
    """Token ids spelling each part, no id repeated (across parts too) nor in `taken`.

    A depth-first search over the ways to split the text into vocabulary tokens (longest first, none
    across two parts) that remembers its dead ends: a position, with the used tokens that could still
    occur after it.
    """
    text, bounds = "".join(parts), list(itertools.accumulate(map(len, parts)))
    n = len(text)
    splits = [[(j, vocab[text[i:j].encode()]) for j in range(min(b for b in bounds if b > i), i, -1)
               if text[i:j].encode() in vocab] for i in range(n)]
    ahead = [set() for _ in range(n + 1)]  # the tokens that can occur from each position on
    for i in reversed(range(n)):
        ahead[i] = ahead[i + 1] | {token for _, token in splits[i]}
    dead_ends = set()

    def search(i: int, used: frozenset) -> list[tuple[int, int]] | None:
        if i == n:
            return []
        key = (i, used & ahead[i])
        if key not in dead_ends:
            for j, token in splits[i]:
                if token not in used and (rest := search(j, used | {token})) is not None:
                    return [(j, token), *rest]
            dead_ends.add(key)
        return None

    found = search(0, frozenset(taken))
    assert found is not None, f"no split of {text!r} into distinct tokens"
    return [[token for end, token in found if start < end <= stop] for start, stop in zip([0, *bounds], bounds)]


def write_tool_caller(directory: Path) -> Path:
    """A Qwen3 checkpoint (real Qwen3-Coder tokenizer and template) that writes one fixed tool call.

    Its projections are all zero, so no layer changes the residual stream and the next token depends
    on the current one alone: a bigram model. Embeddings are one-hot on a chain of distinct tokens
    and the LM head maps each to its successor. After the generation prompt ("assistant\\n") the model
    writes CALL_HEAD + CALL_REST; after the opening that tool_choice forces for get_weather, which
    ends as CALL_HEAD does, it writes CALL_REST.
    """
    tokenizer = Tokenizer.from_dir(QWEN3_TOKENIZER)
    vocab = {tokenizer.token_bytes(i): i for i in range(tokenizer.vocab_size)}
    after_prompt = tokenizer.encode("<|im_start|>assistant\n")[-1]
    after_forced = tokenizer.encode("<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n")[-1]
    head, rest = distinct_pieces([CALL_HEAD, CALL_REST], vocab, {after_prompt})
    assert head[-1] == after_forced  # both end with ">\n": CALL_REST follows either way
    (eos,) = tokenizer.eos_token_ids
    successors = dict(zip([after_prompt, *head, *rest], [*head, *rest, eos]))

    hidden, vocab_size, heads, kv_heads, head_dim = 64, 151936, 4, 2, 16
    embed = np.zeros((vocab_size, hidden), np.float16)
    lm_head = np.zeros((vocab_size, hidden), np.float16)
    for dim, (token, successor) in enumerate(successors.items(), start=1):
        embed[token, dim] = 1.0
        lm_head[successor, dim] = 10.0  # after the final norm: logit 80 for the successor, 0 elsewhere
    zeros = lambda *shape: np.zeros(shape, np.float16)  # noqa: E731
    ones = lambda *shape: np.ones(shape, np.float16)  # noqa: E731
    layer = "model.layers.0."
    tensors = {
        "model.embed_tokens.weight": embed, "lm_head.weight": lm_head, "model.norm.weight": ones(hidden),
        layer + "input_layernorm.weight": ones(hidden), layer + "post_attention_layernorm.weight": ones(hidden),
        layer + "self_attn.q_proj.weight": zeros(heads * head_dim, hidden),
        layer + "self_attn.k_proj.weight": zeros(kv_heads * head_dim, hidden),
        layer + "self_attn.v_proj.weight": zeros(kv_heads * head_dim, hidden),
        layer + "self_attn.o_proj.weight": zeros(hidden, heads * head_dim),
        layer + "self_attn.q_norm.weight": ones(head_dim), layer + "self_attn.k_norm.weight": ones(head_dim),
        layer + "mlp.gate_proj.weight": zeros(hidden, hidden), layer + "mlp.up_proj.weight": zeros(hidden, hidden),
        layer + "mlp.down_proj.weight": zeros(hidden, hidden),
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab_size,
              "hidden_size": hidden, "intermediate_size": hidden, "num_hidden_layers": 1,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
              "tie_word_embeddings": False, "torch_dtype": "float16", "eos_token_id": eos}
    (directory / "config.json").write_text(json.dumps(config))
    for file in QWEN3_TOKENIZER.iterdir():
        shutil.copy(file, directory / file.name)
    return directory


@pytest.fixture(scope="module")
def tools_client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http-tools")
    model = write_tool_caller(tmp / "tool-caller")
    daemon, port = start_daemon(tmp, slots=1, extra=["--model-path", str(model), "--weight-dtype", "bf16"])
    yield OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    assert daemon.stop() == 0


def assert_weather_call(calls) -> None:
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("tool_choice", ["auto", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls(tools_client, tool_choice):
    reply = tools_client.chat.completions.create(
        model="tool-caller", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
        tool_choice=tool_choice, max_tokens=40, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert_weather_call(choice.message.tool_calls)


def test_tool_calls_streamed_without_markup(tools_client):
    chunks = list(tools_client.chat.completions.create(
        model="tool-caller", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
        max_tokens=40, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == ""  # the markup never leaks as content
    calls = [call for d in deltas for call in d.tool_calls or ()]
    assert [call.index for call in calls] == [0]
    assert_weather_call(calls)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_leaves_the_text_alone(tools_client):
    reply = tools_client.chat.completions.create(
        model="tool-caller", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
        tool_choice="none", max_tokens=40, temperature=0)
    assert reply.choices[0].message.content == CALL_HEAD + CALL_REST
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"
