"""Shared fixtures: tiny random checkpoints (built once per session) and leak checks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without CUDA, Triton kernels run in its interpreter, which must be chosen before any module defines a kernel:
# set here, first, not in the kernel tests, so collection order (another module importing Triton) cannot matter.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checkpoints import ARCHITECTURES, build_checkpoint  # noqa: E402


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


def assert_no_leaks(engine) -> None:
    """Every KV block free, nothing queued or running, no request state left behind."""
    assert not engine.scheduler.running, engine.scheduler.running
    assert not engine.scheduler.waiting, engine.scheduler.waiting
    assert not engine.user_requests and not engine.children
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks leaked"
    assert all(b.ref_count == 0 for b in bm.blocks)


__all__ = ["ARCHITECTURES", "assert_no_leaks"]
