"""A tensor-parallel smoke run with timings per phase, for diagnosing a TP start-up or step on GPUs:
a tiny test checkpoint at TP=N (float32, CUDA graphs on), then TP=1, greedy tokens compared.
    python scripts/tp_smoke.py N [ARCH]
Run under scripts/gpu_run.sh tp-smoke, which dumps every process's Python stacks if it hangs."""

import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from checkpoints import build_checkpoint  # noqa: E402

from asyncengine import LLM, SamplingParams  # noqa: E402

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
tp, arch = int(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "LlamaForCausalLM")
folder = build_checkpoint(Path(tempfile.mkdtemp()) / arch, arch, lm_head_std=0.5)
prompts = ["The quick brown fox jumps over the lazy dog.", "Paged attention stores keys and values in blocks."]
greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
tokens = {}
for size in (tp, 1):
    t0 = time.perf_counter()
    llm = LLM(model=str(folder), tensor_parallel_size=size, dtype="float32", max_model_len=256,
              gpu_memory_utilization=0.3, seed=0)
    print(f"TP={size}: engine up in {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    tokens[size] = [o.outputs[0].token_ids for o in llm.generate(prompts * 4, greedy, use_tqdm=False)]
    print(f"TP={size}: generate {time.perf_counter() - t0:.2f} s", flush=True)
    llm.close()
print("TP smoke: tokens equal" if tokens[tp] == tokens[1] else f"TP smoke: TOKENS DIFFER {tokens}", flush=True)
