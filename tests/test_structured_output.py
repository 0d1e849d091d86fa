"""Constrained decoding in the engine (xgrammar), on CPU with the embedded default model: outputs obey JSON
schemas, regexes, choices and grammars under sampling; unconstrained requests in the same batch are untouched;
lookahead, penalties, n > 1, seeds, preemption, prefix caching and the engine process keep working; grammars
compile in the background without holding up the batch; bad constraints fail with the field named."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import Future

import jsonschema
import pytest

from asyncengine import LLM, SamplingParams, StructuredOutputsParams, ThinkingTokens
from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.config import EngineConfig
from conftest import THINK_IDS, assert_no_leaks

PROMPTS = ["KING HENRY:\nOnce more unto the breach", "And God said, Let there be", "To be, or not to be", "O Romeo"]

# Nested objects, arrays, enums, numbers; every unbounded part bounded so that sampling terminates.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["king", "queen", "fool"]},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "rooms": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 9}},
            "required": ["city", "rooms"],
            "additionalProperties": False,
        },
        "friends": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "home", "friends", "alive"],
    "additionalProperties": False,
}


def json_params(**kwargs) -> SamplingParams:
    so = StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True)
    return SamplingParams(structured_outputs=so, **{"max_tokens": 120, **kwargs})


# -- parameters -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"),
    ({"regex": "a+", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"json": 3}, "structured_outputs.json"),
])
def test_structured_outputs_params_need_exactly_one_valid_kind(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_a_constraint_cannot_be_combined_with_options_that_forbid_eos():
    so = StructuredOutputsParams(regex="a+")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured_outputs=so, ignore_eos=True)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(structured_outputs=so, min_tokens=2)


# -- the engine -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256)


def texts(outputs) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


def test_sampled_json_completions_all_validate_against_the_schema(llm):
    params = json_params(temperature=1.0, n=5, seed=3)  # (50 more over the API: test_server_structured.py)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    results = texts(outputs)
    assert len(results) == 20
    for text in results:
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    assert all(c.finish_reason == "stop" for o in outputs for c in o.outputs)
    assert len(set(results)) > 5, "temperature 1 should give varied outputs"
    assert_no_leaks(llm.engine)


def test_regex_choice_and_grammar_are_obeyed(llm):
    cases = {
        "regex": (StructuredOutputsParams(regex=r"[A-Z][a-z]{2,6} (of|and) [0-9]{1,3}"),
                  lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} (of|and) [0-9]{1,3}", t)),
        "choice": (StructuredOutputsParams(choice=["Romeo", "Juliet", "Mercutio \"the bold\""]),
                   lambda t: t in ("Romeo", "Juliet", "Mercutio \"the bold\"")),
        "grammar": (StructuredOutputsParams(grammar='root ::= "yes" | "no" | ("maybe " [0-9])'),
                    lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t)),
    }  # (json_object: test_server_structured.py)
    for name, (so, check) in cases.items():
        params = SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=40, structured_outputs=so)
        outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        for completion in (c for o in outputs for c in o.outputs):
            assert completion.finish_reason == "stop", (name, completion)
            assert check(completion.text), (name, completion.text)


def run(lookahead: bool, prompts, params, **kwargs):
    llm = LLM(async_scheduling=lookahead, **{"max_model_len": 256, **kwargs})
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaks(llm.engine)
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs], llm


@pytest.mark.parametrize("lookahead", [False, True])
def test_unconstrained_outputs_are_unchanged_by_constrained_neighbours(lookahead):
    plain = SamplingParams(temperature=0, max_tokens=20)
    alone, _ = run(lookahead, PROMPTS, plain)
    mixed_params = [plain, json_params(temperature=0), plain, json_params(temperature=0.8, seed=1), plain]
    mixed, llm = run(lookahead, PROMPTS + ["O Romeo"], mixed_params)
    assert [mixed[0], mixed[2], mixed[4]] == [alone[0], alone[2], alone[3]]
    for constrained in (mixed[1], mixed[3]):
        jsonschema.validate(json.loads(constrained[0][1]), PERSON_SCHEMA)
    assert llm.engine.runner.grammar_masked_steps > 0


def test_lookahead_gives_the_same_constrained_outputs_as_plain_with_penalties_seeds_and_n():
    params = json_params(temperature=0.9, seed=5, n=3, repetition_penalty=1.3, frequency_penalty=0.5,
                         presence_penalty=0.3)
    plain, _ = run(False, PROMPTS[:2], params)
    ahead, llm = run(True, PROMPTS[:2], params)
    assert ahead == plain
    for completion in (c for o in ahead for c in o):
        jsonschema.validate(json.loads(completion[1]), PERSON_SCHEMA)


@pytest.mark.parametrize("lookahead", [False, True])
def test_preempted_constrained_requests_resume_their_grammar(lookahead):
    params = json_params(temperature=0, max_tokens=110)
    roomy, _ = run(lookahead, PROMPTS, params, max_model_len=128)
    # 9 blocks of 16 tokens for 4 requests of ~90 tokens: requests are preempted and recomputed
    tight, llm = run(lookahead, PROMPTS, params, max_model_len=128, num_kv_blocks=9, block_size=16)
    assert llm.engine.scheduler.num_preemptions > 0
    assert tight == roomy


def test_prefix_cached_prompts_are_constrained_too(llm):
    params = json_params(temperature=0)
    prompt = " ".join(PROMPTS)  # several full blocks
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].text == first.outputs[0].text
    jsonschema.validate(json.loads(second.outputs[0].text), PERSON_SCHEMA)


def test_a_request_waiting_for_its_grammar_does_not_hold_up_the_batch(llm):
    """A grammar still compiling keeps its request out of the scheduler; others run and finish meanwhile."""
    engine = llm.engine
    gate: Future = Future()
    real_submit = engine.structured.submit
    engine.structured.submit = lambda constraint: gate
    try:
        engine.add_request("slow", PROMPTS[0], json_params(temperature=0))
        engine.add_request("fast", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8))
        finished = {}
        for _ in range(40):
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
            if "fast" in finished:
                break
        assert "fast" in finished and "slow" not in finished
        assert engine.stats().num_waiting == 1 and engine.output_processor.children["slow"].num_computed_tokens == 0
        gate.set_result(real_submit(StructuredOutputsParams(json=PERSON_SCHEMA,
                                                             disable_any_whitespace=True)).result())
        while engine.has_unfinished_requests():
            for output in engine.step():
                finished[output.request_id] = output
        jsonschema.validate(json.loads(finished["slow"].outputs[0].text), PERSON_SCHEMA)
    finally:
        engine.structured.submit = real_submit
    assert_no_leaks(engine)


def test_compilation_is_cached_by_constraint_and_bad_constraints_name_the_field(llm):
    manager = llm.engine.structured
    a = manager.submit(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    b = manager.submit(StructuredOutputsParams(json={"properties": {"a": {"type": "integer"}}, "type": "object"}))
    assert a is b
    with pytest.raises(ValueError, match=r"structured_outputs\.regex does not compile"):
        llm.generate("O", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")),
                     use_tqdm=False)
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar does not compile"):
        llm.generate("O", SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= undefined_rule")),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("engine_process", [False, True])
def test_async_engine_constrains_in_process_and_in_the_engine_process(engine_process):
    async def main():
        engine = AsyncLLMEngine(EngineConfig(max_model_len=256, engine_process=engine_process))
        try:
            with pytest.raises(ValueError, match="structured_outputs.regex"):
                await engine.add_request("O", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[")))

            async def one(seed):
                final = None
                async for output in engine.generate(PROMPTS[seed % 4], json_params(temperature=1.0, seed=seed)):
                    final = output
                return final.outputs[0].text

            results = await asyncio.gather(*(one(seed) for seed in range(3)))
            for text in results:
                jsonschema.validate(json.loads(text), PERSON_SCHEMA)
        finally:
            await engine.shutdown()

    asyncio.run(main())


# -- a constraint on the answer after a reasoning model's thinking ----------------------------------------------
ANSWER_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                  "b": {"enum": ["x", "y"]}},
                 "required": ["a", "b"], "additionalProperties": False}
START, END = THINK_IDS  # think_dir's <think> and </think>


@pytest.fixture(scope="module")
def think_llms(think_dir):
    """The think-token checkpoint without and with lookahead."""
    return {lookahead: LLM(model=str(think_dir), max_model_len=256, async_scheduling=lookahead)
            for lookahead in (False, True)}


def thinking_runs(llm, thinking: ThinkingTokens, logit_bias: dict, seeds=range(4)):
    """(free, constrained) completions per seed: the same sampling without and with the answer's constraint."""
    runs = []
    for seed in seeds:
        base = dict(temperature=1.0, seed=seed, max_tokens=80, logit_bias=logit_bias)
        so = StructuredOutputsParams(json=ANSWER_SCHEMA, after_thinking=thinking)
        free, constrained = (llm.generate(["Hello world"], SamplingParams(**base, **extra), use_tqdm=False)[0]
                             .outputs[0] for extra in ({}, {"structured_outputs": so}))
        runs.append((free, constrained))
    assert_no_leaks(llm.engine)
    return runs


@pytest.mark.parametrize("lookahead", [False, True])
def test_thinking_is_free_and_the_answer_after_it_obeys_the_schema(think_llms, lookahead):
    """The output begins inside the thinking (DeepSeek-R1 style): up to and including </think>, the constrained
    run samples exactly the free run's tokens; after it, valid JSON. (A bias on </think> makes the random model
    close its thinking within a few tokens.)"""
    runs = thinking_runs(think_llms[lookahead], ThinkingTokens(end=END), {END: 3.5})
    for free, constrained in runs:
        end = constrained.token_ids.index(END)
        assert constrained.token_ids[:end + 1] == free.token_ids[:end + 1]
        answer = constrained.text.split("</think>", 1)[1]
        jsonschema.validate(json.loads(answer), ANSWER_SCHEMA)
        assert constrained.finish_reason == "stop"
    thoughts = [c.text.split("</think>", 1)[0] for _, c in runs]
    assert any(t and t[0] != "{" for t in thoughts), thoughts  # the thinking is text the schema would forbid


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_first_think_token_opens_the_thinking_and_any_other_first_token_begins_the_answer(think_llms, lookahead):
    """Qwen3 style (thinking may be off): the first token may be <think> or what the schema allows."""
    llm, thinking = think_llms[lookahead], ThinkingTokens(end=END, start=START)
    for free, constrained in thinking_runs(llm, thinking, {START: 8.0, END: 6.0}, seeds=(1, 3)):
        assert constrained.token_ids[0] == START == free.token_ids[0]
        end = constrained.token_ids.index(END)
        assert constrained.token_ids[:end + 1] == free.token_ids[:end + 1]
        jsonschema.validate(json.loads(constrained.text.split("</think>", 1)[1]), ANSWER_SCHEMA)
    for _, constrained in thinking_runs(llm, thinking, {}, seeds=(0, 1)):  # no thinking: all of it is the answer
        assert START not in constrained.token_ids
        jsonschema.validate(json.loads(constrained.text), ANSWER_SCHEMA)


def test_thinking_token_ids_are_checked_against_the_vocabulary(llm):
    so = StructuredOutputsParams(json=ANSWER_SCHEMA, after_thinking=ThinkingTokens(end=10**6))
    with pytest.raises(ValueError, match=r"structured_outputs\.after_thinking holds token ids \[1000000\]"):
        llm.generate("O", SamplingParams(structured_outputs=so), use_tqdm=False)
    with pytest.raises(ValueError, match=r"structured_outputs\.after_thinking\.end must be a token id"):
        ThinkingTokens(end=-1)
