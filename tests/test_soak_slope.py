"""The soak's verdict on RSS (loadtest.soak.rss_slope): a steady leak is a meaningful slope; slowly wandering noise
in the floor (a burst of long prompts holds it up for several seconds) is not, in all but a few percent of runs."""

from __future__ import annotations

import numpy as np

from loadtest.soak import Sample, lag1_autocorrelation, rss_slope


def _samples(rss: np.ndarray) -> list[Sample]:
    return [Sample(t=float(i), rss_mib=float(v), rss_max_mib=float(v) + 10, kv_usage=0.0, running=0.0, waiting=0.0)
            for i, v in enumerate(rss)]


def _wandering_noise(rng: np.random.Generator, n: int, rho: float, sigma: float) -> np.ndarray:
    """AR(1) noise: each second keeps rho of the last second's offset."""
    noise = np.zeros(n)
    for i in range(1, n):
        noise[i] = rho * noise[i - 1] + rng.normal(0, sigma)
    return noise


def test_a_steady_leak_is_a_meaningful_slope():
    for seed in range(20):
        rng = np.random.default_rng(seed)
        minutes = np.arange(60) / 60
        rss = 540 + 8.0 * minutes + _wandering_noise(rng, 60, 0.5, 0.3)  # 8 MiB/min in a one-minute run
        fit = rss_slope(_samples(rss), warmup_s=20)
        assert abs(fit.slope - 8.0) < 3.0 and fit.exceeds(1.0), (seed, fit)


def test_wandering_noise_is_rarely_called_a_leak():
    false_alarms = 0
    for seed in range(300):
        rng = np.random.default_rng(seed)
        fit = rss_slope(_samples(538 + _wandering_noise(rng, 60, 0.8, 0.5)), warmup_s=20)
        false_alarms += fit.exceeds(1.0)
    # The textbook error (independent residuals) calls about 11% of these runs a leak.
    assert false_alarms / 300 < 0.06


def test_lag1_autocorrelation():
    rng = np.random.default_rng(2)
    white = rng.normal(0, 0.5, 400)
    assert abs(lag1_autocorrelation(white)) < 0.15
    assert lag1_autocorrelation(np.repeat(white[:40], 10)) > 0.8  # runs of equal values
    assert lag1_autocorrelation(np.full(10, 3.0)) == 0.0
