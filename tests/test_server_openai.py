"""The server through the official `openai` client: results equal the offline LLM's, shapes are OpenAI's."""

from __future__ import annotations

import openai
import pytest
from test_server_harness import MAX_MODEL_LEN, NUM_KV_BLOCKS, server  # noqa: F401 - fixture

from asyncengine import LLM, SamplingParams

PROMPT = "Hello world"
MESSAGES = [{"role": "user", "content": "How are you today?"}]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def offline(llm, prompt, **params) -> str:
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0].text


def test_greedy_completion_equals_llm_generate(client, llm):
    expected = offline(llm, PROMPT, temperature=0, max_tokens=16)
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    assert result.object == "text_completion" and result.id.startswith("cmpl-")
    assert result.choices[0].text == expected
    assert result.choices[0].finish_reason in ("length", "stop")
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected


def test_greedy_chat_equals_llm_chat(client, llm):
    expected = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    result = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=12, temperature=0)
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason is not None
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"


def test_stream_include_usage_ends_with_a_usage_chunk(client, llm):
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=7, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 7
    assert last.usage.total_tokens == last.usage.prompt_tokens + 7
    assert all(c.usage is None for c in chunks[:-1])
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == len(llm.get_tokenizer()(PROMPT).input_ids)


def test_n_choices_non_streamed_and_streamed_interleaved(client):
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3, seed=7,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert result.usage.completion_tokens == 18
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, n=2, seed=3,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    role_chunks = [c for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(c.choices[0].index for c in role_chunks) == [0, 1]
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}
    order = [c.choices[0].index for c in chunks if c.choices[0].delta.content]
    assert set(order) == {0, 1} and order != sorted(order), "choices should interleave while streaming"


def test_completion_logprobs_have_openai_shape(client):
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the chosen token is the most likely
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=3, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_chat_logprobs_have_openai_shape(client):
    result = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, logprobs=True,
                                            top_logprobs=2, temperature=0, extra_body={"ignore_eos": True})
    content = result.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and all(isinstance(b, int) and 0 <= b < 256 for b in entry.bytes)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    without = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert without.choices[0].logprobs is None


def test_batch_of_prompts_numbers_choices_by_prompt_then_sample(client, llm):
    prompts = ["Hello world", "The quick brown fox"]
    result = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, n=2, temperature=0)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    for k, prompt in enumerate(prompts):
        expected = offline(llm, prompt, temperature=0, max_tokens=8)
        assert result.choices[2 * k].text == result.choices[2 * k + 1].text == expected
    stream = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == {k: offline(llm, p, temperature=0, max_tokens=8) for k, p in enumerate(prompts)}


def test_token_id_prompts(client, llm):
    ids = llm.get_tokenizer()(PROMPT).input_ids
    expected = offline(llm, PROMPT, temperature=0, max_tokens=6)
    single = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    batch = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=6, temperature=0)
    assert single.choices[0].text == expected
    assert [c.text for c in batch.choices] == [expected, expected]


def test_echo_prepends_the_prompt(client):
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert result.choices[0].text.startswith(PROMPT) and len(result.choices[0].text) > len(PROMPT)


def test_stop_string_cuts_the_text(client, llm):
    full = offline(llm, PROMPT, temperature=0, max_tokens=24, ignore_eos=True)
    stop = next(full[i:i + 2] for i in range(4, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    cut = full.find(stop)
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                       extra_body={"ignore_eos": True})
    choice = result.choices[0]
    assert choice.text == full[:cut] and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    kept = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:cut + len(stop)]
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == full[:cut]


@pytest.mark.parametrize("extra", [
    {"top_k": 5, "temperature": 0.8, "seed": 11},
    {"min_p": 0.05, "top_p": 0.9, "temperature": 1.0, "seed": 12},
    {"repetition_penalty": 1.3, "temperature": 0.0},
    {"presence_penalty": 1.0, "frequency_penalty": 0.5, "temperature": 0.0},
    {"min_tokens": 5, "temperature": 0.0, "stop_token_ids": [1, 4]},
    {"logit_bias": {"50": 100}, "temperature": 0.0},
], ids=["top_k", "min_p", "repetition_penalty", "penalties", "min_tokens", "logit_bias"])
def test_sampling_extras_match_the_offline_engine(client, llm, extra):
    body = dict(extra)
    bias = body.pop("logit_bias", None)
    expected = offline(llm, PROMPT, max_tokens=10, **body, **({"logit_bias": {50: 100.0}} if bias else {}))
    standard = {k: body.pop(k) for k in ("temperature", "seed", "top_p", "presence_penalty", "frequency_penalty")
                if k in body}
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, **standard,
                                       **({"logit_bias": bias} if bias else {}), extra_body=body)
    assert result.choices[0].text == expected
    if bias:
        assert set(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, logprobs=0, temperature=0,
                                              logit_bias=bias).choices[0].logprobs.tokens) == \
            {llm.get_tokenizer().decode([50])}


def test_seeded_sampling_is_reproducible(client):
    def sample():
        return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0,
                                              seed=1234).choices[0].message.content

    assert sample() == sample()


def test_client_errors_are_raised_as_openai_exceptions(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="missing", prompt=PROMPT, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_MODEL_LEN)
    assert info.value.body["param"] == "max_tokens" and str(MAX_MODEL_LEN) in info.value.body["message"]
