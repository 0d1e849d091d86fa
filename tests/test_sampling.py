"""SamplingParams validation, the Sampler on synthetic logits (filters, penalties, logit_bias, min_tokens, seeds,
logprobs), and sampling end to end through LLM (seeds independent of the batch, n, logprobs vs transformers)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.request import Request
from asyncengine.sampler import Sampler, SamplingBatch, apply_penalties
from conftest import assert_same_completions

CPU = torch.device("cpu")


# -- SamplingParams validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field, range_text",
    [
        (dict(n=0), "n", "[1, 128]"),
        (dict(n=129), "n", "[1, 128]"),
        (dict(temperature=-1), "temperature", "[0, 100]"),
        (dict(temperature=float("nan")), "temperature", "[0, 100]"),
        (dict(top_p=0), "top_p", "(0, 1]"),
        (dict(top_p=2), "top_p", "(0, 1]"),
        (dict(top_k=-5), "top_k", "-1 (disabled) or a positive integer"),
        (dict(min_p=1.5), "min_p", "[0, 1]"),
        (dict(presence_penalty=3), "presence_penalty", "[-2, 2]"),
        (dict(frequency_penalty=-2.5), "frequency_penalty", "[-2, 2]"),
        (dict(repetition_penalty=0), "repetition_penalty", "(0, 10]"),
        (dict(max_tokens=0), "max_tokens", "at least 1"),
        (dict(min_tokens=-1), "min_tokens", ">= 0"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens", "<= max_tokens=2"),
        (dict(logprobs=21), "logprobs", "[0, 20]"),
        (dict(logprobs=-1), "logprobs", "[0, 20]"),
        (dict(logit_bias={5: 100.5}), "logit_bias", "[-100, 100]"),
        (dict(logit_bias={5: -101}), "logit_bias", "[-100, 100]"),
        (dict(logit_bias={-3: 1.0}), "logit_bias", "non-negative"),
        (dict(stop=[""]), "stop", "non-empty"),
        (dict(stop=[f"s{i}" for i in range(17)]), "stop", "at most 16"),
        (dict(stop_token_ids=[-1]), "stop_token_ids", "non-negative"),
        (dict(seed=2**64), "seed", "2**63-1"),
    ],
)
def test_invalid_sampling_params_name_the_field_and_range(kwargs, field, range_text):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{field} "), message
    assert range_text in message, message


def test_boundary_values_are_accepted_and_normalised():
    p = SamplingParams(n=128, temperature=0, top_p=1.0, top_k=0, min_p=1.0, presence_penalty=-2,
                       frequency_penalty=2, repetition_penalty=10, max_tokens=1, min_tokens=1, logprobs=20,
                       logit_bias={"7": 100, 8: -100}, stop="END", seed=-(2**63 - 1))
    assert p.top_k == -1 and p.greedy
    assert p.stop == ["END"] and p.stop_token_ids == []
    assert p.logit_bias == {7: 100.0, 8: -100.0}
    SamplingParams(logprobs=0, seed=2**63 - 1)


@pytest.mark.parametrize("field", ["stop_token_ids", "logit_bias"])
def test_validate_for_model_rejects_token_ids_outside_the_vocabulary(field):
    value = [10, 384] if field == "stop_token_ids" else {10: 1.0, 384: 1.0}
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=rf"^{field} .*\[384\].*\[0, 384\)"):
        params.validate_for_model(384)
    params.validate_for_model(385)
    SamplingParams(**{field: [383] if field == "stop_token_ids" else {383: 1.0}}).validate_for_model(384)


# -- the Sampler on synthetic logits ---------------------------------------------------------------------------
PROBS = torch.tensor([0.35, 0.25, 0.15, 0.10, 0.08, 0.07])  # every dropped token would show up ~140 times in 2000
LOGITS = PROBS.log()
DRAWS = 2000


def make_request(params: SamplingParams, prompt=(3, 4), outputs=(), request_id="r", eos=()) -> Request:
    request = Request(request_id, list(prompt), params, max_tokens=1000, eos_token_ids=frozenset(eos))
    for token in outputs:
        request.append_token(token)
    return request


def sample_many(params: SamplingParams, logits_row: torch.Tensor = LOGITS, n: int = DRAWS) -> torch.Tensor:
    """n independent draws (n rows of one request) with the seeded global generator."""
    torch.manual_seed(0)
    requests = [make_request(params)] * n
    batch = SamplingBatch.build(requests, logits_row.numel(), CPU)
    return Sampler()(logits_row.repeat(n, 1), batch).token_ids


def renormalised(weights: torch.Tensor, allowed: list[int]) -> torch.Tensor:
    target = torch.zeros_like(weights)
    target[allowed] = weights[allowed] / weights[allowed].sum()
    return target


@pytest.mark.parametrize(
    "kwargs, allowed, weights",
    [
        (dict(), [0, 1, 2, 3, 4, 5], PROBS),
        (dict(temperature=0.5), [0, 1, 2, 3, 4, 5], PROBS**2),
        (dict(top_k=2), [0, 1], PROBS),
        (dict(top_k=3, temperature=0.5), [0, 1, 2], PROBS**2),
        (dict(top_p=0.5), [0, 1], PROBS),  # mass before token 2 is 0.60 >= 0.5
        (dict(top_p=0.65), [0, 1, 2], PROBS),  # mass before token 3 is 0.75 >= 0.65
        (dict(top_k=4, top_p=0.8), [0, 1, 2], PROBS),  # top_p over the top-k *renormalised* mass (0.706, 0.882)
        (dict(min_p=0.5), [0, 1], PROBS),  # 0.5 * 0.35 = 0.175
        (dict(min_p=0.5, temperature=2.0), [0, 1, 2, 3], PROBS**0.5),  # min_p on tempered probs: ratio 0.535 vs 0.478
    ],
)
def test_filters_never_sample_outside_the_allowed_set_and_match_the_target(kwargs, allowed, weights):
    tokens = sample_many(SamplingParams(**kwargs))
    counts = torch.bincount(tokens, minlength=6).float()
    outside = [t for t in range(6) if t not in allowed]
    assert counts[outside].sum() == 0, f"sampled dropped tokens: {counts.tolist()}"
    target = renormalised(weights, allowed)
    assert torch.allclose(counts / DRAWS, target, atol=0.04), (counts / DRAWS, target)


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    torch.manual_seed(0)
    greedy, sampled = make_request(SamplingParams(temperature=0), request_id="g"), make_request(SamplingParams())
    requests = [greedy, sampled] * 500
    batch = SamplingBatch.build(requests, 6, CPU)
    tokens = Sampler()(LOGITS.repeat(1000, 1), batch).token_ids
    assert (tokens[0::2] == 0).all()
    assert len(set(tokens[1::2].tolist())) == 6


@pytest.mark.parametrize("temperature", [1e-40, 1e-6])
def test_a_temperature_too_small_to_divide_by_samples_greedily(temperature):
    """logits / 1e-40 overflow to inf and the probabilities to NaN, which used to pick token 0 every time; below
    1e-5 the row is greedy (vLLM's rule). Here the argmax is token 2, not 0."""
    row = torch.tensor([0.1, 0.3, 5.0, 1.0, -2.0, 0.0])
    assert SamplingParams(temperature=temperature).greedy
    assert (sample_many(SamplingParams(temperature=temperature), row, n=64) == 2).all()
    assert not SamplingParams(temperature=1e-5).greedy


# Mixed signs on seen tokens: 0, 2, 5 positive; 1, 3 negative; 4, 6, 7 unseen.
PEN_LOGITS = torch.tensor([2.0, -1.0, 1.5, -0.5, 0.7, 3.0, -2.0, 0.0])
PROMPT, OUTPUT = [0, 1], [2, 3, 3, 5]


def expected_penalised(rep: float, freq: float, pres: float) -> torch.Tensor:
    """The formulas, by hand: repetition over prompt + output tokens (divide positive, multiply negative);
    frequency and presence over output tokens only."""
    out = []
    for token, logit in enumerate(PEN_LOGITS.tolist()):
        count = OUTPUT.count(token)
        if token in PROMPT or count:
            logit = logit / rep if logit > 0 else logit * rep
        logit -= freq * count + pres * (1.0 if count else 0.0)
        out.append(logit)
    return torch.tensor([out])


@pytest.mark.parametrize(
    "rep, freq, pres", [(1.5, 0.0, 0.0), (0.5, 0.0, 0.0), (1.0, 0.4, 0.0), (1.0, 0.0, 0.3), (1.0, -0.4, -0.3),
                        (1.3, 0.5, 0.25)]
)
def test_penalties_follow_their_formulas(rep, freq, pres):
    params = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    request = make_request(params, prompt=PROMPT, outputs=OUTPUT)
    got = apply_penalties(PEN_LOGITS.clone().unsqueeze(0), [request])
    assert torch.allclose(got, expected_penalised(rep, freq, pres), atol=1e-6), got


def penalised_row_by_row(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The formulas one row at a time, in Python: the batched implementation must agree on every row."""
    out = logits.clone()
    for row, request in enumerate(requests):
        p, vocab = request.params, logits.shape[1]
        counts = torch.zeros(vocab)
        for token in request.output_token_ids:
            counts[token] += 1
        seen = (counts > 0) | torch.isin(torch.arange(vocab), torch.tensor(request.prompt_token_ids))
        x = out[row]
        if p.repetition_penalty != 1.0:
            x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        out[row] = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    return out


def test_penalties_of_a_mixed_batch_match_the_row_by_row_formulas():
    """Rows with every combination of penalties (and none), prompts reaching past the vocabulary (ignored),
    outputs with repeats and empty ones, in one batch."""
    gen = torch.Generator().manual_seed(5)
    vocab, requests = 50, []
    for i in range(40):
        rep, freq, pres = [(1.0, 0.0, 0.0), (1.4, 0.0, 0.0), (0.7, 0.3, 0.0), (1.0, -0.5, 0.2), (1.2, 0.1, 0.4)][i % 5]
        prompt = torch.randint(0, vocab + 5, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen)
        outputs = torch.randint(0, vocab, (int(torch.randint(0, 20, (1,), generator=gen)),), generator=gen)
        params = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
        requests.append(make_request(params, prompt=prompt.tolist(), outputs=outputs.tolist(), request_id=str(i)))
    logits = torch.randn(40, vocab, generator=gen) * 3
    expected = penalised_row_by_row(logits, requests)
    got = apply_penalties(logits.clone(), requests)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    assert torch.equal(got[0::5], logits[0::5])  # rows without penalties are untouched


def test_penalties_touch_only_rows_that_ask_and_steer_greedy_choice():
    plain = make_request(SamplingParams(temperature=0), prompt=[0], request_id="plain")
    penalised = make_request(SamplingParams(temperature=0, repetition_penalty=1.5), prompt=[0], request_id="pen")
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    batch = SamplingBatch.build([plain, penalised], 3, CPU)
    assert Sampler()(logits, batch).token_ids.tolist() == [0, 1]  # 3.0 / 1.5 = 2.0 < 2.9


@pytest.mark.parametrize("margin, chosen", [(0.01, 4), (-0.01, 5)])
def test_logit_bias_is_added_to_the_logit(margin, chosen):
    """Token 4 (logit log 0.08) gets exactly what it lacks to beat token 5 (log 0.07 + 2.0), +- 0.01."""
    logits = LOGITS.clone()
    logits[5] += 2.0  # token 5 is now the argmax
    bias = float(logits[5] - logits[4]) + margin
    params = SamplingParams(temperature=0, logit_bias={4: bias}, logprobs=1)
    batch = SamplingBatch.build([make_request(params)], 6, CPU)
    out = Sampler()(logits.clone().unsqueeze(0), batch)
    assert out.token_ids.tolist() == [chosen]
    raw = logits.log_softmax(-1)
    assert out.logprobs[0, 0].item() == pytest.approx(raw[chosen].item(), abs=1e-6)  # logprobs are pre-bias


def test_logit_bias_minus_100_removes_a_token_from_sampling():
    tokens = sample_many(SamplingParams(logit_bias={0: -100, 1: -100}))
    assert not ((tokens == 0) | (tokens == 1)).any()
    assert len(set(tokens.tolist())) == 4


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([0.0, 9.0, 0.0, 0.0, 9.0, 0.5])  # EOS 1 and stop id 4 dominate
    params = SamplingParams(min_tokens=2, stop_token_ids=[4])
    for temperature in (0.0, 1.0):
        p = params.clone()
        p.temperature = temperature
        early = make_request(p, outputs=[2], eos=[1])  # 1 of 2 generated so far: masked
        batch = SamplingBatch.build([early] * 500, 6, CPU)
        tokens = Sampler()(logits.repeat(500, 1), batch).token_ids
        assert not ((tokens == 1) | (tokens == 4)).any(), temperature
        done = make_request(p, outputs=[2, 3], eos=[1])  # min_tokens reached: no longer masked
        batch = SamplingBatch.build([done] * 500, 6, CPU)
        tokens = Sampler()(logits.repeat(500, 1), batch).token_ids
        assert ((tokens == 1) | (tokens == 4)).float().mean() > 0.9, temperature
    ignoring = SamplingParams(min_tokens=2, stop_token_ids=[4], ignore_eos=True)
    batch = SamplingBatch.build([make_request(ignoring, eos=[1])], 6, CPU)
    assert batch.banned[0][1].tolist() == [4]  # with ignore_eos, EOS is no stop: nothing to hold back


def test_seeded_row_samples_the_same_whatever_the_batch():
    flat = torch.zeros(50)

    def draws(batch_size: int, global_seed: int) -> list[int]:
        torch.manual_seed(global_seed)
        seeded = make_request(SamplingParams(seed=11), request_id="seeded")
        seeded.generator = torch.Generator().manual_seed(11)
        others = [make_request(SamplingParams(), request_id=f"o{i}") for i in range(batch_size)]
        tokens = []
        for _ in range(10):
            requests = others[: batch_size // 2] + [seeded] + others[batch_size // 2 :]
            batch = SamplingBatch.build(requests, 50, CPU)
            out = Sampler()(flat.repeat(len(requests), 1), batch).token_ids
            tokens.append(out[batch_size // 2].item())
        return tokens

    alone = draws(0, 0)
    assert draws(5, 1) == alone == draws(3, 2)
    assert len(set(alone)) > 3  # not a degenerate distribution


def test_sampler_logprobs_are_raw_log_softmax_with_ranks_and_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0, 0.5], [0.0, 0.1, 0.2, 0.3, 0.4]])
    params = [SamplingParams(temperature=0.7, logprobs=2, logit_bias={3: 5.0}), SamplingParams(temperature=0, logprobs=3)]
    requests = [make_request(p, request_id=str(i)) for i, p in enumerate(params)]
    torch.manual_seed(0)
    out = Sampler()(logits.clone(), SamplingBatch.build(requests, 5, CPU))
    raw = logits.log_softmax(-1)
    for row in range(2):
        token = out.token_ids[row].item()
        assert out.logprob_ids[row, 0].item() == token
        assert out.logprobs[row, 0].item() == pytest.approx(raw[row, token].item(), abs=1e-6)
        assert out.ranks[row].item() == int((raw[row] > raw[row, token]).sum()) + 1
        top_vals, top_ids = raw[row].topk(3)  # the batch's largest N
        assert out.logprob_ids[row, 1:].tolist() == top_ids.tolist()
        assert torch.allclose(out.logprobs[row, 1:], top_vals, atol=1e-6)
    assert out.token_ids[1].item() == 4


# -- end to end through LLM ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_model_len=128)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def neighbours(count: int) -> list[tuple[str, SamplingParams]]:
    """`count` other requests of every kind: unseeded, greedy, other seeds, n=2, penalties, other lengths."""
    kinds = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=0.7, seed=5, max_tokens=9, logprobs=1, ignore_eos=True),
             SamplingParams(temperature=1.0, n=2, top_p=0.9, max_tokens=14, ignore_eos=True),
             SamplingParams(temperature=0.8, frequency_penalty=1.0, top_k=20, max_tokens=18, ignore_eos=True)]
    return [(f"Neighbour {i}: " + "word " * (i % 7), kinds[i % len(kinds)]) for i in range(count)]


@pytest.mark.parametrize("others", [0, 1, 30])
def test_seeded_request_gives_the_same_tokens_whatever_else_is_in_its_batch(llm, others):
    """A seeded request samples from its own generator, so its tokens do not depend on its batch: alone, beside
    one other request, or in the middle of 30 others of every kind. Tokens exactly; logprobs within LOGPROB_ATOL
    (the batch shape changes the order of float sums)."""
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True, logprobs=2)
    alone = llm.generate(["Hello world"], seeded, use_tqdm=False)[0]
    batch = neighbours(others)
    half = len(batch) // 2
    batch = batch[:half] + [("Hello world", seeded)] + batch[half:]
    outputs = llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
    assert_same_completions(outputs[half], alone)
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=16, ignore_eos=True)
    assert llm.generate(["Hello world"], other_seed, use_tqdm=False)[0].outputs[0].token_ids != \
        alone.outputs[0].token_ids


def test_top_k_1_equals_greedy(llm):
    prompts = ["Hello world", "The quick brown fox", "0123456789"]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    assert token_ids(top1) == token_ids(greedy)


def test_n_with_a_seed_gives_n_distinct_reproducible_samples(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=99, max_tokens=10, ignore_eos=True)
    first = llm.generate(["Hello world"], params, use_tqdm=False)[0]
    again = llm.generate(["Hello world"], params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert all(len(c.token_ids) == 10 for c in first.outputs)
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3


def test_logprobs_match_transformers_log_softmax(llm, llama_dir):
    from transformers import AutoModelForCausalLM

    n = 3
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=8, logprobs=n, ignore_eos=True)
    out = llm.generate(["Hello world"], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 8
    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    ids = torch.tensor([out.prompt_token_ids + completion.token_ids])
    with torch.no_grad():
        ref = model(ids).logits[0].log_softmax(-1)  # raw: no temperature
    start = len(out.prompt_token_ids) - 1
    total = 0.0
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[start + i]
        assert token in entry and len(entry) in (n, n + 1)
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top_vals, top_ids = row.topk(n)
        for rank, (value, token_id) in enumerate(zip(top_vals.tolist(), top_ids.tolist()), start=1):
            assert entry[token_id].logprob == pytest.approx(value, abs=1e-4)
            if token_id != token:
                assert entry[token_id].rank == rank
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-5)
    assert math.isfinite(total)


def test_logprobs_zero_returns_the_chosen_token_only(llm):
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert [list(e) for e in out.logprobs] == [[t] for t in out.token_ids]
    assert all(e[t].rank == 1 for e, t in zip(out.logprobs, out.token_ids))  # greedy: the top token
    no_lp = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert no_lp.logprobs is None and no_lp.cumulative_logprob is None


@pytest.mark.parametrize("rows, vocab", [(64, 8192), (5, 128), (2, 192)])
def test_greedy_tokens_on_the_cpu_heads_transposed_logits_equal_argmax(rows, vocab):
    """The blocked argmax (CPU, logits a transposed view of [V, S]) picks argmax's index: the first of tied
    maxima, across and within blocks, NaN as the largest, rows of -inf; and contiguous logits go to argmax."""
    from asyncengine.sampler import ARGMAX_BLOCK, greedy_tokens

    logits = torch.randn(vocab, rows).t()  # [S, V] view, stride (1, S): what the CPU LM head returns
    logits[0, :] = 0.5  # every entry tied: index 0
    logits[1, [ARGMAX_BLOCK + 3, 7]] = 1e6  # tied in two blocks: the earlier block's
    if rows > 2:
        logits[2, [ARGMAX_BLOCK - 1, ARGMAX_BLOCK - 2]] = float("nan")  # NaN wins, the first one
        logits[3, :] = float("-inf")
        logits[4, [vocab - 1, vocab - 2]] = 1e6  # ties within the last block
    assert logits.stride(0) == 1
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    contiguous = logits.contiguous()
    assert torch.equal(greedy_tokens(contiguous), contiguous.argmax(dim=-1))


def test_packed_step_inputs_keep_each_arrays_dtype_shape_and_values_at_aligned_offsets_of_one_buffer():
    """A step's inputs in one copy (model_runner.prepare -> sampler.to_device_packed on CUDA): packed and unpacked,
    each array comes back with its dtype, shape and values, at a 16-byte aligned offset of one buffer (Triton
    specialises kernels on 16-byte alignment); empty ones too. On a CPU the arrays are sent as they are."""
    import numpy as np

    from asyncengine.sampler import pack_arrays, to_device_packed, unpack_arrays

    arrays = [np.arange(5, dtype=np.int32), np.full((2, 3), 7, dtype=np.int32), np.arange(3, dtype=np.int64),
              np.array([], dtype=np.int64), np.array([1.5, -2.0], dtype=np.float32), np.array([True, False])]
    buffer, offsets = pack_arrays(arrays)
    for sent in (unpack_arrays(buffer.clone(), arrays, offsets), to_device_packed(arrays, torch.device("cpu"))):
        for array, tensor in zip(arrays, sent):
            assert tensor.dtype == torch.from_numpy(array).dtype and tuple(tensor.shape) == array.shape
            assert np.array_equal(tensor.numpy(), array)
    views = unpack_arrays(buffer, arrays, offsets)
    base = buffer.data_ptr()
    assert all(v.untyped_storage().data_ptr() == base and (v.data_ptr() - base) % 16 == 0 for v in views)
