"""Tool calling over the OpenAI API on a real server with the default model: forced calls (tool_choice "required"
and a named function) are constrained to valid calls of the tools' schemas, returned as `message.tool_calls` and
streamed as `delta.tool_calls` fragments that reassemble to exactly the non-streamed calls, also when max_tokens
cuts them; tool_choice "auto" calls of each parser stream piece by piece; bad tools and tool_choice are a 400
naming the field. With --reasoning-parser a constraint applies to the answer after the thinking. The output
readers (tool_calls.scan_calls, the parsers, the reasoning split) are tested on texts too."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import jsonschema
import openai
import pytest
from conftest import THINK_IDS
from test_server_errors import assert_error
from test_server_harness import ServerThread

from asyncengine import ThinkingTokens, default_model_path
from asyncengine.api.app import create_app
from asyncengine.api.cli import build_parser
from asyncengine.api.reasoning import REASONING_PARSERS, ReasoningStream, split_reasoning
from asyncengine.api.tool_calls import TOOL_PARSERS, AutoToolCalls, calls_of_fragments, scan_calls
from asyncengine.tokenizer import load_tokenizer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}, "tags": {"type": "array", "maxItems": 2,
                                                                        "items": {"type": "string", "maxLength": 5}}},
    "required": ["zone", "tags"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} somewhere", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
CHAT = [{"role": "user", "content": "What is the weather in Verona?"}]


@pytest.fixture(scope="module")
def server():
    with ServerThread(default_model_path(), app_kwargs={"served_model_name": ["default"]}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


def streamed_calls(client, **kwargs) -> tuple[list[tuple[str, str]], set, list]:
    """The calls reassembled from a stream's delta.tool_calls, the finish reasons, and the fragments' ids."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    ids, finish_reasons = [], set()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert not choice.delta.content  # forced calls carry no content
            if choice.finish_reason is not None:
                finish_reasons.add(choice.finish_reason)
            for fragment in choice.delta.tool_calls or []:
                if fragment.id is not None:  # the first fragment of a call: id, type and name, before any argument
                    assert fragment.index not in names and fragment.type == "function"
                    ids.append(fragment.id)
                    names[fragment.index] = fragment.function.name
                    arguments[fragment.index] = ""
                arguments[fragment.index] += fragment.function.arguments or ""
    assert sorted(names) == list(range(len(names)))
    return [(names[i], arguments[i]) for i in range(len(names))], finish_reasons, ids


def assert_valid(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# -- the output reader, on texts ------------------------------------------------------------------------------
def test_scan_calls_reads_single_and_parallel_calls_with_tricky_strings():
    one = '{"name":"get_time","arguments":{"zone":"a}\\"{","tags":["]","x"]}}'
    assert [(c.name, c.arguments, c.complete) for c in scan_calls(one, parallel=False)] == \
        [("get_time", '{"zone":"a}\\"{","tags":["]","x"]}', True)]
    many = '[ {"name": "get_weather", "arguments": {"city": "V", "unit": "celsius", "days": 2} } ,' + one + "]"
    calls = scan_calls(many, parallel=True)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "V", "unit": "celsius", "days": 2}
    # every prefix: names appear whole, arguments only grow, and each is a prefix of the final one
    seen = []
    for end in range(len(many) + 1):
        prefix_calls = scan_calls(many[:end], parallel=True)
        assert len(prefix_calls) >= len(seen)
        for old, new in zip(seen, prefix_calls):
            assert old.name == new.name and new.arguments.startswith(old.arguments)
        for call, final in zip(prefix_calls, calls):
            assert call.name == final.name and final.arguments.startswith(call.arguments)
        seen = prefix_calls
    assert len(seen) == 2 and all(c.complete for c in seen)


# -- forced calls over the API --------------------------------------------------------------------------------
def test_named_function_is_one_valid_call_and_streams_to_the_same_call(client):
    kwargs = dict(model="default", messages=CHAT, tools=TOOLS, temperature=0.0, max_tokens=120,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    response = client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    calls = calls_of(choice.message)
    assert [name for name, _ in calls] == ["get_time"]
    assert_valid(calls)
    streamed, finish_reasons, ids = streamed_calls(client, **kwargs)
    assert streamed == calls and finish_reasons == {"tool_calls"}
    assert all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("parallel", [False, None])
def test_required_calls_validate_and_stream_to_the_same_calls(client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    kwargs = dict(model="default", messages=CHAT, tools=TOOLS, tool_choice="required", temperature=0.0,
                  max_tokens=200, **extra)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = calls_of(choice.message)
    assert_valid(calls)
    if parallel is False:
        assert len(calls) == 1
    streamed, finish_reasons, _ = streamed_calls(client, **kwargs)
    assert streamed == calls and finish_reasons == {"tool_calls"}


def test_sampled_required_calls_all_validate(client):
    response = client.chat.completions.create(model="default", messages=CHAT, tools=TOOLS, tool_choice="required",
                                              temperature=1.0, n=8, seed=3, max_tokens=220)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert_valid(calls_of(choice.message))
    assert len({tuple(calls_of(c.message)) for c in response.choices}) > 1


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_cut_by_max_tokens_return_what_was_generated_streamed_and_not(client, tool_choice):
    """finish_reason "length": a call whose name was read keeps its arguments so far (a prefix of the uncut
    call's); an output cut before any name is complete comes back as content. Streamed the same."""
    kwargs = dict(model="default", messages=CHAT, tools=TOOLS, tool_choice=tool_choice, temperature=0.0)
    whole = client.chat.completions.create(max_tokens=200, **kwargs)
    [(name, arguments)] = calls_of(whole.choices[0].message)
    cut = client.chat.completions.create(max_tokens=whole.usage.completion_tokens - 6, **kwargs).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    [(cut_name, cut_arguments)] = calls_of(cut.message)
    assert cut_name == name and arguments.startswith(cut_arguments) and 0 < len(cut_arguments) < len(arguments)
    streamed, finish_reasons, _ = streamed_calls(client, max_tokens=whole.usage.completion_tokens - 6, **kwargs)
    assert streamed == [(cut_name, cut_arguments)] and finish_reasons == {"length"}

    early = client.chat.completions.create(max_tokens=4, **kwargs).choices[0]
    assert early.finish_reason == "length" and early.message.tool_calls is None
    opening = ("[" if tool_choice == "required" else "") + '{"name": "' + name  # the uncut output's start
    assert early.message.content and opening.startswith(early.message.content)
    content = ""
    for chunk in client.chat.completions.create(stream=True, max_tokens=4, **kwargs):
        for choice in chunk.choices:
            assert not choice.delta.tool_calls
            content += choice.delta.content or ""
    assert content == early.message.content


def test_tool_choice_none_answers_with_content(client):
    choice = client.chat.completions.create(model="default", messages=CHAT, tools=TOOLS, tool_choice="none",
                                            max_tokens=5, temperature=0.0).choices[0]
    assert choice.message.tool_calls is None and choice.message.content


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_tide"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),  # no --enable-auto-tool-choice
    ({"tools": TOOLS}, "tool_choice"),  # the default with tools is "auto"
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_and_tool_choice_are_400_naming_the_field(server, extra, param):
    response = post(server, {"messages": CHAT, "max_tokens": 5, **extra})
    assert_error(response, 400, param=param)
    assert server.engine_idle()


# -- the chat template rendered with the tools and a history of calls -----------------------------------------
# A small Hermes-style template (as Qwen2.5's renders tools): the tools as JSON lines, calls as <tool_call> JSON,
# tool results as <tool_response>.
HERMES_TEMPLATE = (
    "{% if tools %}<|system|><tools>{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>{{ eos_token }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|user|><tool_response id={{ m.tool_call_id }}>{{ m.content }}</tool_response>"
    "{% elif m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{% else %}<|{{ m.role }}|>{{ m.content }}{% endif %}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
HISTORY = [
    {"role": "user", "content": "Weather in Verona?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Verona", "unit": "celsius", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
]


@pytest.fixture(scope="module")
def hermes_server(llama_dir, tmp_path_factory):
    """The tiny test Llama, its tokenizer_config.json carrying HERMES_TEMPLATE (as Qwen2.5's does; the separate
    chat_template.jinja that newer transformers save, and would prefer, is removed)."""
    folder = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(llama_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = HERMES_TEMPLATE
    config_path.write_text(json.dumps(config))
    with ServerThread(folder, app_kwargs={"served_model_name": ["tiny"]}, max_model_len=512) as srv:
        yield srv


def test_template_renders_the_tools_the_calls_and_the_tool_results(hermes_server):
    expected = (
        "<|system|><tools>" + "".join(json.dumps(tool) + "\n" for tool in TOOLS) + "</tools></s>"
        "<|user|>Weather in Verona?</s>"
        '<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Verona", "unit": "celsius", '
        '"days": 1}}</tool_call></s>'
        "<|user|><tool_response id=call_1>sunny, 21</tool_response></s><|assistant|>"
    )
    tokenized = httpx.post(hermes_server.url + "/tokenize", json={"messages": HISTORY, "tools": TOOLS}).json()
    assert "tokens" in tokenized, tokenized
    detokenized = httpx.post(hermes_server.url + "/detokenize", json={"tokens": tokenized["tokens"]}).json()
    assert detokenized["prompt"] == expected
    without_tools = httpx.post(hermes_server.url + "/tokenize", json={"messages": HISTORY}).json()
    assert without_tools["count"] < tokenized["count"]
    # a chat request renders the same prompt (a short tool: this vocabulary spends a token on almost every byte)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["days"], "additionalProperties": False}}}]
    count = httpx.post(hermes_server.url + "/tokenize", json={"messages": HISTORY, "tools": tools}).json()["count"]
    client = openai.OpenAI(base_url=hermes_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    response = client.chat.completions.create(model="tiny", messages=HISTORY, tools=tools, max_tokens=120,
                                              temperature=0.0, tool_choice="required", parallel_tool_calls=False)
    assert response.usage.prompt_tokens == count
    call = response.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["days"] in range(1, 8)


def test_history_call_arguments_that_are_not_json_reach_the_template_as_text(hermes_server):
    messages = [HISTORY[0], {**HISTORY[1], "tool_calls": [{"id": "c", "type": "function",
                                                            "function": {"name": "get_time", "arguments": "{oops"}}]}]
    tokenized = httpx.post(hermes_server.url + "/tokenize", json={"messages": messages}).json()
    text = httpx.post(hermes_server.url + "/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert '<tool_call>{"name": "get_time", "arguments": "{oops"}</tool_call>' in text


# -- tool_choice "auto": parsers on texts, streamed and not ---------------------------------------------------
W = {"city": "Verona", "days": 2}
PARSED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Verona", "days": 2}}\n'
               '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "Let me check.\n\n", [("get_weather", W), ("get_time", {})]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "<tool_call>"}}', None,
     [("get_time", {"zone": "<tool_call>"})]),  # the last call may lack its closing tag
    ("hermes", "No tools needed: <tool_call is not a tag.", "No tools needed: <tool_call is not a tag.", []),
    ("hermes", "Broken <tool_call>{not json}</tool_call>", "Broken <tool_call>{not json}</tool_call>", []),
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Verona", "days": 2}}', None,
     [("get_weather", W)]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
                    '"parameters": {"city": "Verona", "days": 2}}', None, [("get_time", {}), ("get_weather", W)]),
    ("llama3_json", "The weather is {fine}.", "The weather is {fine}.", []),
    ("llama3_json", "{oops", "{oops", []),
    ("mistral", 'Sure [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Verona", "days": 2}}]', "Sure ",
     [("get_weather", W)]),
    ("mistral", "[TOOL_CALLS] [{", "[TOOL_CALLS] [{", []),
]


def _auto(parser: str, parallel: bool = True) -> AutoToolCalls:
    return AutoToolCalls(TOOL_PARSERS[parser](), parallel)


@pytest.mark.parametrize("parser, text, content, calls", PARSED)
def test_parsers_read_content_and_calls(parser, text, content, calls):
    got_content, got_calls = _auto(parser).message(text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls)


@pytest.mark.parametrize("parser, text, content, calls", PARSED)
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_parsers_stream_calls_piece_by_piece_and_reassemble_to_the_non_streamed_answer(parser, text, content, calls,
                                                                                      piece):
    """Fed `piece` characters at a time: a call's first fragment (id, type, name, no arguments) comes as soon as
    its name is read, then its arguments in pieces as they come; content and calls reassemble to exactly the
    non-streamed message."""
    stream = _auto(parser).stream()
    streamed_content, fragments, arrivals = "", [], []
    for start in range(0, len(text), piece):
        got, new = stream.feed(text[start:start + piece])
        streamed_content += got
        fragments += new
        arrivals += [start] * len(new)
    got, new = stream.finish()
    streamed_content += got
    fragments += new
    arrivals += [len(text)] * len(new)
    message_content, message_calls = _auto(parser).message(text)
    assert (streamed_content or None) == message_content == content
    streamed_calls_ = calls_of_fragments(fragments)
    assert [(c.function.name, c.function.arguments) for c in streamed_calls_] == \
        [(c.function.name, c.function.arguments) for c in message_calls]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed_calls_] == calls
    assert stream.called == bool(calls)
    for index in range(len(calls)):
        mine = [f for f in fragments if f.index == index]
        assert mine[0].id is not None and mine[0].function.name and mine[0].function.arguments == ""
        assert all(f.id is None and f.function.name is None for f in mine[1:])
    if piece == 1:
        for index, (_, arguments) in enumerate(calls):  # the arguments came a character at a time
            pieces = [f.function.arguments for f in fragments if f.index == index and f.id is None]
            assert len(pieces) == len(message_calls[index].function.arguments)
        firsts = [arrivals[fragments.index(f)] for f in fragments if f.id is not None]
        assert all(arrival < len(text) for arrival in firsts)  # each call's name went out before the end


def test_parallel_tool_calls_false_keeps_the_first_parsed_call():
    _, calls = _auto("hermes", parallel=False).message(PARSED[0][1])
    assert [c.function.name for c in calls] == ["get_weather"]


@pytest.fixture(scope="module")
def auto_servers():
    """auto_servers(parser) -> a server with --enable-auto-tool-choice --tool-call-parser parser (started once)."""
    servers: dict[str, ServerThread] = {}

    def get(parser: str) -> ServerThread:
        if parser not in servers:
            servers[parser] = ServerThread(default_model_path(), app_kwargs={
                "served_model_name": ["default"], "tool_call_parser": parser, "enable_auto_tool_choice": True}).start()
        return servers[parser]

    yield get
    for server in servers.values():
        server.stop()


# The default model knows nothing of tools: a regex makes it write each parser's format (free text, not a forced
# call; this vocabulary spends about a token per character, so the arguments come in several deltas).
AUTO_CASES = [
    ("hermes", r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"days": [1-7]\}\}</tool_call>', "Sure. "),
    ("llama3_json", r'\{"name": "get_time", "parameters": \{"zone": "[A-Z]{3}"\}\}', None),
    ("mistral", r'Sure\. \[TOOL_CALLS\] \[\{"name": "get_weather", "arguments": \{"days": [1-7]\}\}\]', "Sure. "),
]


def streamed_auto(client, **kwargs) -> tuple[str, list, set, list[int]]:
    """(content, the reassembled calls, finish reasons, the number of argument fragments per call) of a stream;
    checks that each call's first fragment carries its id and name and comes before its arguments."""
    content, fragments, finish_reasons = "", [], set()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish_reasons.add(c.finish_reason)
            fragments += c.delta.tool_calls or []
    calls, pieces = [], []
    for fragment in fragments:
        if fragment.id is not None:
            assert fragment.index == len(calls) and fragment.function.name and not fragment.function.arguments
            calls.append((fragment.function.name, ""))
            pieces.append(0)
        else:
            assert fragment.function.name is None and fragment.function.arguments
            name, arguments = calls[fragment.index]
            calls[fragment.index] = (name, arguments + fragment.function.arguments)
            pieces[fragment.index] += 1
    return content, calls, finish_reasons, pieces


@pytest.mark.parametrize("parser, regex, content", AUTO_CASES)
def test_auto_tool_calls_stream_piece_by_piece_to_the_non_streamed_call(auto_servers, parser, regex, content):
    client = openai.OpenAI(base_url=auto_servers(parser).url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model="default", messages=CHAT, tools=TOOLS, tool_choice="auto", temperature=0.0, max_tokens=80,
                  extra_body={"structured_outputs": {"regex": regex}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content, choice
    [(name, arguments)] = calls_of(choice.message)
    assert name == re.search(r'"name": "(\w+)"', regex).group(1) and json.loads(arguments)
    streamed_content, calls, finish_reasons, pieces = streamed_auto(client, **kwargs)
    assert (streamed_content or None) == content and calls == calls_of(choice.message)
    assert finish_reasons == {None, "tool_calls"} and all(count > 1 for count in pieces), pieces


def test_auto_tool_choice_without_a_call_is_content(auto_servers):
    client = openai.OpenAI(base_url=auto_servers("hermes").url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model="default", messages=CHAT, tools=TOOLS, tool_choice="auto", temperature=0.0, max_tokens=80,
                  extra_body={"structured_outputs": {"regex": r"Romeo( and Juliet)?\."}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    content, calls, finish_reasons, _ = streamed_auto(client, **kwargs)
    assert content == choice.message.content and not calls and finish_reasons == {None, "stop"}


def test_auto_needs_a_parser_and_unknown_parsers_are_refused():
    with pytest.raises(ValueError, match="tool_call_parser"):
        create_app(None, enable_auto_tool_choice=True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"


# -- reasoning output (--reasoning-parser) --------------------------------------------------------------------
@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("qwen3", "<think>\nweigh it</think>\n\nRomeo.", "\nweigh it", "\n\nRomeo."),
    ("qwen3", "Romeo, <think>not at the start</think>", None, "Romeo, <think>not at the start</think>"),
    ("qwen3", "  <thin", None, "  <thin"),
    ("qwen3", "<think>cut short by max_tokens</thi", "cut short by max_tokens</thi", ""),
    ("deepseek_r1", "the prompt opened the think</think>Juliet", "the prompt opened the think", "Juliet"),
    ("deepseek_r1", "<think>a</think>b</think>", "a", "b</think>"),
    ("deepseek_r1", "all thinking", "all thinking", ""),
])
@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_reasoning_split_streamed_and_not(parser, text, reasoning, content, piece):
    assert split_reasoning(REASONING_PARSERS[parser], text) == (reasoning, content)
    stream = ReasoningStream(REASONING_PARSERS[parser])
    pieces = [stream.feed(text[i:i + piece]) for i in range(0, len(text), piece)] + [stream.finish()]
    assert ("".join(r for r, _ in pieces) or None, "".join(c for _, c in pieces)) == (reasoning, content)


def streamed_reasoning_and_content(client, **kwargs) -> tuple[str, str]:
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    return reasoning, content


ANSWER = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def think_server(think_dir):
    """The tiny checkpoint with think tokens, --reasoning-parser deepseek_r1 (the output starts in the thinking)."""
    with ServerThread(think_dir, app_kwargs={"served_model_name": ["tiny"], "reasoning_parser": "deepseek_r1"},
                      max_model_len=512) as srv:
        yield srv


@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}},
    {"tools": [{"type": "function", "function": {"name": "answer", "parameters": ANSWER}}],
     "tool_choice": "required", "parallel_tool_calls": False},
])
def test_a_constraint_applies_to_the_answer_after_the_thinking_streamed_and_not(think_server, constraint):
    """The thinking is free (the same reasoning_content as without the constraint, same seed) and the answer
    after </think> obeys the constraint; streamed reasoning and answer are the non-streamed ones."""
    client = openai.OpenAI(base_url=think_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    end = THINK_IDS[1]
    for seed in range(2):
        # a bias on </think> makes the random model close its thinking within a few tokens
        kwargs = dict(model="tiny", messages=CHAT, temperature=1.0, seed=seed, max_tokens=100, logit_bias={end: 3.5})
        free = client.chat.completions.create(**kwargs).choices[0].message
        choice = client.chat.completions.create(**kwargs, **constraint).choices[0]
        reasoning = choice.message.model_extra["reasoning_content"]
        assert reasoning == free.model_extra["reasoning_content"]
        if "tools" in constraint:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            arguments = choice.message.tool_calls[0].function.arguments
            jsonschema.validate(json.loads(arguments), ANSWER)
            streamed, finish_reasons, _ = streamed_calls(client, **kwargs, **constraint)
            assert streamed == [("answer", arguments)] and finish_reasons == {"tool_calls"}
        else:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), ANSWER)
            assert streamed_reasoning_and_content(client, **kwargs, **constraint) == (reasoning or "",
                                                                                   choice.message.content)
    assert think_server.engine_idle()


def test_reasoning_parser_needs_the_think_markers_as_single_tokens(server, think_dir):
    with pytest.raises(ValueError, match="reasoning_parser qwen3 needs '<think>' to be one token"):
        create_app(server.engine, reasoning_parser="qwen3")  # the default model does not think
    tokenizer = load_tokenizer(str(think_dir))
    start, end = THINK_IDS
    assert REASONING_PARSERS["qwen3"].thinking_tokens(tokenizer, "qwen3") == ThinkingTokens(end=end, start=start)
    assert REASONING_PARSERS["deepseek_r1"].thinking_tokens(tokenizer, "deepseek_r1") == ThinkingTokens(end=end)
