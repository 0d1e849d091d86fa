"""Lookahead (async) scheduling, on CPU with the embedded default model: the pipeline that prepares and launches
step N+1 before step N's tokens are read back gives exactly the outputs of the plain pipeline (tokens, text,
finish and stop reasons, logprobs), across stops, seeds, n > 1, preemption and chunked prefill, and leaks
nothing; it really does feed in-flight tokens on the device, to the model and to the penalties.
On CUDA it is the default; on CPU it is off unless asked for (EngineConfig.async_scheduling)."""

from __future__ import annotations

import asyncio

import pytest

from asyncengine import LLM, EngineConfig, SamplingParams
from asyncengine.async_engine import AsyncLLMEngine
from conftest import assert_no_leaks, assert_same_completions

PROMPTS = ["KING HENRY:\nOnce more unto the breach", "And God said, Let there be", "To be, or not to be", "O Romeo"]
EOS = 1  # the default model's <|end_of_text|>


def make_llm(lookahead: bool, **kwargs) -> LLM:
    return LLM(max_model_len=256, async_scheduling=lookahead, **kwargs)


def count_feedback_steps(llm: LLM) -> dict:
    """Count launched steps whose inputs took in-flight tokens from the previous step (on the device)."""
    runner, counter = llm.engine.runner, {"feedback": 0, "steps": 0}
    launch = runner.launch

    def counting(inputs):
        counter["steps"] += 1
        counter["feedback"] += inputs.feedback is not None
        return launch(inputs)

    runner.launch = counting
    return counter


def generate_both(params, prompts=PROMPTS, **kwargs):
    results = []
    for lookahead in (False, True):
        llm = make_llm(lookahead, **kwargs)
        counter = count_feedback_steps(llm)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_no_leaks(llm.engine)
        counter["preemptions"] = llm.engine.scheduler.num_preemptions
        results.append((outputs, counter))
    (plain, plain_count), (ahead, ahead_count) = results
    assert plain_count["feedback"] == 0
    return plain, ahead, ahead_count


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "seeded_n2_logprobs": SamplingParams(temperature=0.9, top_p=0.95, seed=7, n=2, max_tokens=20, logprobs=3),
    # EOS made certain after 3 tokens: the request ends while its next step is already in flight
    "eos_after_min_tokens": SamplingParams(temperature=0, min_tokens=3, max_tokens=20, logit_bias={EOS: 100.0}),
    "stop_token_and_max_tokens_mix": SamplingParams(temperature=0, max_tokens=17, stop_token_ids=[EOS]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lookahead_outputs_equal_plain_outputs(case):
    plain, ahead, counter = generate_both(CASES[case])
    assert_same_completions(ahead, plain)
    assert counter["feedback"] > 0, "lookahead never fed an in-flight token"


def test_lookahead_ends_on_a_stop_string_like_plain():
    text = make_llm(False).generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    stop = text.outputs[0].text[8:12]  # a string that greedy decoding is sure to produce
    params = SamplingParams(temperature=0, max_tokens=30, stop=[stop])
    plain, ahead, _ = generate_both(params)
    assert_same_completions(ahead, plain)
    assert plain[0].outputs[0].finish_reason == "stop" and plain[0].outputs[0].stop_reason == stop


def test_lookahead_with_preemption_and_chunked_prefill():
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    prompts = [p * 3 for p in PROMPTS]  # 4 x (~30 + 80) tokens in 256 KV slots
    plain, ahead, counter = generate_both(params, prompts, num_kv_blocks=32, block_size=8, max_num_seqs=4,
                                          max_num_batched_tokens=16)
    assert_same_completions(ahead, plain)
    assert counter["feedback"] > 0 and counter["preemptions"] > 0


PENALTY_CASES = {
    "greedy_presence_repetition": SamplingParams(temperature=0, max_tokens=24, presence_penalty=0.8,
                                                 repetition_penalty=1.2),
    "seeded_n2_frequency_logprobs": SamplingParams(temperature=0.5, seed=3, n=2, max_tokens=20, frequency_penalty=2.0,
                                                   presence_penalty=2.0, logprobs=2),
}


@pytest.mark.parametrize("case", list(PENALTY_CASES))
def test_penalties_look_ahead_and_give_the_same_outputs(case):
    """Each step's penalties must count the token the previous step sampled, still in flight: counted from the
    step's input ids on the device. Rows with and without penalties share the batch."""
    params = [PENALTY_CASES[case], SamplingParams(temperature=0, max_tokens=24)] * 2
    plain, ahead, counter = generate_both(params)
    assert_same_completions(ahead, plain)
    assert counter["feedback"] > 0


def test_penalties_with_preemption_and_chunked_prefill_look_ahead_like_plain():
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, frequency_penalty=2.0,
                            repetition_penalty=1.5)
    prompts = [p * 3 for p in PROMPTS]
    plain, ahead, counter = generate_both(params, prompts, num_kv_blocks=32, block_size=8, max_num_seqs=4,
                                          max_num_batched_tokens=16)
    assert_same_completions(ahead, plain)
    assert counter["feedback"] > 0 and counter["preemptions"] > 0


def test_async_engine_with_lookahead_streams_the_same_text_and_survives_aborts():
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].text for o in make_llm(False).generate(PROMPTS, params, use_tqdm=False)]
    engine = AsyncLLMEngine(EngineConfig(max_model_len=256, async_scheduling=True))

    async def full(prompt):
        text = ""
        async for out in engine.generate(prompt, params):
            text = out.outputs[0].text
        return text

    async def abandoned(prompt):
        async for _ in engine.generate(prompt, params):
            break  # the request is aborted with steps in flight

    async def main():
        results = await asyncio.gather(*(full(p) for p in PROMPTS), *(abandoned(p) for p in PROMPTS))
        assert await engine.wait_until_idle(10)
        await engine.shutdown()
        return results[: len(PROMPTS)]

    assert asyncio.run(main()) == expected
    assert_no_leaks(engine.client.engine)
