"""How a pooling model turns final hidden states into one embedding per sequence, read from the checkpoint.

A sentence-transformers checkpoint says it itself: `modules.json` lists its modules (Transformer, then Pooling
with its `1_Pooling/config.json`, then optionally Normalize), and `sentence_bert_config.json` its maximum
sequence length. Both layouts are read: before v6 (modules named `sentence_transformers.models.Pooling`, pooling
as `pooling_mode_*_token` flags) and from v6 on (`sentence_transformers.sentence_transformer.modules.pooling.Pooling`,
`"pooling_mode": "mean"`, the length as the tokenizer's `model_max_length`). A checkpoint without these files gets vLLM's defaults: CLS pooling for encoders, last-token
pooling for decoders, normalised. Modules that change the vectors in other ways (Dense, ...) are refused with a
ValueError rather than skipped, since skipping them would give wrong embeddings silently.

A cross-encoder (BertForSequenceClassification) pools its [CLS] state into its classifier, whose logit goes through
the activation sentence-transformers' CrossEncoder applies in `predict`: the `activation_fn` its
config_sentence_transformers.json or config.json (`sentence_transformers.activation_fn`) names, else sigmoid
(one label). An activation we do not know is a ValueError naming the file.

Models that were trained for truncated embeddings (Matryoshka) say so in config.json (`is_matryoshka`, or a list
of `matryoshka_dimensions`); only they accept a request's `dimensions`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
import torch.nn.functional as F

PoolingMode = Literal["mean", "cls", "last"]
ScoreActivation = Literal["sigmoid", "identity"]
RunnerKind = Literal["generate", "pooling"]
RUNNERS = ("auto", "generate", "pooling")

# 1_Pooling/config.json flag -> our mode; the other sentence-transformers modes are refused.
_MODE_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
_UNSUPPORTED_FLAGS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")
# v6's "pooling_mode" values -> ours
_MODE_NAMES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"  # modules.json types end with these


@dataclass(frozen=True)
class PoolerConfig:
    mode: PoolingMode
    normalize: bool  # L2-normalise the pooled vector (the Normalize module)
    matryoshka: bool = False  # requests may ask for fewer dimensions
    matryoshka_dimensions: Optional[tuple[int, ...]] = None  # the only dimensions allowed, when listed
    max_seq_length: Optional[int] = None  # sentence_bert_config.json: longer inputs are refused or truncated
    score_activation: Optional[ScoreActivation] = None  # set for cross-encoders only: they score, not embed

    @property
    def scores(self) -> bool:
        """A cross-encoder's pooler: one score per text pair instead of an embedding."""
        return self.score_activation is not None


def has_sentence_transformers_config(folder: Path) -> bool:
    return (Path(folder) / "modules.json").exists()


def choose_runner(requested: str, folder: Path, is_encoder: bool) -> RunnerKind:
    """The runner a checkpoint gets: `requested` unless "auto"; auto is pooling for encoders and for
    sentence-transformers checkpoints (e.g. a decoder such as Qwen3-Embedding), else generate."""
    if requested not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {requested!r}")
    if requested == "generate" and is_encoder:
        raise ValueError("runner 'generate' needs a decoder model; this checkpoint is an encoder (use 'pooling')")
    if requested != "auto":
        return requested  # type: ignore[return-value]
    return "pooling" if is_encoder or has_sentence_transformers_config(folder) else "generate"


def load_pooler_config(folder: Path, is_encoder: bool, hf_config) -> PoolerConfig:
    """The checkpoint's pooling (see the module docstring); ValueError naming the file for what we cannot do."""
    folder = Path(folder)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or dims)
    dims_tuple = tuple(int(d) for d in dims) if dims else None
    if not has_sentence_transformers_config(folder):
        return PoolerConfig("cls" if is_encoder else "last", True, matryoshka, dims_tuple)
    modules = json.loads((folder / "modules.json").read_text())
    mode: Optional[PoolingMode] = None
    normalize = False
    for module in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = _module_class(module.get("type"))
        if kind == _TRANSFORMER:
            continue
        if kind == _POOLING:
            mode = _pooling_mode(folder / module.get("path", "") / "config.json")
        elif kind == _NORMALIZE:
            normalize = True
        else:
            raise ValueError(f"{folder / 'modules.json'}: module {module.get('type')!r} is not supported "
                             f"(supported: Transformer, Pooling, Normalize)")
    if mode is None:
        raise ValueError(f"{folder / 'modules.json'} has no Pooling module")
    return PoolerConfig(mode, normalize, matryoshka, dims_tuple, _max_seq_length(folder))


# sentence-transformers' dotted names of the activations it saves -> ours
_SCORE_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity", "torch.nn.Identity": "identity",
}


def load_cross_encoder_pooler(folder: Path, hf_config) -> PoolerConfig:
    """A cross-encoder's pooling: its [CLS] state, unnormalised, scored with the activation its files name (see
    the module docstring)."""
    return PoolerConfig("cls", False, score_activation=_score_activation(Path(folder), hf_config))


def _score_activation(folder: Path, hf_config) -> ScoreActivation:
    """sentence-transformers' order: config_sentence_transformers.json, config.json's sentence_transformers entry,
    its older sbert_ce_default_activation_function, else sigmoid (one label)."""
    st_path = folder / "config_sentence_transformers.json"
    candidates = [(st_path, json.loads(st_path.read_text()).get("activation_fn") if st_path.exists() else None),
                  (folder / "config.json", (getattr(hf_config, "sentence_transformers", None) or {}).get(
                      "activation_fn")),
                  (folder / "config.json", getattr(hf_config, "sbert_ce_default_activation_function", None))]
    for path, name in candidates:
        if name is None:
            continue
        if name not in _SCORE_ACTIVATIONS:
            raise ValueError(f"{path}: activation_fn {name!r} is not supported "
                             f"(supported: {sorted(set(_SCORE_ACTIVATIONS))})")
        return _SCORE_ACTIVATIONS[name]  # type: ignore[return-value]
    return "sigmoid"


def apply_score_activation(logits: torch.Tensor, activation: ScoreActivation) -> torch.Tensor:
    """[B, 1] logits -> [B] scores, float32."""
    scores = logits.float()[:, 0]
    return torch.sigmoid(scores) if activation == "sigmoid" else scores


def _module_class(dotted: Optional[str]) -> Optional[str]:
    """The class name a sentence-transformers module type ends with, if it is one of its own modules."""
    if not isinstance(dotted, str) or not dotted.startswith("sentence_transformers."):
        return dotted
    return dotted.rsplit(".", 1)[-1]


def _pooling_mode(path: Path) -> PoolingMode:
    if not path.exists():
        raise ValueError(f"{path} is missing (named by modules.json)")
    cfg = json.loads(path.read_text())
    if cfg.get("include_prompt", True) is False:
        raise ValueError(f"{path}: include_prompt false is not supported")
    if "pooling_mode" in cfg:  # sentence-transformers v6: one name (a list would combine several modes)
        mode = cfg["pooling_mode"]
        if not isinstance(mode, str) or mode not in _MODE_NAMES:
            raise ValueError(f"{path}: pooling_mode {mode!r} is not supported (supported: "
                             f"{', '.join(_MODE_NAMES)})")
        return _MODE_NAMES[mode]  # type: ignore[return-value]
    chosen = [mode for flag, mode in _MODE_FLAGS.items() if cfg.get(flag)]
    others = [flag for flag in _UNSUPPORTED_FLAGS if cfg.get(flag)]
    if others or len(chosen) != 1:
        raise ValueError(f"{path}: exactly one of mean, CLS or last-token pooling is supported; "
                         f"the file asks for {chosen + others or 'none'}")
    return chosen[0]


def _max_seq_length(folder: Path) -> Optional[int]:
    """sentence_bert_config.json's max_seq_length; else (v6 writes none there) the tokenizer's model_max_length,
    which sentence-transformers then truncates to (a tokenizer's "no limit" sentinel, ~1e30, is no limit)."""
    path = folder / "sentence_bert_config.json"
    value = json.loads(path.read_text()).get("max_seq_length") if path.exists() else None
    if value:
        return int(value)
    path = folder / "tokenizer_config.json"
    value = json.loads(path.read_text()).get("model_max_length") if path.exists() else None
    return int(value) if isinstance(value, (int, float)) and 0 < value < 1_000_000 else None


def pool(hidden: torch.Tensor, query_start_loc: torch.Tensor, config: PoolerConfig) -> torch.Tensor:
    """hidden: [T, hidden] final hidden states of B whole sequences laid end to end; query_start_loc: [B + 1] on
    hidden's device -> [B, hidden] float32, L2-normalised when the config says so."""
    starts, ends = query_start_loc[:-1].long(), query_start_loc[1:].long()
    if config.mode == "cls":
        pooled = hidden[starts].float()
    elif config.mode == "last":
        pooled = hidden[ends - 1].float()
    else:  # mean over each sequence's tokens, summed in float32
        lens = ends - starts
        # output_size (T, known on the host): without it repeat_interleave reads lens back, a host sync per pass
        seq_of_token = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens,
                                               output_size=hidden.shape[0])  # [T]
        sums = torch.zeros(len(lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, seq_of_token, hidden.float())
        pooled = sums / lens[:, None].float()
    return F.normalize(pooled, p=2, dim=-1) if config.normalize else pooled
