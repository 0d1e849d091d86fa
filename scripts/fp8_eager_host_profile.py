"""Where the host time of an eager (prefill) step goes, bf16 against FP8 (run 99; issue 14): on the 8B random
checkpoint, one prompt of `--tokens` tokens generating one token, repeated; `LLMEngine.launch` (in the device thread) under
cProfile. Prints the host ms of launch() per step and the functions with the most own time.

    python scripts/fp8_eager_host_profile.py [--quantization fp8] [--tokens 3800] [--separate-quant]

--separate-quant: every FP8 product quantizes its own input (the norms and silu_and_mul make no e4m3 copies), as
before the fused copies; for a before/after in one process kind.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from asyncengine import LLM, SamplingParams
from asyncengine.engine import LLMEngine
from loadtest.bench_offline import build_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--tokens", type=int, default=3800)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--separate-quant", action="store_true")
    args = parser.parse_args()
    if args.separate_quant:
        from asyncengine.models.layers import LinearBase

        LinearBase.takes_fp8_input = lambda self, m: False
    folder = build_checkpoint(Path("/tmp/llama3-8b-random"))
    llm = LLM(str(folder), quantization=args.quantization, max_model_len=8192, gpu_memory_utilization=0.85,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    profiler, launch_host = cProfile.Profile(), []
    original_launch = LLMEngine.launch

    def timed_launch(self, step):
        start = time.perf_counter()
        profiler.enable()
        try:
            return original_launch(self, step)
        finally:
            profiler.disable()
            launch_host.append(time.perf_counter() - start)

    for i in range(args.steps + 2):
        if i == 2:  # warm-up done: profile from here
            LLMEngine.launch = timed_launch  # on CUDA the step driver calls launch and collect, not run
        prompt = torch.randint(100, 100000, (args.tokens + i,)).tolist()  # a new length every step, as W1's
        llm.generate([prompt], params, use_tqdm=False)
    LLMEngine.launch = original_launch
    label = (args.quantization or "bf16") + (" (separate quantization)" if args.separate_quant else "")
    print(f"{label}: launch() {1e3 * sum(launch_host) / len(launch_host):.1f} ms host per step, "
          f"{len(launch_host)} steps")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
    print(out.getvalue())


if __name__ == "__main__":
    main()
