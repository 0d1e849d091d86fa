"""`stream_interval` (EngineConfig, `asyncengine serve --stream-interval`): a streamed request's tokens come in
groups of N, its first token and its end at once, with the same tokens, text, usage and cancellation as N = 1."""

from __future__ import annotations

import openai
import pytest
from test_server_harness import ServerThread, wait_until

from asyncengine import EngineConfig, LLMEngine, RequestOutputKind, SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


def delta_outputs(engine: LLMEngine, prompt: str, params: SamplingParams) -> list:
    engine.add_request("r", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == "r"]
    return outputs


@pytest.fixture(scope="module")
def engines(llama_dir):
    def build(interval: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(llama_dir), max_model_len=128, num_kv_blocks=64,
                                      stream_interval=interval))

    every, grouped = build(1), build(4)
    yield every, grouped
    every.close()
    grouped.close()


@pytest.mark.parametrize("n", [1, 2])
def test_delta_outputs_come_every_n_tokens_with_the_same_tokens_and_text(engines, n):
    every, grouped = engines
    params = SamplingParams(max_tokens=14, n=n, temperature=0.8, seed=7, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    reference, outputs = delta_outputs(every, "Hello world", params), delta_outputs(grouped, "Hello world", params)
    for index in range(n):
        mine = [c for o in outputs for c in o.outputs if c.index == index]
        theirs = [c for o in reference for c in o.outputs if c.index == index]
        # the first token at once, then groups of 4 (13 = 4 + 4 + 4 + 1: the last group is the end's)
        assert [len(c.token_ids) for c in mine] == [1, 4, 4, 4, 1]
        assert [t for c in mine for t in c.token_ids] == [t for c in theirs for t in c.token_ids]
        assert "".join(c.text for c in mine) == "".join(c.text for c in theirs)
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert len(reference) == 14 and len(outputs) == 5


def test_cumulative_and_final_outputs_keep_their_contract(engines):
    _, grouped = engines
    cumulative = delta_outputs(grouped, "Hello world", SamplingParams(max_tokens=9, **GREEDY))
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 5, 9]
    final = delta_outputs(grouped, "Hello world", SamplingParams(max_tokens=9, output_kind=RequestOutputKind.FINAL_ONLY,
                                                                 **GREEDY))
    assert len(final) == 1 and final[0].outputs[0].token_ids == cumulative[-1].outputs[0].token_ids


def test_stream_interval_must_be_positive(llama_dir):
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(model=str(llama_dir), stream_interval=0)


@pytest.fixture(scope="module")
def grouped_server(llama_dir):
    with ServerThread(llama_dir, app_kwargs={"served_model_name": "tiny"}, stream_interval=4) as srv:
        yield srv


def test_served_stream_groups_tokens_and_keeps_text_and_usage(grouped_server):
    client = openai.OpenAI(base_url=grouped_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kwargs = dict(model="tiny", prompt="Hello world", max_tokens=13, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(texts) == whole.choices[0].text
    # 13 tokens: the first, then 4 + 4 + 4; every chunk's text is its tokens' (greedy, the same tokens as `whole`)
    assert len(texts) <= 4, texts
    assert chunks[-1].usage.completion_tokens == 13 == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_served_grouped_stream_that_is_left_is_aborted(grouped_server):
    client = openai.OpenAI(base_url=grouped_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=100, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text
    stream.close()
    wait_until(grouped_server.engine_idle, 10)
