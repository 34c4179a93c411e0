"""Constrained decoding through the real daemon: `response_format`, the guided_* fields and strict
tools over HTTP (driven by the `openai` client), and `json_schema` / `regex` / `grammar` over the
Unix socket (the Python client). A bad schema is a 400 / bad_request and the daemon goes on."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from ellm.cli import app
from ellm.errors import BadRequest

from test_http import QUESTION, post, start_daemon, write_tool_caller

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 2},
        "location": {"type": "object", "properties": {"continent": {"enum": ["Europe", "Asia", "Africa"]},
                                                      "coastal": {"type": "boolean"}},
                     "required": ["continent", "coastal"], "additionalProperties": False},
    },
    "required": ["city", "country", "population", "landmarks", "location"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Tell me about Paris as JSON."}]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    daemon, port = start_daemon(tmp_path_factory.mktemp("structured"), slots=2)
    yield daemon, port
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
def client(smol):
    return OpenAI(base_url=f"http://127.0.0.1:{smol[1]}/v1", api_key="none", max_retries=0)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_response_format_json_schema_plain_and_streamed(client):
    reply = client.chat.completions.create(model="smol", messages=ASK, max_tokens=120, temperature=0,
                                           response_format=schema_format(CITY))
    assert reply.choices[0].finish_reason == "stop"
    content = reply.choices[0].message.content
    jsonschema.validate(json.loads(content), CITY)
    chunks = client.chat.completions.create(model="smol", messages=ASK, max_tokens=120, temperature=0,
                                            response_format=schema_format(CITY), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content


def test_response_format_json_object(client):
    reply = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=60, temperature=0,
                                           response_format={"type": "json_object"})
    free = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=60, temperature=0)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    with pytest.raises(ValueError):  # the same request without it: prose
        json.loads(free.choices[0].message.content)


class Landmark(BaseModel):
    name: str = Field(max_length=24)
    kind: Literal["museum", "tower", "church", "park"]


class City(BaseModel):
    name: str = Field(max_length=20)
    population: int
    landmarks: list[Landmark] = Field(max_length=2)


def test_parse_with_a_pydantic_model(client):
    reply = client.chat.completions.parse(model="smol", messages=ASK, max_tokens=150, temperature=0,
                                          response_format=City)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed == City.model_validate_json(reply.choices[0].message.content)


def test_guided_fields(smol, client):
    reply = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=20, temperature=0,
                                           extra_body={"guided_regex": "The capital is [A-Z][a-z]+\\."})
    assert reply.choices[0].message.content == "The capital is Paris."
    reply = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=20, temperature=0,
                                           extra_body={"guided_choice": ["Berlin", "Madrid", "Paris"]})
    assert reply.choices[0].message.content in ("Berlin", "Madrid", "Paris")
    grammar = 'root ::= "Answer: " ("yes" | "no")'  # GBNF; Lark works as well
    reply = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Is Paris in France?"}],
                                           max_tokens=20, temperature=0, extra_body={"guided_grammar": grammar})
    assert reply.choices[0].message.content in ("Answer: yes", "Answer: no")
    completion = client.completions.create(model="smol", prompt="The year the Eiffel Tower was built:", max_tokens=10,
                                           temperature=0, extra_body={"guided_regex": " [0-9]{4}"})
    assert len(completion.choices[0].text) == 5 and completion.choices[0].text[1:].isdigit()


def test_bad_constraints_are_400s_and_the_daemon_goes_on(smol, client):
    with pytest.raises(openai.BadRequestError, match="json_schema: Invalid type: strin"):
        client.chat.completions.create(model="smol", messages=QUESTION,
                                       response_format=schema_format({"type": "strin"}))
    with pytest.raises(openai.BadRequestError, match='unknown name: "nothing"'):
        client.chat.completions.create(model="smol", messages=QUESTION, extra_body={"guided_grammar": "start: nothing"})
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.completions.create(model="smol", prompt="Hi", extra_body={"guided_regex": "a(b"})
    with pytest.raises(openai.BadRequestError, match="take one constraint"):
        client.chat.completions.create(model="smol", messages=QUESTION, response_format={"type": "json_object"},
                                       extra_body={"guided_regex": "a"})
    with pytest.raises(openai.BadRequestError, match="response_format.type"):
        client.chat.completions.create(model="smol", messages=QUESTION, response_format={"type": "xml"})
    status, body = post(smol[1], "/v1/chat/completions", json.dumps(
        {"messages": QUESTION, "guided_json": "{not json"}).encode())
    assert status == 400 and body["error"]["param"] == "guided_json"
    reply = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=4, temperature=0)
    assert reply.choices[0].message.content


def test_socket_chat_with_a_schema(smol):
    with smol[0].client() as unix:
        session = unix.open_session(system="You answer in JSON.")
        with pytest.raises(BadRequest, match="json_schema: Invalid type"):
            session.chat("Tell me about Paris.", json_schema={"type": "strin"})
        assert len(session.info()["turns"]) == 1  # nothing was appended
        reply = session.chat("Tell me about Paris.", json_schema=CITY, max_tokens=120)
        assert reply.finish_reason == "stop"
        jsonschema.validate(reply.json(), CITY)
        streamed = session.chat("And Rome?", json_schema=CITY, max_tokens=120, stream=True)
        text = "".join(streamed)
        assert text == streamed.result.text
        jsonschema.validate(json.loads(text), CITY)
        # the turns closed as usual: the next one is free text and the conversation holds them all
        assert session.chat("Thanks!", max_tokens=8).text
        info = session.info()
        assert len(info["turns"]) == 7 and not info["busy"]
        with pytest.raises(BadRequest, match="take one constraint"):
            session.chat("x", regex="a", grammar="start: \"a\"")


def test_cli_chat_with_a_json_schema_file(smol, tmp_path):
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(CITY))
    socket = str(smol[0].socket)
    result = CliRunner().invoke(app, ["--socket", socket, "chat", "-m", "Tell me about Rome.", "--json-schema",
                                      str(schema), "--max-tokens", "120", "--json"])
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(json.loads(result.output)["text"]), CITY)
    schema.write_text("{not json")
    result = CliRunner().invoke(app, ["--socket", socket, "chat", "-m", "x", "--json-schema", str(schema)])
    assert result.exit_code == 2 and "--json-schema" in result.output


# ---- strict tools: the model of test_http that always calls get_weather(city="Paris") -----------

STRICT_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Berlin", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tools_client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured-tools")
    model = write_tool_caller(tmp / "tool-caller")
    daemon, port = start_daemon(tmp, slots=1, extra=["--model-path", str(model), "--weight-dtype", "bf16"])
    yield OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    assert daemon.stop() == 0


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_strict_tools_give_arguments_valid_for_the_schema(tools_client, tool_choice):
    reply = tools_client.chat.completions.create(
        model="tool-caller", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[STRICT_WEATHER],
        tool_choice=tool_choice, max_tokens=40, temperature=0)
    (call,) = reply.choices[0].message.tool_calls  # the model wanted "Paris": not among the schema's cities
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), STRICT_WEATHER["function"]["parameters"])
