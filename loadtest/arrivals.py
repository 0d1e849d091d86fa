"""When each request is sent: a seeded Poisson process.

Contract: `arrival_offsets(n, rate, seed)` returns `n` non-decreasing send times in seconds from the start of the
run; the first is 0, and consecutive gaps are independent exponentials with mean `1 / rate`. At `rate = inf` all
offsets are 0 (everything is sent at once). Sending at absolute offsets, rather than sleeping one gap after each
send, keeps scheduling jitter from accumulating over a long run.
"""

from __future__ import annotations

import math

import numpy as np


def poisson_gaps(n: int, rate: float, seed: int) -> np.ndarray:
    """`n` exponential inter-arrival gaps (seconds) with mean `1 / rate`; zeros when `rate` is infinite."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if math.isinf(rate):
        return np.zeros(n)
    return np.random.default_rng(seed).exponential(1.0 / rate, size=n)


def arrival_offsets(n: int, rate: float, seed: int) -> np.ndarray:
    """Send time of each of `n` requests, seconds from the start; the first request goes at 0."""
    gaps = poisson_gaps(max(n - 1, 0), rate, seed)
    return np.concatenate(([0.0], np.cumsum(gaps)))[:n]
