"""`python -m asyncengine`: continue a few prompts with the offline engine and print the text.

    python -m asyncengine                          # the embedded default model, its demo prompts
    python -m asyncengine --prompt "ROMEO:" --max-tokens 80 --temperature 0.8 --seed 1
    python -m asyncengine --model /path/to/llama --prompt "Hello"
"""

from __future__ import annotations

import argparse
import time

DEMO_PROMPTS = ["ROMEO:", "In the beginning", "To be, or not to be,"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m asyncengine", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local HF checkpoint folder (default: the embedded model)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few demo prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from asyncengine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed)
    prompts = args.prompt or DEMO_PROMPTS
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = 0
    for out in outputs:
        completion = out.outputs[0]
        tokens += len(completion.token_ids)
        print(f"--- {out.prompt!r}\n{out.prompt}{completion.text}\n")
    print(f"[{len(outputs)} prompts, {tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.0f} tokens/s on "
          f"{llm.engine.runner.device}, model {llm.engine.config.model}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
