"""A checkpoint tensor not read yet: weight loaders narrow it to their rank's slice, and only that slice is read.

With tensor parallelism each rank needs 1/N of most weights; reading the whole tensor first would make every rank
hold the full model in host memory for a moment. `CheckpointSlice` wraps safetensors' lazy slice
(`safe_open(...).get_slice(name)`): `narrow` only narrows the bounds, and the bytes are read when a torch function
receives it (e.g. `param.data.copy_(loaded.narrow(0, start, size))`), so loaders written for plain tensors work
unchanged and read only what they keep.
"""

from __future__ import annotations

from typing import Any

import torch


class CheckpointSlice:
    """A rectangular window [start, stop) per dimension of one checkpoint tensor, read on first use."""

    def __init__(self, lazy: Any, bounds: tuple[tuple[int, int], ...]):
        self._lazy = lazy  # safetensors PySafeSlice: indexable with slices, returns a torch tensor
        self._bounds = bounds

    @classmethod
    def whole(cls, lazy: Any) -> "CheckpointSlice":
        return cls(lazy, tuple((0, n) for n in lazy.get_shape()))

    @property
    def shape(self) -> torch.Size:
        return torch.Size(stop - start for start, stop in self._bounds)

    def dim(self) -> int:
        return len(self._bounds)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> "CheckpointSlice":
        dim %= self.dim()
        lo, hi = self._bounds[dim]
        if start < 0 or length < 0 or lo + start + length > hi:
            raise IndexError(f"narrow({dim}, {start}, {length}) is outside a tensor of shape {tuple(self.shape)}")
        bounds = list(self._bounds)
        bounds[dim] = (lo + start, lo + start + length)
        return CheckpointSlice(self._lazy, tuple(bounds))

    def __getitem__(self, key):
        """Basic slicing (slices with step 1, per leading dimension) stays lazy; anything else reads the window."""
        keys = key if isinstance(key, tuple) else (key,)
        if len(keys) > self.dim() or not all(isinstance(k, slice) and k.step in (None, 1) for k in keys):
            return self.read()[key]
        window = self
        for dim, k in enumerate(keys):
            start, stop, _ = k.indices(window.shape[dim])
            window = window.narrow(dim, start, max(0, stop - start))
        return window

    def read(self) -> torch.Tensor:
        """The window's values, read from the file now."""
        if not self._bounds:  # a scalar
            return self._lazy[...]
        return self._lazy[tuple(slice(start, stop) for start, stop in self._bounds)]

    def to(self, *args, **kwargs) -> torch.Tensor:
        return self.read().to(*args, **kwargs)

    def __getattr__(self, name: str):  # any other tensor attribute: read the window and ask the tensor
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.read(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """A torch function given a CheckpointSlice reads it first (e.g. `param.data.copy_(slice)`)."""
        def real(x):
            if isinstance(x, CheckpointSlice):
                return x.read()
            if isinstance(x, (list, tuple)):
                return type(x)(real(v) for v in x)
            return x
        return func(*real(args), **{k: real(v) for k, v in (kwargs or {}).items()})
