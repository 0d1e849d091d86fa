"""Request sources: seeded synthetic prompts and JSONL files.

Contract: `load_requests(config)` returns exactly `config.num_prompts` `SampleRequest`s, and for the random
dataset the same config (same seed) always returns the same list.

Token counts of synthetic text are approximate: prompts are built from short, common English words, each of
which is one token (with its leading space) in the usual BPE vocabularies, so `prompt_len` words give about
`prompt_len` tokens (plus the BOS token a server may add). For exact counts use token-id prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import BenchmarkConfig

# Common words that are single tokens in GPT-2/Llama/Qwen style vocabularies (with a leading space).
WORDS = tuple("""
the of and to in is it that for on was with as at by be this from or have an are not but had his they you
were her she which their all one there been has when who will more no if out so said what up its about into
than them can only other new some could time these two may then do first any my now such like our over man me
even most made after also did many before must through back years where much your way well down should because
each just those people how too little state good very make world still own see men work long get here between
both life being under never day same another know while last might us great old year off come since against go
came right used take three house word small part place water land form light hand city river west north south
east open play music game show plan road rain tree fish bird book door room food line name home page
""".split())

SHAREGPT_SIGMA = 0.8  # spread of the lognormal in "sharegpt-like": heavy right tail, like chat logs
SHAREGPT_CLIP = 6.0  # lengths clipped to [1, 6 * mean]


@dataclass(frozen=True)
class SampleRequest:
    """One request to send: a text prompt or a list of token ids, its input length and its max_tokens."""

    prompt: str | list[int]
    prompt_len: int
    max_tokens: int


def load_requests(config: BenchmarkConfig) -> list[SampleRequest]:
    """The `config.num_prompts` requests that the run will send, in order."""
    if config.dataset == "jsonl":
        return jsonl_requests(Path(config.dataset_path), config.num_prompts, config.output_len)
    return random_requests(config)


def random_requests(config: BenchmarkConfig) -> list[SampleRequest]:
    """Synthetic requests, reproducible from `config.seed`."""
    rng = np.random.default_rng(config.seed)
    n = config.num_prompts
    in_lens = sample_lengths(rng, config.input_len, n, config.len_dist, config.range_ratio)
    out_lens = sample_lengths(rng, config.output_len, n, config.len_dist, config.range_ratio)
    requests = []
    for in_len, out_len in zip(in_lens, out_lens):
        if config.prompt_token_ids:
            prompt: str | list[int] = rng.integers(0, config.vocab_size, size=in_len).tolist()
        else:
            prompt = " ".join(rng.choice(WORDS, size=in_len).tolist())
        requests.append(SampleRequest(prompt, int(in_len), int(out_len)))
    return requests


def sample_lengths(rng: np.random.Generator, mean: int, n: int, dist: str, range_ratio: float = 0.5) -> np.ndarray:
    """`n` integer lengths >= 1 around `mean`.

    fixed: all `mean`. uniform: integers in [mean*(1-range_ratio), mean*(1+range_ratio)] (mean preserved).
    sharegpt-like: lognormal with mean `mean` and sigma `SHAREGPT_SIGMA`, clipped to [1, SHAREGPT_CLIP * mean],
    so its sample mean is close to (slightly below) `mean`.
    """
    if dist == "fixed":
        return np.full(n, mean, dtype=np.int64)
    if dist == "uniform":
        low = max(1, int(np.ceil(mean * (1 - range_ratio))))
        high = max(low, int(np.floor(mean * (1 + range_ratio))))
        return rng.integers(low, high + 1, size=n)
    if dist == "sharegpt-like":
        mu = np.log(mean) - SHAREGPT_SIGMA**2 / 2  # E[lognormal(mu, s)] = exp(mu + s^2/2) = mean
        raw = rng.lognormal(mu, SHAREGPT_SIGMA, size=n)
        return np.clip(np.rint(raw), 1, max(1, int(SHAREGPT_CLIP * mean))).astype(np.int64)
    raise ValueError(f"unknown length distribution {dist!r}")


def jsonl_requests(path: Path, num_prompts: int, default_max_tokens: int) -> list[SampleRequest]:
    """Requests from a JSON-lines file, each line an object with `prompt` (text or token ids) and optional
    `max_tokens` (default `default_max_tokens`). Blank lines are skipped; when the file has fewer than
    `num_prompts` lines they are reused in order. `prompt_len` of a text prompt is its word count (an estimate).
    """
    rows = [_parse_row(line, path, lineno)
            for lineno, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no requests")
    requests = []
    for i in range(num_prompts):
        prompt, max_tokens = rows[i % len(rows)]
        prompt_len = len(prompt) if isinstance(prompt, list) else max(1, len(prompt.split()))
        requests.append(SampleRequest(prompt, prompt_len, max_tokens or default_max_tokens))
    return requests


def _parse_row(line: str, path: Path, lineno: int) -> tuple[str | list[int], int | None]:
    try:
        row = json.loads(line)
        prompt = row["prompt"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}:{lineno}: expected a JSON object with 'prompt' ({exc})") from None
    valid_prompt = isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))
    max_tokens = row.get("max_tokens")
    if not valid_prompt or not (max_tokens is None or (isinstance(max_tokens, int) and max_tokens >= 1)):
        raise ValueError(f"{path}:{lineno}: 'prompt' must be text or a list of ints, 'max_tokens' an int >= 1")
    return prompt, max_tokens
