#!/usr/bin/env python3
"""Train the embedded default model (a small LlamaForCausalLM) on the prepared corpus.

Input: the folder written by ``scripts/build_corpus.py`` (``train.bin``, ``val.bin``:
uint16 token ids; ``tokenizer/``: tokenizer.json + tokenizer_config.json). Needs
torch and transformers only, no network.

The loop is plain PyTorch: AdamW, linear warm-up then cosine decay, bf16 autocast,
random contiguous windows of the token stream. The schedule ends at whichever comes
first, ``--epochs`` passes over the training tokens or ``--minutes`` of training,
and the learning rate follows the fraction of that budget already spent. Validation
loss is measured every ``--eval-every`` steps over the whole validation split; the
weights with the lowest validation loss are the ones saved (the corpus is small, so
a long run can overfit). The output folder holds a standard Hugging Face
checkpoint (config.json, generation_config.json, model.safetensors in bf16), the
tokenizer files, ``metrics.json`` and ``TRAINING.md``.

``--pick-best RUNS_DIR`` does no training: it copies the run of RUNS_DIR with the
lowest validation loss to ``--out``, adds the table of all runs to its TRAINING.md
and gathers their logs (``RUNS_DIR/<name>.log``) into ``--out/../train.log``.

Example (one GPU)::

    python3 scripts/train_default_model.py --data .corpus --out /tmp/model --minutes 6
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
EOT_TOKEN = "<|eot_id|>"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=Path(".corpus"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=6.0, help="training time limit")
    p.add_argument("--epochs", type=float, default=24.0, help="token budget in passes over train.bin")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--dropout", type=float, default=0.3, help="on embeddings and sublayer outputs")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=704)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pick-best", type=Path, default=None, metavar="RUNS_DIR")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data

def load_tokens(path: Path, device: torch.device) -> torch.Tensor:
    """A uint16 token file as an int64 tensor on the device (the corpus is small)."""
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64)).to(device)


def random_batch(tokens: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    """Inputs and next-token targets of `batch` random windows of the token stream."""
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), device=tokens.device, generator=gen)
    index = starts[:, None] + torch.arange(seq_len + 1, device=tokens.device)
    window = tokens[index]
    return window[:, :-1], window[:, 1:]


# ---------------------------------------------------------------------------- model

def read_special_ids(tokenizer_dir: Path) -> dict[str, int]:
    """Ids of the bos/eos/pad and end-of-turn tokens, read from tokenizer.json."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    return {
        "bos": ids[cfg["bos_token"]], "eos": ids[cfg["eos_token"]],
        "pad": ids[cfg["pad_token"]], "eot": ids[EOT_TOKEN],
        "vocab": len(tok["model"]["vocab"]),
    }


def build_model(args: argparse.Namespace, special: dict[str, int]) -> LlamaForCausalLM:
    """A freshly initialized Llama with GQA, head_dim 64 and tied embeddings."""
    config = LlamaConfig(
        vocab_size=special["vocab"],
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        max_position_embeddings=args.max_positions,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=special["bos"],
        eos_token_id=special["eos"],
        pad_token_id=special["pad"],
    )
    return LlamaForCausalLM(config)


def add_dropout(model: LlamaForCausalLM, p: float) -> None:
    """Dropout on the embeddings and on each attention/MLP output (training only).

    Done with forward hooks so that the saved checkpoint stays a plain Llama.
    """
    if p <= 0:
        return

    def hook(module, inputs, output):
        return F.dropout(output, p, module.training)

    model.model.embed_tokens.register_forward_hook(hook)
    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(hook)
        layer.mlp.down_proj.register_forward_hook(hook)


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def learning_rate(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warm-up over steps, then cosine decay over the fraction of budget spent."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cosine)


def lm_loss(model: LlamaForCausalLM, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy under bf16 autocast."""
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
        logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, tokens: torch.Tensor, seq_len: int, batch: int) -> float:
    """Loss over the whole validation stream, cut into non-overlapping windows."""
    model.eval()
    n = (len(tokens) - 1) // seq_len
    x_all = tokens[: n * seq_len].view(n, seq_len)
    y_all = tokens[1: n * seq_len + 1].view(n, seq_len)
    total = 0.0
    for i in range(0, n, batch):
        total += lm_loss(model, x_all[i:i + batch], y_all[i:i + batch]).item() * len(x_all[i:i + batch])
    model.train()
    return total / n


# ------------------------------------------------------------------------- training

def train(args: argparse.Namespace) -> tuple[LlamaForCausalLM, dict]:
    """Run the training loop; return the model, holding its best weights, and the metrics."""
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    special = read_special_ids(args.data / "tokenizer")
    train_tokens = load_tokens(args.data / "train.bin", device)
    val_tokens = load_tokens(args.data / "val.bin", device)
    model = build_model(args, special).to(device)
    add_dropout(model, args.dropout)
    optimizer = make_optimizer(model, args)
    gen = torch.Generator(device=device).manual_seed(args.seed)

    n_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = args.batch_size * args.seq_len
    target_tokens = args.epochs * len(train_tokens)
    print(f"device {device} ({gpu_name(device)}); params {n_params:,}; "
          f"train tokens {len(train_tokens):,}; val tokens {len(val_tokens):,}", flush=True)

    best = {"val_loss": float("inf"), "step": 0, "state": None}
    step, start, progress = 0, time.time(), 0.0
    model.train()
    while progress < 1.0:
        elapsed = time.time() - start
        progress = max(step * tokens_per_step / target_tokens, elapsed / (60 * args.minutes))
        lr = learning_rate(step, progress, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = random_batch(train_tokens, args.batch_size, args.seq_len, gen)
        loss = lm_loss(model, x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % args.eval_every == 0 or progress >= 1.0:
            val = evaluate(model, val_tokens, args.seq_len, args.batch_size)
            keep_if_best(model, best, val, step)
            print(f"step {step:6d}  epoch {step * tokens_per_step / len(train_tokens):6.2f}  "
                  f"lr {lr:.2e}  train {loss.item():.4f}  val {val:.4f}  "
                  f"{time.time() - start:6.1f}s", flush=True)

    wall = time.time() - start
    model.load_state_dict(best["state"])
    final_val = evaluate(model, val_tokens, args.seq_len, args.batch_size)
    return model, {
        "val_loss": final_val, "best_step": best["step"], "steps": step,
        "tokens_seen": step * tokens_per_step, "epochs_seen": step * tokens_per_step / len(train_tokens),
        "wall_s": wall, "params": n_params, "gpu": gpu_name(device), "special": special,
        "train_tokens": len(train_tokens), "val_tokens": len(val_tokens),
    }


def keep_if_best(model: torch.nn.Module, best: dict, val: float, step: int) -> None:
    """Keep a copy of the weights when the validation loss is the lowest so far."""
    if val < best["val_loss"]:
        best.update(val_loss=val, step=step,
                    state={k: v.detach().clone() for k, v in model.state_dict().items()})


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


# --------------------------------------------------------------------------- saving

def save_checkpoint(model: LlamaForCausalLM, metrics: dict, args: argparse.Namespace) -> None:
    """Write the bf16 checkpoint, the tokenizer files, metrics.json and TRAINING.md."""
    special = metrics["special"]
    args.out.mkdir(parents=True, exist_ok=True)
    model = model.to(device="cpu", dtype=torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=special["bos"], eos_token_id=[special["eos"], special["eot"]],
        pad_token_id=special["pad"],
    )
    model.save_pretrained(args.out)
    add_legacy_config_keys(args.out / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copy(args.data / "tokenizer" / name, args.out / name)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (args.out / "TRAINING.md").write_text(training_report(model, metrics, args))


def add_legacy_config_keys(path: Path) -> None:
    """Also write rope_theta and torch_dtype at the top level, as older readers expect."""
    config = json.loads(path.read_text())
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    config["torch_dtype"] = "bfloat16"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def training_report(model: LlamaForCausalLM, metrics: dict, args: argparse.Namespace) -> str:
    """TRAINING.md: what was trained, how, and how well."""
    c = model.config
    command = "python3 scripts/train_default_model.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    return f"""# Training of the default model

| | |
| --- | --- |
| architecture | LlamaForCausalLM, {c.num_hidden_layers} layers, hidden {c.hidden_size}, MLP {c.intermediate_size}, {c.num_attention_heads} heads / {c.num_key_value_heads} kv heads of {c.head_dim}, tied embeddings, vocab {c.vocab_size} |
| parameters | {metrics['params']:,} |
| validation loss (best, saved) | {metrics['val_loss']:.4f} (perplexity {math.exp(metrics['val_loss']):.1f}) at step {metrics['best_step']} |
| steps | {metrics['steps']} of {args.batch_size} x {args.seq_len} tokens |
| tokens seen | {metrics['tokens_seen']:,} ({metrics['epochs_seen']:.1f} passes over {metrics['train_tokens']:,} training tokens) |
| validation tokens | {metrics['val_tokens']:,} |
| wall time of the loop | {metrics['wall_s']:.0f} s |
| GPU | {metrics['gpu']} |
| torch / transformers | {torch.__version__} / {__import__('transformers').__version__} |
| optimizer | AdamW (0.9, 0.95), lr {args.lr}, warm-up {args.warmup_steps} steps, cosine to {args.min_lr_ratio:g}x, weight decay {args.weight_decay}, dropout {args.dropout}, grad clip 1.0, bf16 autocast |
| budget | {args.epochs:g} epochs or {args.minutes:g} minutes, whichever ends first |

Command:

    {command}
"""


# ---------------------------------------------------------------------- pick the best

def pick_best(runs_dir: Path, out: Path) -> None:
    """Copy the run with the lowest validation loss to `out` and gather the logs."""
    runs = []
    for metrics_file in sorted(runs_dir.glob("*/metrics.json")):
        runs.append((json.loads(metrics_file.read_text())["val_loss"], metrics_file.parent))
    if not runs:
        raise SystemExit(f"no finished runs under {runs_dir}")
    best_loss, best_dir = min(runs)
    shutil.copytree(best_dir, out, dirs_exist_ok=True)
    (out / "metrics.json").unlink()
    rows = "\n".join(f"| {d.name} | {loss:.4f} | {tail_command(d)} |" for loss, d in runs)
    with open(out / "TRAINING.md", "a") as report:
        report.write(f"\nChosen as the lowest validation loss of the {len(runs)} runs found under "
                     f"{runs_dir}:\n\n| run | val loss | options |\n| --- | --- | --- |\n{rows}\n")
    logs = [f"===== {log.stem}\n{log.read_text()}" for log in sorted(runs_dir.glob("*.log"))]
    (out.parent / "train.log").write_text("\n".join(logs))
    print(f"best run {best_dir.name}: val loss {best_loss:.4f} -> {out}")


def tail_command(run_dir: Path) -> str:
    """The options of a run, read back from its TRAINING.md."""
    text = (run_dir / "TRAINING.md").read_text()
    return text.rsplit("train_default_model.py", 1)[-1].strip()


def main() -> None:
    args = parse_args()
    if args.pick_best is not None:
        pick_best(args.pick_best, args.out)
        return
    model, metrics = train(args)
    print(json.dumps({k: v for k, v in metrics.items() if k != "special"}, indent=2), flush=True)
    save_checkpoint(model, metrics, args)
    print(f"saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
