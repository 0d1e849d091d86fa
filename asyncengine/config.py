"""EngineConfig: one flat dataclass for everything the engine needs, validated in __post_init__.

`EngineConfig.model` is a local Hugging Face-format folder (config.json, *.safetensors, tokenizer files). With no
model named, the engine runs the small default model shipped inside the package. The model's own settings are
read into a `ModelConfig` (architecture, shapes, rope, eos ids) by `load_model_config`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from asyncengine.quantization import QUANTIZATION_CHOICES, quantization_config_for

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


# --kv-cache-dtype, vLLM's spelling: auto = the model's dtype; fp8 and fp8_e4m3 = e4m3 with per-layer scales
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# Triton converts e4m3 in hardware from compute capability 8.9 (Ada, Hopper) on; older GPUs have no e4m3 type.
FP8_KV_MIN_CAPABILITY = (8, 9)

DEFAULT_MODEL_NAME = "asyncengine-default"  # the name the server gives the embedded model


def default_model_path() -> str:
    """The checkpoint shipped inside the package (used when no model is named)."""
    return str(Path(__file__).parent / "default_model")


@dataclass
class ModelConfig:
    """What the engine needs to know of a checkpoint, normalised across transformers versions."""

    path: str
    architecture: str
    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype  # the dtype the weights run in
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    # the weight format of the decoder's linear layers (asyncengine.quantization); None: unquantized
    quant_config: Any = None
    tensor_parallel_size: int = 1

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads in one rank's cache: its share, or one replicated head when there are fewer than ranks."""
        return max(1, self.num_kv_heads // self.tensor_parallel_size)

    def kv_bytes_per_token(self, kv_dtype: torch.dtype) -> int:
        """KV cache bytes one token takes on one rank (all of them with one rank)."""
        elem = torch.tensor([], dtype=kv_dtype).element_size()
        return 2 * self.num_layers * self.kv_heads_per_rank * self.head_dim * elem


@dataclass
class EngineConfig:
    model: Optional[str] = None  # local HF folder; None -> the embedded default model
    tokenizer: Optional[str] = None  # defaults to the model folder
    served_model_name: Optional[str] = None
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0
    block_size: int = 16
    # None: by device, like the benchmarks: 256 sequences and 8192 tokens per step on CUDA, 64 and 2048 on CPU
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None  # per-step token budget (chunked prefill splits longer prompts)
    max_model_len: Optional[int] = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_kv_blocks: Optional[int] = None  # default: sized from memory (GPU) or from kv_cache_memory_gb (CPU)
    kv_cache_memory_gb: float = 1.0  # CPU only: memory given to the KV cache
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # disable CUDA graphs
    # prepare and launch step N+1 before step N's tokens are read back (None: on CUDA only)
    async_scheduling: Optional[bool] = None
    max_queue_len: Optional[int] = None  # waiting requests beyond this are refused (server answers 429)
    # While decodes run and the batch is nearly full, admit waiting requests only once this many slots are free
    # (or the queue holds fewer), so admissions come in groups instead of one small prefill per step (the idea of
    # TGI's waiting_served_ratio). None: max_num_seqs // 16; 1: admit whenever a slot is free.
    min_prefill_batch: Optional[int] = None
    # Streamed outputs (DELTA, CUMULATIVE) of a request come every this many tokens (vLLM's stream_interval): its
    # first token and its end at once, the tokens between in groups. 1: every token. Larger values cut the host work
    # per token (IPC, SSE frames, a client's parsing) by that factor, for coarser streams.
    stream_interval: int = 1
    # AsyncLLMEngine only: run the engine (scheduler, model, detokenizer) in a process of its own, so that the
    # caller's event loop (HTTP framing of hundreds of streams) and the engine's steps use two cores, not one.
    # The process is spawned: a script that asks for it must guard its entry point (if __name__ == "__main__"),
    # and model families reach it through plugins' entry points (or the script's top level), not a runtime call.
    engine_process: bool = False
    # ranks the model's layers are split over (Megatron style): one GPU each on CUDA, one process each on CPU
    tensor_parallel_size: int = 1
    # weight format, vLLM's spelling (awq, gptq, fp8, compressed-tensors, int8; awq_marlin and gptq_marlin name
    # awq and gptq, run on our own kernels); None: the checkpoint's own
    # quantization_config. fp8 (and int8, on CPU: W8A8 with per-token activations) on an unquantized checkpoint
    # quantize it at load time.
    quantization: Optional[str] = None
    # who starts ranks 1..N-1: mp (processes of our own, on this host) | ray (Ray actors in a placement group)
    distributed_executor_backend: str = "mp"
    # seconds a collective may wait for the other ranks before the engine counts a rank as hung (and dies)
    distributed_timeout_s: float = 600.0
    # seconds a tensor-parallel step may go unfinished before the engine counts a rank as hung and dies (its
    # workers killed). 300 s, vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS: a step is at most max_num_batched_tokens
    # (about a second for a 70B model's largest prefill on GPUs), and the rest leaves room for a kernel compiled
    # mid-run. The first step gets distributed_timeout_s if that is longer (its kernels may still compile);
    # loading, profiling and CUDA-graph capture come before any step and are not timed by it.
    step_timeout_s: float = 300.0
    # auto: the checkpoint's safetensors | dummy: random weights drawn on each rank's device (config.json and a
    # tokenizer suffice; for benchmarks of shapes too large to write to disk, e.g. a 70B model over 8 GPUs)
    load_format: str = "auto"
    # generate | pooling (embeddings) | auto: pooling for encoders and sentence-transformers checkpoints
    runner: str = "auto"
    # KV cache storage (vLLM's spelling): auto = the model's dtype; fp8 / fp8_e4m3 = float8 e4m3 with one float32
    # scale per layer for K and one for V (the checkpoint's k_scale / v_scale, else 1.0): half the bytes of bf16,
    # so twice the blocks in the same memory; attention reads e4m3 directly (models.layers.PagedAttention).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = default_model_path()
            self.served_model_name = self.served_model_name or DEFAULT_MODEL_NAME
        self.model = str(self.model)
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        on_gpu = self.torch_device().type == "cuda"
        if self.max_num_seqs is None:
            self.max_num_seqs = 256 if on_gpu else 64
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if on_gpu else 2048
        self._check_positive("block_size", "max_num_seqs", "max_num_batched_tokens")
        if self.block_size & (self.block_size - 1) or not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")
        if self.min_prefill_batch is None:
            self.min_prefill_batch = max(1, self.max_num_seqs // 16)
        self._check_positive("min_prefill_batch", "stream_interval")
        if self.max_queue_len is not None and self.max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {self.max_queue_len}")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be one of auto, generate, pooling; got {self.runner!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}; "
                             f"got {self.quantization!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        self._check_kv_cache_dtype()
        self._check_tensor_parallel()

    def _check_kv_cache_dtype(self) -> None:
        """ValueError naming --kv-cache-dtype for an unknown value, and for fp8 where it cannot run (a GPU older
        than compute capability 8.9, a pooling runner, which keeps no KV cache between steps)."""
        flag = f"kv_cache_dtype (--kv-cache-dtype) {self.kv_cache_dtype!r}"
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"{flag} is not supported (supported: {', '.join(KV_CACHE_DTYPES)})")
        if not self.fp8_kv_cache:
            return
        if self.runner == "pooling":
            raise ValueError(f"{flag} needs the generate runner: a pooling runner keeps no KV cache between steps "
                             "(supported with runner pooling: auto)")
        device = self.torch_device()
        if device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            if capability < FP8_KV_MIN_CAPABILITY:
                raise ValueError(f"{flag} needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
                                 f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]} "
                                 "(supported here: auto)")

    @property
    def fp8_kv_cache(self) -> bool:
        """True when the KV cache is stored in e4m3 (--kv-cache-dtype fp8 or fp8_e4m3)."""
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's torch dtype: float8_e4m3fn for fp8, else the model's dtype."""
        return torch.float8_e4m3fn if self.fp8_kv_cache else model_dtype

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size (--tensor-parallel-size) must be a positive integer, got {tp!r}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError("distributed_executor_backend (--distributed-executor-backend) must be mp or ray, got "
                             f"{self.distributed_executor_backend!r}")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s (--step-timeout) must be positive, got {self.step_timeout_s}")
        device = self.torch_device()
        if tp > 1 and self.distributed_executor_backend == "mp" and device.type == "cuda":
            gpus = torch.cuda.device_count()
            if tp > gpus:
                raise ValueError(f"tensor_parallel_size (--tensor-parallel-size) is {tp} but this host has {gpus} "
                                 "GPU(s): one rank needs one GPU")
            if device.index not in (None, 0):
                raise ValueError(f"with --tensor-parallel-size > 1 rank r runs on cuda:r; device {self.device!r} "
                                 "cannot be chosen (use CUDA_VISIBLE_DEVICES)")

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def _resolve_dtype(requested: str, checkpoint_dtype: Optional[torch.dtype], device: torch.device) -> torch.dtype:
    """auto = the checkpoint's dtype on GPU; on CPU half-precision checkpoints run in float32 (faster, exact)."""
    if requested != "auto":
        return _DTYPES[requested]
    dtype = checkpoint_dtype or torch.float32
    if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def _checkpoint_dtype(hf_config: Any) -> Optional[torch.dtype]:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        return _DTYPES.get(dtype)
    return dtype if isinstance(dtype, torch.dtype) else None


def _eos_ids(folder: Path, hf_config: Any) -> list[int]:
    """EOS ids from generation_config.json (preferred, may be a list) or config.json."""
    eos: Any = None
    gen = folder / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def load_model_config(config: EngineConfig, device: torch.device) -> ModelConfig:
    """Read and check the checkpoint folder; raise ValueError naming what is missing or unsupported."""
    from transformers import AutoConfig

    from asyncengine.models import supported_architectures, unsupported_architecture_message
    from asyncengine.plugins import load_plugins

    load_plugins()  # out-of-tree model families register their architectures here
    folder = Path(config.model)
    if not folder.is_dir():
        raise ValueError(f"model {config.model!r} is not a local folder (no hub access: give a path to a checkpoint)")
    if not (folder / "config.json").exists():
        raise ValueError(f"model folder {folder} has no config.json: not a Hugging Face checkpoint")
    raw = json.loads((folder / "config.json").read_text())
    archs = raw.get("architectures") or []
    supported = [a for a in archs if a in supported_architectures()]
    if not supported:
        raise ValueError(f"model folder {folder}: {unsupported_architecture_message(archs)}")
    if config.load_format == "auto" and not any(folder.glob("*.safetensors")):
        raise ValueError(f"model folder {folder} has no *.safetensors weights")
    hf_config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    model_config = ModelConfig(
        path=str(folder),
        architecture=supported[0],
        hf_config=hf_config,
        dtype=_resolve_dtype(config.dtype, _checkpoint_dtype(hf_config), device),
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        max_position_embeddings=getattr(hf_config, "max_position_embeddings", 2048),
        eos_token_ids=_eos_ids(folder, hf_config),
        quant_config=quantization_config_for(raw.get("quantization_config"), config.quantization),
        tensor_parallel_size=config.tensor_parallel_size,
    )
    _check_heads_split(model_config)
    return model_config


def _check_heads_split(mc: ModelConfig) -> None:
    """ValueError naming --tensor-parallel-size when the model's heads (or MLP width) do not split over the ranks."""
    tp = mc.tensor_parallel_size
    if tp == 1:
        return
    flag = f"--tensor-parallel-size (tensor_parallel_size={tp})"
    if mc.num_heads % tp:
        raise ValueError(f"{flag} must divide the model's {mc.num_heads} attention heads")
    kv = mc.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"{flag} and the model's {kv} KV heads must divide one another (KV heads are split, or "
                         "replicated when fewer than the ranks)")
    inter = getattr(mc.hf_config, "intermediate_size", None)
    if inter is not None and inter % tp:
        raise ValueError(f"{flag} must divide the model's intermediate_size ({inter})")


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len ({config.max_model_len}) is larger than the model's max_position_embeddings ({limit})"
        )
    return config.max_model_len
