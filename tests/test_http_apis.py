"""The OpenAI Responses API and the Anthropic Messages API of the real daemon, driven by the real
`openai` and `anthropic` clients.

Two daemons, as in test_http.py: the built-in SmolLM2 (a trained model, greedy) for text, sessions
and a restart; the one-layer Qwen3 tool caller (it always writes one get_weather call) for tools.
Expected texts come from the daemon's own chat completions of the same conversation: a response
continued from a stored point must be that conversation, token for token.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import anthropic
import jsonschema
import openai
import pytest
from openai import OpenAI

from test_http import CALL_HEAD, CALL_REST, QUESTION, post, start_daemon, write_tool_caller

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER["parameters"]}
INSTRUCTIONS = "You are a terse geography assistant."
GREEDY = {"temperature": 0}
LOOPBACK = ("127.0.0.1", "::1", "localhost", b"127.0.0.1", b"localhost")


class Served:
    """A daemon on a temporary store that a test can restart in place (same store, new port)."""

    def __init__(self, tmp, slots: int, extra=()):
        self.tmp, self.slots, self.extra = tmp, slots, list(extra)
        self.daemon, self.port = start_daemon(tmp, slots, self.extra)

    def restart(self) -> None:
        assert self.daemon.stop() == 0
        self.daemon, self.port = start_daemon(self.tmp, self.slots, self.extra)

    def openai(self) -> OpenAI:
        return OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=f"http://127.0.0.1:{self.port}", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    served = Served(tmp_path_factory.mktemp("apis"), slots=2)
    yield served
    assert served.daemon.stop() == 0


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("apis-tools")
    model = write_tool_caller(tmp / "tool-caller")
    served = Served(tmp, slots=1, extra=["--model-path", str(model), "--weight-dtype", "bf16"])
    yield served
    assert served.daemon.stop() == 0


def chat_reference(client: OpenAI, questions: list[str], answers: list[str], max_tokens: int):
    """The chat completion of the conversation: instructions, then questions and answers in turn."""
    messages = [{"role": "system", "content": INSTRUCTIONS}]
    for i, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return client.chat.completions.create(model="smol", messages=messages, max_tokens=max_tokens, **GREEDY)


def ask(client: OpenAI, question: str, previous=None, **kwargs):
    return client.responses.create(model="smol", input=question, instructions=INSTRUCTIONS, max_output_tokens=10,
                                   previous_response_id=previous.id if previous else openai.omit, **GREEDY, **kwargs)


# ---- Responses: text, streaming, stored conversations ---------------------------------------


def test_responses_whole_and_streamed_agree(smol):
    client = smol.openai()
    reply = ask(client, QUESTION[0]["content"])
    assert reply.object == "response" and reply.status in ("completed", "incomplete") and reply.model == "smol"
    assert [item.type for item in reply.output] == ["message"] and reply.output_text
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    reference = chat_reference(client, [QUESTION[0]["content"]], [], 10)
    assert reply.output_text == reference.choices[0].message.content
    assert reply.usage.input_tokens == reference.usage.prompt_tokens

    events = list(client.responses.create(model="smol", input=QUESTION[0]["content"], instructions=INSTRUCTIONS,
                                          max_output_tokens=10, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if reply.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == reply.output_text
    assert events[0].response.id == final.id and final.usage.output_tokens == reply.usage.output_tokens


def test_previous_response_id_prefills_only_the_new_input(smol):
    """A stored response's conversation goes on in its session: what the session holds is reused
    (all but the reply's last token, which is sampled, not yet run), and the continuation is the
    conversation the chat completions API would see."""
    client = smol.openai()
    first = ask(client, "What is the capital of France?")
    second = ask(client, "And of Italy?", previous=first)
    assert second.previous_response_id == first.id and second.id != first.id
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached == first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens - cached < 20  # the new user turn, the generation prompt
    reference = chat_reference(client, ["What is the capital of France?", "And of Italy?"], [first.output_text], 10)
    assert second.output_text == reference.choices[0].message.content
    assert second.usage.input_tokens == reference.usage.prompt_tokens

    streamed = list(client.responses.create(model="smol", input="And of Spain?", previous_response_id=second.id,
                                            max_output_tokens=10, stream=True, **GREEDY))
    final = streamed[-1].response
    assert final.usage.input_tokens_details.cached_tokens == second.usage.input_tokens + second.usage.output_tokens - 1


def test_an_earlier_point_continues_in_a_branch(smol):
    """Continuing one response twice: the second continuation branches (its KV copied), and the
    first one's conversation stays whole, to be continued in turn."""
    client = smol.openai()
    first = ask(client, "What is the capital of France?")
    italy = ask(client, "And of Italy?", previous=first)
    spain = ask(client, "And of Spain?", previous=first)
    assert spain.id.split("_", 2)[2] != italy.id.split("_", 2)[2]  # another session
    assert spain.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens
    reference = chat_reference(client, ["What is the capital of France?", "And of Spain?"], [first.output_text], 10)
    assert spain.output_text == reference.choices[0].message.content

    germany = ask(client, "And of Germany?", previous=italy)  # the first branch, untouched by the second
    questions = ["What is the capital of France?", "And of Italy?", "And of Germany?"]
    reference = chat_reference(client, questions, [first.output_text, italy.output_text], 10)
    assert germany.output_text == reference.choices[0].message.content
    assert germany.usage.input_tokens == reference.usage.prompt_tokens
    assert germany.usage.input_tokens_details.cached_tokens == italy.usage.input_tokens + italy.usage.output_tokens - 1


def test_a_stored_conversation_resent_whole_goes_on_in_its_session(smol):
    """The Agents SDK's default: every request resends the whole input, stored. It extends the
    stored session, whose earlier responses stay continuable."""
    client = smol.openai()
    first = ask(client, "What is the capital of France?")
    items = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And of Italy?"}]
    second = client.responses.create(model="smol", input=items, instructions=INSTRUCTIONS, max_output_tokens=10,
                                     **GREEDY)
    assert second.id.split("_", 2)[2] == first.id.split("_", 2)[2]  # the same session
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens - 1
    spain = ask(client, "And of Spain?", previous=first)  # the earlier point is still there: a branch
    reference = chat_reference(client, ["What is the capital of France?", "And of Spain?"], [first.output_text], 10)
    assert spain.output_text == reference.choices[0].message.content


def test_unstored_responses_reuse_by_prefix_and_continue_nothing(smol):
    client = smol.openai()
    first = ask(client, "Name a large ocean.", store=False)
    assert first.store is False
    with pytest.raises(openai.NotFoundError, match="previous response"):
        ask(client, "Another one?", previous=first)
    conversation = [{"role": "user", "content": "Name a large ocean."},
                    {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Another one?"}]
    second = client.responses.create(model="smol", input=conversation, instructions=INSTRUCTIONS, store=False,
                                     max_output_tokens=10, **GREEDY)
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens - 1


def test_a_stored_response_is_retrieved_as_created(smol):
    """GET /v1/responses/{id} gives the response object its POST gave (whole or streamed, first or
    continued); an unstored, unknown or malformed id is a 404 in OpenAI's error shape."""
    client = smol.openai()
    first = ask(client, "What is the capital of Spain?")
    second = ask(client, "And of Portugal?", previous=first)
    streamed = list(client.responses.create(model="smol", input="And of Greece?", previous_response_id=second.id,
                                            max_output_tokens=10, stream=True, **GREEDY))[-1].response
    for response in (first, second, streamed):
        assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    assert first.status in ("completed", "incomplete") and first.usage.output_tokens > 0
    session = first.id.split("_", 2)[2]
    unstored = ask(client, "Hi", store=False)
    for missing in (unstored.id, "resp_nothing", "resp_0123456789abcdef_no-such-session",
                    f"resp_0123456789abcdef_{session}"):
        with pytest.raises(openai.NotFoundError, match="not found"):
            client.responses.retrieve(missing)
    client.responses.delete(second.id)  # forgotten: neither retrieved nor continued; the others stay
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError, match="previous response"):
        ask(client, "And of Malta?", previous=second)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.delete(second.id)
    assert client.responses.retrieve(streamed.id).model_dump() == streamed.model_dump()
    assert ask(client, "And of Andorra?", previous=first).output_text
    status, body = get_json(smol.port, "/v1/responses/resp_nothing")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"  # as OpenAI types a missing response
    assert body["error"]["param"] == "response_id" and "not found" in body["error"]["message"]


def get_json(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}") as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_responses_errors(smol):
    client = smol.openai()
    with pytest.raises(openai.NotFoundError, match="previous response"):
        ask(client, "Hi", previous=type("R", (), {"id": "resp_0123456789abcdef_no-such-session"}))
    with pytest.raises(openai.BadRequestError, match="only function tools"):
        client.responses.create(model="smol", input="Hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="text.format must be"):
        client.responses.create(model="smol", input="Hi", text={"format": {"type": "xml"}})
    with pytest.raises(openai.BadRequestError, match="only text parts"):
        client.responses.create(model="smol", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    status, body = post(smol.port, "/v1/responses", json.dumps({"input": []}).encode())
    assert status == 400 and body["error"]["param"] == "input"
    assert ask(client, "Hi").output_text  # still serving


# ---- Anthropic Messages -----------------------------------------------------------------------


def test_messages_whole_streamed_and_reused(smol):
    client = smol.anthropic()
    question = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.messages.create(model="smol", max_tokens=10, system=INSTRUCTIONS, messages=question,
                                   extra_body=GREEDY)
    assert first.type == "message" and first.role == "assistant" and first.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in first.content] == ["text"]
    reference = chat_reference(smol.openai(), ["What is the capital of France?"], [], 10)
    text = first.content[0].text
    assert text == reference.choices[0].message.content
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == reference.usage.prompt_tokens

    # a system prompt as text blocks renders as the string does; count_tokens counts the prompt
    count = client.messages.count_tokens(model="smol", system=[{"type": "text", "text": INSTRUCTIONS}],
                                         messages=question)
    assert count.input_tokens == reference.usage.prompt_tokens

    with client.messages.stream(model="smol", max_tokens=10, system=INSTRUCTIONS, messages=question,
                                extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text == text and final.stop_reason == first.stop_reason
    assert final.usage.output_tokens == first.usage.output_tokens

    second = client.messages.create(model="smol", max_tokens=10, system=INSTRUCTIONS, extra_body=GREEDY, messages=[
        *question, {"role": "assistant", "content": [{"type": "text", "text": text}]},
        {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]}])
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens == prompt + first.usage.output_tokens - 1
    assert second.usage.input_tokens < 20


def test_messages_stop_sequences_and_prefill(smol):
    client = smol.anthropic()
    question = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.messages.create(model="smol", max_tokens=10, messages=question, extra_body=GREEDY).content[0].text
    word = whole.split()[2]  # a word of the model's own reply
    cut = client.messages.create(model="smol", max_tokens=10, messages=question, stop_sequences=["#", word],
                                 extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == whole[:whole.index(word)]
    # a final assistant message is a prefill: the reply continues it (and holds only the continuation)
    start = " ".join(whole.split()[:2])
    rest = client.messages.create(model="smol", max_tokens=10, extra_body=GREEDY,
                                  messages=[*question, {"role": "assistant", "content": start}])
    assert (start + rest.content[0].text).startswith(whole)  # as long or longer: fewer tokens were spent on `start`


def test_messages_errors_are_anthropic_errors(smol):
    client = smol.anthropic()
    hello = [{"role": "user", "content": "Hi"}]
    status, body = post(smol.port, "/v1/messages", json.dumps({"messages": hello}).encode())
    assert status == 400 and body == {"type": "error", "error": {"type": "invalid_request_error",
                                                                 "message": "max_tokens: Field required"}}
    status, body = post(smol.port, "/v1/messages", b"{not json")
    assert status == 400 and body["type"] == "error" and "not valid JSON" in body["error"]["message"]
    status, body = post(smol.port, "/v1/messages/nowhere", b"{}")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="image") as error:
        client.messages.create(model="smol", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert error.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="client tools"):
        client.messages.create(model="smol", max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    with pytest.raises(anthropic.BadRequestError, match="sequence length"):
        client.messages.create(model="smol", max_tokens=4, messages=[{"role": "user", "content": "word " * 2100}])
    assert post(smol.port, "/v1/chat/completions", b"{}")[1]["error"]["param"] == "messages"  # OpenAI's shape there
    assert client.messages.create(model="smol", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]).content


# ---- structured output: the same constraint as chat completions' ---------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Berlin", "Rome"]},
                                         "people": {"type": "integer"}},
        "required": ["city", "people"], "additionalProperties": False}


def test_responses_and_messages_take_a_json_schema(smol):
    question = "Which city is the capital of France, and how many people live there?"
    reply = smol.openai().responses.create(
        model="smol", input=question, max_output_tokens=40, **GREEDY,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}})
    jsonschema.validate(json.loads(reply.output_text), CITY)
    message = smol.anthropic().messages.create(
        model="smol", max_tokens=40, messages=[{"role": "user", "content": question}],
        extra_body={"temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": CITY}}})
    jsonschema.validate(json.loads(message.content[0].text), CITY)
    with pytest.raises(anthropic.BadRequestError, match="json_schema"):
        smol.anthropic().messages.create(model="smol", max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                                         extra_body={"output_config": {"format": {"type": "json_schema"}}})


# ---- tools: the model that always calls get_weather -----------------------------------------


def test_responses_function_calls(tools):
    client = tools.openai()
    ask_weather = dict(model="tool-caller", tools=[WEATHER], max_output_tokens=40, **GREEDY)
    reply = client.responses.create(input="Weather in Paris?", **ask_weather)
    (call,) = reply.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")

    events = list(client.responses.create(input="Weather in Paris?", stream=True, **ask_weather))
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds  # the markup never reaches the text
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert json.loads(events[-1].response.output[0].arguments) == {"city": "Paris"}
    for response in (reply, events[-1].response):  # kept as created: the function call items, their ids
        assert client.responses.retrieve(response.id).model_dump() == response.model_dump()

    # the tool's output, continuing the stored response: only the new item is prefilled
    follow = client.responses.create(previous_response_id=reply.id, **ask_weather, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert follow.output[0].type == "function_call"
    cached = follow.usage.input_tokens_details.cached_tokens
    assert cached == reply.usage.input_tokens + reply.usage.output_tokens - 1
    assert 0 < follow.usage.input_tokens - cached < 30

    # the whole history as items, not stored: rendered like the chat completion of it
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    whole = client.responses.create(input=items, store=False, **ask_weather)
    assert whole.usage.input_tokens == follow.usage.input_tokens

    plain = client.responses.create(input="Weather in Paris?", tool_choice="none", **ask_weather)
    assert plain.output_text == CALL_HEAD + CALL_REST


def test_messages_tool_use(tools):
    client = tools.anthropic()
    question = [{"role": "user", "content": "Weather in Paris?"}]
    for choice in ({"type": "auto"}, {"type": "tool", "name": "get_weather"}):
        reply = client.messages.create(model="tool-caller", max_tokens=40, messages=question, tools=[WEATHER_TOOL],
                                       tool_choice=choice, extra_body=GREEDY)
        assert reply.stop_reason == "tool_use"
        (use,) = reply.content
        assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}

    with client.messages.stream(model="tool-caller", max_tokens=40, messages=question, tools=[WEATHER_TOOL],
                                extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert [d.type for d in deltas] == ["input_json_delta"] and json.loads(deltas[0].partial_json) == {"city": "Paris"}
    assert final.stop_reason == "tool_use" and final.content[0].input == {"city": "Paris"}

    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}
    follow = client.messages.create(model="tool-caller", max_tokens=40, tools=[WEATHER_TOOL], extra_body=GREEDY,
                                    messages=[*question, {"role": "assistant", "content": [use.model_dump()]},
                                              {"role": "user", "content": [result]}])
    assert follow.stop_reason == "tool_use" and follow.usage.cache_read_input_tokens > 0

    plain = client.messages.create(model="tool-caller", max_tokens=40, messages=question, tools=[WEATHER_TOOL],
                                   tool_choice={"type": "none"}, extra_body=GREEDY)
    assert plain.stop_reason == "end_turn" and plain.content[0].text == CALL_HEAD + CALL_REST


# ---- LangChain and LiteLLM over chat completions, offline ------------------------------------


@pytest.fixture
def offline(monkeypatch):
    """Name look-ups and connections anywhere but loopback fail, and are listed (the test asserts
    there were none): LiteLLM fetches a model cost map and tiktoken its encodings unless kept from it."""
    attempts, connect, getaddrinfo = [], socket.socket.connect, socket.getaddrinfo

    def refuse(host):
        attempts.append(host)
        raise OSError(f"the tests run offline: no connection to {host}")

    def connect_loopback(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOOPBACK:
            refuse(address[0])
        return connect(sock, address)

    def resolve_loopback(host, *args, **kwargs):
        if host not in LOOPBACK:
            refuse(host)
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect_loopback)
    monkeypatch.setattr(socket, "getaddrinfo", resolve_loopback)
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read at import: before litellm is imported
    yield attempts
    assert attempts == []


def test_langchain_chat_openai(smol, tools, offline):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"http://127.0.0.1:{smol.port}/v1", api_key="none", model="smol", max_tokens=10,
                     max_retries=0, **GREEDY)
    question = "What is the capital of France?"
    reply = llm.invoke(question)
    reference = smol.openai().chat.completions.create(model="smol", messages=[{"role": "user", "content": question}],
                                                      max_tokens=10, **GREEDY)
    assert reply.content == reference.choices[0].message.content
    assert reply.usage_metadata["input_tokens"] == reference.usage.prompt_tokens
    assert "".join(chunk.content for chunk in llm.stream(question)) == reply.content

    caller = ChatOpenAI(base_url=f"http://127.0.0.1:{tools.port}/v1", api_key="none", model="tool-caller",
                        max_tokens=40, max_retries=0, **GREEDY)
    call = caller.bind_tools([WEATHER_TOOL | {"parameters": WEATHER["parameters"]}]).invoke("Weather in Paris?")
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_litellm_completion(smol, offline):
    import litellm

    question = [{"role": "user", "content": "What is the capital of France?"}]
    where = dict(model="openai/smol", api_base=f"http://127.0.0.1:{smol.port}/v1", api_key="none", max_tokens=10,
                 **GREEDY)
    reply = litellm.completion(messages=question, **where)
    reference = smol.openai().chat.completions.create(model="smol", messages=question, max_tokens=10, **GREEDY)
    assert reply.choices[0].message.content == reference.choices[0].message.content
    assert reply.usage.prompt_tokens == reference.usage.prompt_tokens
    chunks = litellm.completion(messages=question, stream=True, **where)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content


# ---- last: a restart of the SmolLM2 daemon ----------------------------------------------------


def test_previous_response_id_after_a_restart(smol):
    """The daemon stops and starts again on the same store: a stored response goes on from the KV
    the store kept, prefilling only the new input, and is the same conversation; a second
    continuation of an earlier point branches from the stored KV."""
    client = smol.openai()
    first = ask(client, "What is the capital of France?")
    second = ask(client, "And of Italy?", previous=first)
    other = ask(client, "Name a river.")
    smol.restart()
    client = smol.openai()
    for response in (first, second):  # kept in the store with their turns
        assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    client.responses.delete(other.id)  # its session not resident: the forgetting is stored too (below)
    third = ask(client, "And of Germany?", previous=second)
    cached = third.usage.input_tokens_details.cached_tokens
    assert cached == second.usage.input_tokens + second.usage.output_tokens - 1
    assert third.usage.input_tokens - cached < 20
    questions = ["What is the capital of France?", "And of Italy?", "And of Germany?"]
    reference = chat_reference(client, questions, [first.output_text, second.output_text], 10)
    assert third.output_text == reference.choices[0].message.content
    assert third.usage.input_tokens == reference.usage.prompt_tokens

    spain = ask(client, "And of Spain?", previous=first)  # an earlier point: a branch of the stored KV
    assert spain.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens
    reference = chat_reference(client, ["What is the capital of France?", "And of Spain?"], [first.output_text], 10)
    assert spain.output_text == reference.choices[0].message.content

    smol.restart()
    client = smol.openai()
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(other.id)
    assert client.responses.retrieve(spain.id).model_dump() == spain.model_dump()
