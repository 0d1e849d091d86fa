"""When requests end and what their text holds: length, EOS, stop token ids, stop strings (also across a token
boundary), min_tokens, prompt limits, abort, request ids; and the incremental detokenizer."""

from __future__ import annotations

import pytest

from asyncengine import LLM, EngineConfig, LLMEngine, SamplingParams
from asyncengine.tokenizer import IncrementalDetokenizer, load_tokenizer
from conftest import assert_no_leaks

MAX_LEN = 64
PROMPT = "The quick brown fox"
EOS = 1  # the test checkpoints' </s>


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_model_len=MAX_LEN)


@pytest.fixture
def engine(llama_dir):
    return LLMEngine(EngineConfig(model=str(llama_dir), max_model_len=MAX_LEN, block_size=4))


def run_one(llm, params: SamplingParams, prompt=PROMPT):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def greedy(llm, max_tokens=24, prompt=PROMPT):
    return run_one(llm, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), prompt)


def run_to_end(engine) -> dict:
    finals = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("requests did not finish")


# -- length ----------------------------------------------------------------------------------------------------
def test_max_tokens_ends_with_length(llm):
    out = run_one(llm, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length" and out.stop_reason is None


def test_default_max_tokens_is_the_rest_of_max_model_len(llm):
    prompt_len = len(llm.get_tokenizer()(PROMPT).input_ids)
    out = run_one(llm, SamplingParams(temperature=0, ignore_eos=True))
    assert len(out.token_ids) == MAX_LEN - prompt_len
    assert out.finish_reason == "length"


# -- stop token ids and EOS ------------------------------------------------------------------------------------
def test_stop_token_id_ends_with_its_id_and_without_its_text(llm):
    tok = llm.get_tokenizer()
    ref = greedy(llm).token_ids
    # a stop token that first appears at k >= 3, with visible text, after text that ends on a whole character
    k = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i] and tok.decode([ref[i]]).strip()
             and not tok.decode(ref[:i]).endswith("\ufffd"))
    stop_id = ref[k]
    out = run_one(llm, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]))
    assert out.token_ids == ref[: k + 1]  # the stop token is the last token...
    assert out.text == tok.decode(ref[:k])  # ...but its text is not in the output
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    kept = run_one(llm, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id],
                                       include_stop_str_in_output=True))
    assert kept.token_ids == ref[: k + 1] and kept.text == tok.decode(ref[: k + 1])


def test_eos_ends_with_stop_and_min_tokens_holds_it_back(llm):
    forced = {EOS: 100.0}
    first = run_one(llm, SamplingParams(temperature=0, max_tokens=10, logit_bias=forced))
    assert first.token_ids == [EOS] and first.finish_reason == "stop" and first.stop_reason is None
    assert first.text == ""
    out = run_one(llm, SamplingParams(temperature=0, max_tokens=10, logit_bias=forced, min_tokens=3))
    assert len(out.token_ids) == 4 and EOS not in out.token_ids[:3] and out.token_ids[3] == EOS
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert "</s>" not in out.text
    sampled = run_one(llm, SamplingParams(temperature=1.0, seed=3, max_tokens=10, logit_bias=forced, min_tokens=5))
    assert len(sampled.token_ids) == 6 and sampled.token_ids[5] == EOS and EOS not in sampled.token_ids[:5]
    ignored = run_one(llm, SamplingParams(temperature=0, max_tokens=6, logit_bias=forced, ignore_eos=True))
    assert ignored.token_ids == [EOS] * 6 and ignored.finish_reason == "length"


# -- stop strings ----------------------------------------------------------------------------------------------
def boundary_stop(llm):
    """From a greedy run, a 2-character stop string whose characters come from two different tokens (first
    occurrence in the text), with j = the index of the token that completes it."""
    tok = llm.get_tokenizer()
    ref = greedy(llm)
    text = ref.text
    for j in range(2, len(ref.token_ids)):
        before = tok.decode(ref.token_ids[:j])
        b = len(before)
        if not text.startswith(before) or b < 2 or b >= len(text) or before.endswith("\ufffd"):
            continue
        stop = text[b - 1 : b + 1]
        if "\ufffd" in stop or not stop.isprintable() or text.find(stop) != b - 1:
            continue
        if len(tok.decode(ref.token_ids[: j + 1])) > b:  # token j itself brings the 2nd character
            return ref, stop, j, b
    raise AssertionError(f"no boundary-straddling stop string in {text!r}")


def test_stop_string_spanning_two_tokens_is_cut_from_the_text(llm):
    ref, stop, j, b = boundary_stop(llm)
    out = run_one(llm, SamplingParams(temperature=0, max_tokens=24, stop=[stop]))
    assert out.token_ids == ref.token_ids[: j + 1]  # stopped at the token that completed the string
    assert out.text == ref.text[: b - 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = run_one(llm, SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True))
    assert kept.text == ref.text[: b + 1] and kept.token_ids == ref.token_ids[: j + 1]


def test_earliest_of_several_stop_strings_wins(llm):
    ref, stop, j, b = boundary_stop(llm)
    later = ref.text[b + 2 : b + 4]
    if not later or "\ufffd" in later or later in ref.text[: b + 1]:
        later = "never-in-output"
    out = run_one(llm, SamplingParams(temperature=0, max_tokens=24, stop=[later, stop]))
    assert out.stop_reason == stop and out.text == ref.text[: b - 1]


def test_stop_string_completed_by_the_last_allowed_token_reports_stop(llm):
    ref, stop, j, b = boundary_stop(llm)
    out = run_one(llm, SamplingParams(temperature=0, max_tokens=j + 1, stop=[stop]))
    assert out.text == ref.text[: b - 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


# -- prompt limits ---------------------------------------------------------------------------------------------
def test_prompt_longer_than_max_model_len_is_rejected_with_both_lengths(llm):
    with pytest.raises(ValueError, match=rf"\b70\b.*\b{MAX_LEN}\b"):
        llm.generate([[5] * 70], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match=rf"prompt is {MAX_LEN} tokens but max_model_len is {MAX_LEN}"):
        llm.generate([[5] * MAX_LEN], SamplingParams(), use_tqdm=False)  # no room left for one token
    assert len(run_one(llm, SamplingParams(max_tokens=1, ignore_eos=True), [5] * (MAX_LEN - 1)).token_ids) == 1
    assert_no_leaks(llm.engine)


def test_prompt_plus_max_tokens_beyond_max_model_len_is_rejected(llm):
    with pytest.raises(ValueError, match=rf"\(10 tokens\) \+ max_tokens \(55\) = 65 exceeds max_model_len \({MAX_LEN}\)"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=55), use_tqdm=False)
    out = run_one(llm, SamplingParams(max_tokens=54, temperature=0, ignore_eos=True), [5] * 10)
    assert len(out.token_ids) == 54


def test_empty_and_out_of_vocab_prompts_are_rejected(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 384\)"):
        engine.add_request("v", [5, 384], SamplingParams())
    assert_no_leaks(engine)


def test_a_bad_prompt_in_a_batch_adds_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate(["Hello", [], "world"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_no_leaks(llm.engine)


# -- abort and request ids -------------------------------------------------------------------------------------
def test_abort_frees_every_block_and_reports_abort(engine):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("decoding", "Hello world", params)
    engine.add_request("fanned", PROMPT, SamplingParams(n=2, seed=1, max_tokens=40, ignore_eos=True))
    engine.add_request("long", [7] * 50, SamplingParams(temperature=0, max_tokens=5))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    outs = engine.abort_request(["decoding", "fanned", "unknown-id"])
    assert [o.request_id for o in outs] == ["decoding", "fanned"]
    for out in outs:
        assert out.finished and all(c.finish_reason == "abort" for c in out.outputs)
    assert len(outs[1].outputs) == 2
    assert len(outs[0].outputs[0].token_ids) == 3  # what it had generated is kept
    engine.abort_request("long")
    assert_no_leaks(engine)
    assert engine.step() == []


def test_abort_of_a_waiting_request_and_the_rest_runs_on(engine):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", "Hello world", params)
    engine.add_request("b", "Hello", params)
    engine.abort_request("b")  # never scheduled
    finals = run_to_end(engine)
    assert list(finals) == ["a"] and len(finals["a"].outputs[0].token_ids) == 3
    assert_no_leaks(engine)


def test_request_id_reuse_after_finish_works_and_a_live_duplicate_is_rejected(engine):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("x", "Hello world", params)
    first = run_to_end(engine)["x"]
    engine.add_request("x", "Hello world", params)
    engine.add_request("y", "Hello", params)
    with pytest.raises(ValueError, match="'y' is already in use"):
        engine.add_request("y", "something else", params)
    finals = run_to_end(engine)
    assert finals["x"].outputs[0].token_ids == first.outputs[0].token_ids
    assert finals["y"].prompt == "Hello"  # the duplicate changed nothing
    assert_no_leaks(engine)


# -- incremental detokenizer -----------------------------------------------------------------------------------
TEXT = "Ünïcödé 漢字 🙂🚀 — naïve café, 日本語テキスト, Ελληνικά, 👩‍💻 ß€ done."


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call gets."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.sizes: list[int] = []

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def stream(tokenizer, prompt_ids, output_ids, params=None):
    """Feed output tokens one by one; returns (detokenizer, deltas, window sizes seen after each token)."""
    detok = IncrementalDetokenizer(tokenizer, len(prompt_ids), params or SamplingParams())
    ids, deltas, windows = list(prompt_ids), [], []
    for i, token in enumerate(output_ids):
        ids.append(token)
        before = len(detok.text)
        stop = detok.update(ids, final=i == len(output_ids) - 1)
        deltas.append(detok.text[before:])
        windows.append(detok.read_offset - detok.prefix_offset)
        if stop is not None:
            break
    return detok, deltas, windows


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return load_tokenizer(str(llama_dir))


def test_deltas_add_up_to_decode_and_never_hold_a_replacement_char(tokenizer):
    prompt = tokenizer("Hello").input_ids
    output = tokenizer.encode(TEXT * 4, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([t]) for t in output), "precondition: characters split over tokens"
    detok, deltas, _ = stream(tokenizer, prompt, output)
    assert "".join(deltas) == tokenizer.decode(output) == TEXT * 4
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some tokens were held back until their character was complete


def test_special_tokens_are_skipped_in_deltas(tokenizer):
    output = tokenizer.encode("Hello", add_special_tokens=False) + [EOS] + tokenizer.encode(" 漢字",
                                                                                               add_special_tokens=False)
    detok, deltas, _ = stream(tokenizer, [0], output)
    assert detok.text == "Hello 漢字"
    detok, _, _ = stream(tokenizer, [0], output, SamplingParams(skip_special_tokens=False))
    assert detok.text == "Hello</s> 漢字"


def test_detokenizer_work_per_token_is_bounded(tokenizer):
    counting = CountingTokenizer(tokenizer)
    output = tokenizer.encode(TEXT * 10, add_special_tokens=False)
    assert len(output) > 300
    prompt = tokenizer("Hello world, a prompt of some length").input_ids
    _, deltas, windows = stream(counting, prompt, output)
    assert "".join(deltas) == TEXT * 10
    assert max(windows) <= 8
    assert max(counting.sizes) <= 16, max(counting.sizes)  # the decode window, not the whole sequence


def test_detokenizer_finds_a_multibyte_stop_string_split_over_byte_tokens(tokenizer):
    output = tokenizer.encode("abc 漢字 🙂 tail", add_special_tokens=False)
    detok, _, _ = stream(tokenizer, [0], output, SamplingParams(stop=["字 🙂"]))
    assert detok.text == "abc 漢"
    detok, _, _ = stream(tokenizer, [0], output, SamplingParams(stop=["字 🙂"], include_stop_str_in_output=True))
    assert detok.text == "abc 漢字 🙂"


def test_generic_path_of_a_fast_non_byte_level_tokenizer_matches_transformers_decode(tmp_path):
    """A word-level fast tokenizer (no byte table) streams through its Rust backend's decode directly; the
    deltas add up to transformers' decode, with and without special tokens."""
    from loadtest.bench_offline import build_tokenizer

    build_tokenizer(tmp_path, 50)
    words = load_tokenizer(str(tmp_path))
    output = [5, 17, 1, 42, 3, 3, 49]  # 1 is the EOS (special)
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip)
        detok, deltas, _ = stream(words, [0, 7], output, params)
        assert detok._table is None and detok._backend is not None
        whole = words.decode([0, 7] + output, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        prompt = words.decode([0, 7], skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert "".join(deltas) == whole[len(prompt):]  # the text after the prompt's, joining space included
