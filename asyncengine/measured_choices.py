"""Choices the engine times on the machine it runs on, kept on disk so that every process there agrees.

Some fast paths are picked by timing them at start-up: on CPU oneDNN's packed product or MKL's per weight shape
(quantization/cpu_prepacked.py, table "cpu_gemm"); on CUDA up to which batch size our decode GEMV and our FP8 GEMM
beat the library's per linear shape (ops.decode_gemv_max_m / fp8_gemm_max_m, table "cuda_linear", keyed by the GPU
model and a fingerprint of the kernels timed). Timed in every process, two processes on one machine could choose
differently on a close call (the served engine process and an offline run, two ranks, two test processes) and then
sum in different orders; each start would also pay the timing again (seconds on a GPU). So a choice is measured
once per machine and recorded in a JSON file; later processes read it.

    choice = MeasuredChoices("cpu_gemm").get_or_measure("256x1408 threads=2", measure)

The file is `$ASYNCENGINE_CACHE_DIR/<name>.json` (default `$XDG_CACHE_HOME/asyncengine`, else
`~/.cache/asyncengine`), one object per machine fingerprint (CPU model, logical CPUs, torch version) mapping keys to
JSON values. A process holds an exclusive lock on `<name>.lock` while it measures and writes, so a second process
waits and reads the first one's answer. Delete the file to measure again. Where the directory cannot be written,
the choice is measured in this process only, and a warning says so once.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from asyncengine.kernels.cache_dir import ENV_DIR, cache_dir  # noqa: F401  (re-exported: tests set ENV_DIR)

logger = logging.getLogger(__name__)


@functools.cache
def machine_fingerprint() -> str:
    """The CPU model, logical CPU count and torch version: a choice timed under another of these is not reused."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} | {os.cpu_count()} cpus | torch {torch.__version__}"


class MeasuredChoices:
    """One named table of measured choices (see the module docstring). Values must be JSON-serialisable."""

    _warned: set[str] = set()

    def __init__(self, name: str):
        self.name = name
        self.path = cache_dir() / f"{name}.json"

    def get_or_measure(self, key: str, measure: Callable[[], Any]) -> Any:
        """The recorded value of `key` on this machine, or `measure()`'s, recorded for the next process."""
        try:
            with self._locked():
                table = self._read()
                mine = table.setdefault(machine_fingerprint(), {})
                if key not in mine:
                    mine[key] = measure()
                    self._write(table)
                return mine[key]
        except _NoDisk as error:
            self._warn(error)
            return measure()

    def _warn(self, error: Exception) -> None:
        """Once per table and process: read-only home, full disk."""
        if self.name not in self._warned:
            self._warned.add(self.name)
            logger.warning("measured choices %r are not kept on disk (%s): this process measures its own; set %s to "
                           "a writable directory", self.name, error, ENV_DIR)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(self.path.with_suffix(".lock"), "a")
        except OSError as error:
            raise _NoDisk(error) from error
        with lock:
            try:
                import fcntl
            except ImportError:  # no fcntl (Windows): unlocked; a race only costs a second measurement
                yield
                return
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict:
        try:
            table = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except OSError as error:
            raise _NoDisk(error) from error
        except ValueError:  # a torn or hand-edited file: measure again and rewrite it
            logger.warning("measured choices file %s is not valid JSON; measuring again", self.path)
            return {}
        return table if isinstance(table, dict) else {}

    def _write(self, table: dict) -> None:
        """Atomically (a reader never sees half a file); a failure is warned about, the value still used."""
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.name}.", suffix=".json")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    json.dump(table, out, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
            finally:
                Path(tmp).unlink(missing_ok=True)
        except OSError as error:
            self._warn(error)


class _NoDisk(Exception):
    """The table's file or lock cannot be used (the cause is chained)."""
