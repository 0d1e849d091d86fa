"""Shared fixtures: tiny random checkpoints (built once per session) and leak checks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Choices measured on this machine (asyncengine/measured_choices.py) go to a directory of this run's own, shared by
# every process it starts, not to the user's ~/.cache; the process that makes the run's directory removes it at
# exit (every test run left one behind in /tmp before).
from machine_share import pytest_runtest_protocol, run_dir  # noqa: E402, F401 (the `alone` marker's hook, used from here)

os.environ.setdefault("ASYNCENGINE_CACHE_DIR", str(run_dir() / "choices"))
# Without CUDA, Triton kernels run in its interpreter, which must be chosen before any module defines a kernel:
# set here, first, not in the kernel tests, so collection order (another module importing Triton) cannot matter.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checkpoints import ARCHITECTURES, build_checkpoint  # noqa: E402


# The README's test command runs the suite on two pytest-xdist workers, one test file at a time each
# (`-n 2 --dist loadfile`: a file's module fixtures, such as its server, start once), handed out in collection
# order (`--no-loadscope-reorder`; xdist would otherwise start the files with the most tests first and leave the
# long one-test files for the end, one worker busy and the other core idle). So the longest files (measured: 1-4
# minutes each on 2 cores) are collected first, and the `alone` tests (machine_share.py) last: an `alone` test
# holds its worker idle until the other worker's current test ends, and then the other's next test waits for it.
LONGEST_FILES = ("test_tensor_parallel.py", "test_server_engine_process.py",
                 "test_server_cli.py", "test_reliability_concurrency.py", "test_fused_kernels.py",
                 "test_reliability_fault.py", "test_webui_browser.py")


def pytest_collection_modifyitems(config, items):
    """LONGEST_FILES first (in that order), then every other file in its collected order, and the `alone` tests
    last. The sort is stable and deterministic, so every xdist worker collects the same order, as xdist requires."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}

    def order(item) -> tuple[bool, int]:
        return item.get_closest_marker("alone") is not None, rank.get(item.path.name, len(LONGEST_FILES))

    items.sort(key=order)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """checkpoint_dir(arch) -> folder of a tiny random checkpoint of that architecture (built once)."""
    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[str, Path] = {}

    def get(arch: str = "LlamaForCausalLM") -> Path:
        if arch not in built:
            built[arch] = build_checkpoint(root / arch, arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def llama_dir(checkpoint_dir) -> Path:
    return checkpoint_dir("LlamaForCausalLM")


THINK_TOKENS = ("<think>", "</think>")
THINK_IDS = (384, 385)  # their ids in think_dir's tokenizer (after build_tokenizer's 384 trained tokens)


@pytest.fixture(scope="session")
def think_dir(tmp_path_factory) -> Path:
    """The tiny random Llama with `<think>` and `</think>` as added tokens (THINK_IDS), as a reasoning model's
    tokenizer has them."""
    folder = build_checkpoint(tmp_path_factory.mktemp("think") / "model", added_tokens=THINK_TOKENS)
    added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    assert [t["id"] for t in added if t["content"] in THINK_TOKENS] == list(THINK_IDS)
    return folder


def assert_no_leaks(engine) -> None:
    """Every KV block free, nothing queued or running, no request state left behind."""
    assert not engine.scheduler.running, engine.scheduler.running
    assert not engine.scheduler.waiting, engine.scheduler.waiting
    assert not engine.output_processor.user_requests and not engine.output_processor.children
    assert not engine.awaiting_grammar, engine.awaiting_grammar
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks leaked"
    assert all(b.ref_count == 0 for b in bm.blocks)


# Float32 sums run in an order that follows the batch shape, the thread count and the CPU's vector width, so two
# runs that sample the same tokens can differ in a logprob's last digits (~1e-5 seen; issue #11 saw -1.9653 against
# -1.9654 after rounding). Tokens, texts and stops are compared exactly; logprobs within this absolute tolerance.
LOGPROB_ATOL = 1e-3


def completion_summary(output) -> list[tuple]:
    """One RequestOutput's samples: (index, text, token ids, finish reason, stop reason, [{token: logprob}] or None)."""
    return [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [{k: v.logprob for k, v in p.items()} for p in c.logprobs])
            for c in output.outputs]


def assert_same_completions(mine, theirs, atol: float = LOGPROB_ATOL) -> None:
    """Two RequestOutputs (or two lists of them) sampled the same: tokens, texts, finish and stop reasons equal,
    the same top-logprob token ids at every position, and logprob values within `atol`."""
    if isinstance(mine, list):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            assert_same_completions(a, b, atol)
        return
    for a, b in zip(completion_summary(mine), completion_summary(theirs), strict=True):
        assert a[:5] == b[:5]
        assert (a[5] is None) == (b[5] is None)
        for position, (x, y) in enumerate(zip(a[5] or [], b[5] or [], strict=True)):
            assert x.keys() == y.keys(), f"top-logprob ids differ at position {position}"
            assert all(abs(x[k] - y[k]) <= atol for k in x), f"position {position}: {x} vs {y}"


__all__ = ["ARCHITECTURES", "LOGPROB_ATOL", "THINK_IDS", "THINK_TOKENS", "assert_no_leaks", "assert_same_completions"]
