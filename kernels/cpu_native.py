"""Native CPU kernels (`cpu_native.c`), built on this machine with its C compiler and called through ctypes.

Why: the default model's decode attention on CPU is bound by memory latency and the per-call overhead of tiny
matrix products; torch's SDPA ran it at ~9 GB/s of the machine's ~30 and needed each decode row's K/V copied
contiguous first (`cpu.DecodeKVMirror`). The C loop reads the paged cache in place (see the .c file's header).

Build: at first use, `$CC` (else `cc`) compiles the source with -O3 -march=native -fopenmp into
`<cache_dir>/cpu_native/cpu_native-<digest>.so` (about 0.3 s), where the digest covers the source, the flags, the
compiler's version, this CPU's model and feature flags, and torch's version; later processes load that file. The
library is loaded after torch, so its OpenMP regions link against the libgomp torch already loaded (one thread
pool, not two runtimes competing for the cores). Where no compiler works, `library()` is None, a warning says
once why and what runs instead (torch's SDPA with the decode mirror, measured 1.06-1.16x slower end to end), and
everything still runs. `ASYNCENGINE_CPU_NATIVE=0` turns the native kernels off (A/B runs, tests of the torch path).

Nothing here imports the engine.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from asyncengine.kernels.cache_dir import cache_dir

logger = logging.getLogger(__name__)

ENV_SWITCH = "ASYNCENGINE_CPU_NATIVE"
ENABLED = os.environ.get(ENV_SWITCH, "1") != "0"  # read once; tests monkeypatch it
SOURCE = Path(__file__).with_name("cpu_native.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c11"]
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # as in cpu_native.c


def available() -> bool:
    """The native kernels are switched on and built (building them on first call)."""
    return ENABLED and library() is not None


@functools.cache
def library() -> Optional[ctypes.CDLL]:
    """The loaded library, built first if this machine has none cached; None (warned once) when it cannot be."""
    try:
        lib = ctypes.CDLL(str(_built_library()))
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        logger.warning("the native CPU kernels could not be built (%s); decode attention runs on torch's SDPA with "
                       "a per-layer copy of the decode rows' K/V instead (correct, measured 1.06-1.16x slower "
                       "end to end on the default model). Install a C compiler (gcc) or set CC.", error)
        return None
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.ae_decode_attention_f32.argtypes = [p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, i64, f32, i32,
                                            f32, i32]
    lib.ae_decode_attention_f32.restype = i32
    lib.ae_rms_norm_f32.argtypes = [p, i64, p, p, p, i64, i32, f32, i32]
    lib.ae_rms_norm_f32.restype = None
    lib.ae_silu_and_mul_f32.argtypes = [p, i64, p, i64, i32, i32]
    lib.ae_silu_and_mul_f32.restype = None
    lib.ae_write_kv_f32.argtypes = [p, i64, p, i64, p, p, p, i64, i32, i32, i64]
    lib.ae_write_kv_f32.restype = i32
    lib.ae_argmax_rows_f32.argtypes = [p, i64, i64, i64, p, i32]
    lib.ae_argmax_rows_f32.restype = None
    lib.ae_rotary_neox_f32.argtypes = [p, i64, i64, i32, i32, p, p, i64]
    lib.ae_rotary_neox_f32.restype = i32


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler found (cc, gcc, or $CC)")
    return compiler


def _fingerprint(compiler: str) -> str:
    """What the built file depends on besides the source: compiler, flags, CPU features, torch (its libgomp)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    cpu = {"machine": platform.machine()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:  # the first processor's model and feature flags (what -march=native reads)
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "flags"):
                    cpu.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return "\n".join([version, " ".join(FLAGS), repr(sorted(cpu.items())), torch.__version__])


def _built_library() -> Path:
    """The cached library for this source and machine, compiled now if missing (into the cache directory, or a
    temporary one where that cannot be written)."""
    compiler = _compiler()
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + _fingerprint(compiler).encode()).hexdigest()[:16]
    target = cache_dir() / "cpu_native" / f"cpu_native-{digest}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        build_dir = target.parent
    except OSError as error:
        build_dir = Path(tempfile.mkdtemp(prefix="asyncengine-native-"))
        target = build_dir / target.name
        logger.warning("cannot write %s (%s): building the native CPU kernels in %s for this process only",
                       target.parent, error, build_dir)
    started = time.perf_counter()
    fd, partial = tempfile.mkstemp(dir=build_dir, prefix=".cpu_native-", suffix=".so")
    os.close(fd)
    try:
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", partial, "-lm"], capture_output=True,
                                text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(partial, target)  # atomic: a concurrent process loads either no file or a whole one
    finally:
        Path(partial).unlink(missing_ok=True)
    logger.info("built the native CPU kernels in %.1f s: %s", time.perf_counter() - started, target)
    return target


# -- decode attention ------------------------------------------------------------------------------------------------
def decode_attention_supported(q: torch.Tensor, k_storage: Optional[torch.Tensor]) -> bool:
    """Whether `decode_attention` takes this call: float32 queries [B, H, D] and a float32 heads-major cache
    storage [KVH, NB, BS, D] (None: the plain layout, not supported), a group of at most MAX_GROUP query heads
    per kv head and D <= MAX_HEAD_DIM, and the library available."""
    if k_storage is None or q.dtype != torch.float32 or k_storage.dtype != torch.float32 or q.dim() != 3:
        return False
    kv_heads, head_dim = k_storage.shape[0], k_storage.shape[-1]
    heads = q.shape[1]
    return (q.shape[2] == head_dim <= MAX_HEAD_DIM and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP
            and available())


def decode_attention(q: torch.Tensor, k_storage: torch.Tensor, v_storage: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, scale: float, sliding_window: Optional[int] = None,
                     softcap: Optional[float] = None) -> torch.Tensor:
    """One query per sequence, read against its blocks in place. q: [B, H, D] float32 (rows may be strided, each
    row's heads contiguous); k_storage, v_storage: [KVH, NB, BS, D] contiguous float32; tables: [B, W] int32
    contiguous; lens: [B] int32, the keys each row sees (its query at lens - 1). Returns [B, H, D]. The result
    of a row depends only on that row's inputs (not on the batch around it)."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    for name, t, dtype in (("tables", tables, torch.int32), ("lens", lens, torch.int32),
                           ("k_storage", k_storage, torch.float32), ("v_storage", v_storage, torch.float32)):
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} tensor, got {t.dtype} with strides {t.stride()}")
    if k_storage.shape != v_storage.shape or tables.shape[0] != q.shape[0] or lens.shape != (q.shape[0],):
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, caches {tuple(k_storage.shape)} / "
                         f"{tuple(v_storage.shape)}, tables {tuple(tables.shape)}, lens {tuple(lens.shape)}")
    batch, heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, _ = k_storage.shape
    out = torch.empty(batch, heads, head_dim)
    status = library().ae_decode_attention_f32(
        q.data_ptr(), q.stride(0), k_storage.data_ptr(), v_storage.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), out.data_ptr(), batch, heads, kv_heads, head_dim, block_size, num_blocks, scale,
        sliding_window or 0, softcap or 0.0, torch.get_num_threads())
    if status == -2:
        raise MemoryError("the native decode attention could not allocate its scratch buffer")
    if status != 0:
        raise ValueError(f"the native decode attention refused the shapes: q {tuple(q.shape)}, caches "
                         f"{tuple(k_storage.shape)}")
    return out


# -- element-wise ----------------------------------------------------------------------------------------------------
def takes_rows(x: torch.Tensor) -> bool:
    """Whether the element-wise kernels take x: float32 [T, N] with contiguous rows (any row stride), and the
    library available."""
    return x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x: [T, H] float32 (takes_rows); weight: [H] float32 contiguous. Returns rms_norm(x) * weight as a new [T, H];
    with residual ([T, H] contiguous float32), first adds x into it in place and normalizes the sum."""
    tokens, hidden = x.shape
    if weight.dtype != torch.float32 or not weight.is_contiguous() or weight.shape != (hidden,):
        raise ValueError(f"weight must be a contiguous float32 [{hidden}], got {weight.dtype} {tuple(weight.shape)}")
    if residual is not None and (residual.dtype != torch.float32 or not residual.is_contiguous()
                                 or residual.shape != x.shape):
        raise ValueError(f"residual must be a contiguous float32 {tuple(x.shape)}, got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    out = torch.empty(tokens, hidden)
    library().ae_rms_norm_f32(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                              weight.data_ptr(), out.data_ptr(), tokens, hidden, eps, torch.get_num_threads())
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] float32 (takes_rows) -> silu(gate) * up, a new [T, I]."""
    tokens, width = x.shape
    if width % 2:
        raise ValueError(f"silu_and_mul needs an even width, got {width}")
    out = torch.empty(tokens, width // 2)
    library().ae_silu_and_mul_f32(x.data_ptr(), x.stride(0), out.data_ptr(), tokens, width // 2,
                                  torch.get_num_threads())
    return out


def write_kv(key: torch.Tensor, value: torch.Tensor, k_storage: torch.Tensor, v_storage: torch.Tensor,
             slots: torch.Tensor) -> None:
    """key, value: [T, KVH, D] float32 (rows may be strided, each row's heads contiguous) into k_storage,
    v_storage ([KVH, num_slots, D] contiguous float32: a heads-major cache's storage seen by slot) at slots [T]
    (int64; one outside [0, num_slots) raises ValueError before anything is written)."""
    tokens, kv_heads, head_dim = key.shape
    for name, t in (("key", key), ("value", value)):
        if t.dtype != torch.float32 or t.shape != (tokens, kv_heads, head_dim) or t.stride(2) != 1 \
                or t.stride(1) != head_dim:
            raise ValueError(f"{name} must be float32 [{tokens}, {kv_heads}, {head_dim}] with contiguous heads")
    num_slots = k_storage.shape[1]
    if (k_storage.shape != (kv_heads, num_slots, head_dim) or v_storage.shape != k_storage.shape
            or not (k_storage.is_contiguous() and v_storage.is_contiguous())):
        raise ValueError(f"the caches' storage must be contiguous [{kv_heads}, slots, {head_dim}], got "
                         f"{tuple(k_storage.shape)} / {tuple(v_storage.shape)}")
    if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape != (tokens,):
        raise ValueError(f"slots must be a contiguous int64 [{tokens}]")
    status = library().ae_write_kv_f32(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                       k_storage.data_ptr(), v_storage.data_ptr(), slots.data_ptr(), tokens, kv_heads,
                                       head_dim, num_slots)
    if status != 0:
        raise ValueError(f"slots must lie in [0, {num_slots}) (nothing was written)")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of float32 [S, V] rows (takes_rows), the same index (the first maximum; NaN counts as
    largest): two passes over each row instead of torch's one strided-index pass (308 us at 64 x 8192 here)."""
    rows, vocab = x.shape
    if vocab == 0:
        raise ValueError("argmax of an empty row")
    out = torch.empty(rows, dtype=torch.int64)
    library().ae_argmax_rows_f32(x.data_ptr(), x.stride(0), rows, vocab, out.data_ptr(), torch.get_num_threads())
    return out


def rotary_supported(x: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor, head_dim: int) -> bool:
    """Whether `rotary_neox` takes x: float32 [T, heads * head_dim] rows (takes_rows), a contiguous float32
    [P, head_dim] cache, int64 positions, an even head_dim."""
    return (takes_rows(x) and x.shape[1] % head_dim == 0 and head_dim % 2 == 0
            and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
            and cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim
            and positions.dtype == torch.int64 and positions.is_contiguous() and positions.shape == (x.shape[0],))


def rotary_neox(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int) -> None:
    """Neox-style rotary embedding in place on x [T, heads * head_dim] (rotary_supported): each head's halves
    rotated by the [cos | sin] row of its token's position. A position outside the cache raises ValueError with x
    unchanged."""
    status = library().ae_rotary_neox_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1] // head_dim, head_dim,
                                          positions.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[0])
    if status != 0:
        raise ValueError(f"rotary positions must lie in [0, {cos_sin_cache.shape[0]})")
