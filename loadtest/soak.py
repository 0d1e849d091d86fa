"""Soak test: does the server's memory creep, and does everything it holds come back, under hours-like load?

    python -m loadtest.soak --minutes 5 [--concurrency 16] [--out soak-out/]

Starts `asyncengine serve` (the default model unless --model) as a subprocess on 127.0.0.1 and an ephemeral
port, then runs a mixed load at a bounded concurrency until the time is up: completions and chat, streamed and
not, short and long prompts, greedy and sampled, and clients that leave at random points (right after the
headers, after a few chunks, or a non-streamed request given up midway). Every second it samples the RSS of the
server and the processes below it, its engine process included (/proc/PID/statm, summed, read every
RSS_READ_INTERVAL within the second: the lowest and highest reading; and the lowest of each part: the API server's,
the engine process's and other processes' anonymous memory, and the file-backed pages, whose slopes the report
gives to say where a slope comes from) and /metrics (vllm:kv_cache_usage_perc, running, waiting).

It fails (exit 1) when
  - the least-squares slope of RSS over the samples after the warm-up exceeds --max-slope (MiB/min) by more than
    its noise: slope - 2 * (standard error of the slope, widened for autocorrelated residuals) > max_slope. The
    line is fitted to each second's lowest reading: a step's activations (tens of MiB for a long prefill) are
    live memory that comes and goes, and a leak shows as a rising floor. A short run can only detect a steep
    slope (1 minute: about 3 MiB/min; 5 minutes: about 1.2); the report states the slope, its standard error and the smallest it could detect;
  - any request failed unexpectedly (a non-200 status, an error event, a stream without [DONE], a transport
    error, a timeout; the client-side cancellations it makes on purpose are not failures);
  - KV-cache usage does not return to 0 once the load stops, or the server does not exit 0 on SIGTERM.
It writes soak.json (config, verdict, every sample, failure examples) and soak.png (RSS with the fitted line;
KV usage and queue lengths).

Bounded caches first: the prefix cache keeps about 0.9 KB of Python metadata per registered KV block, so it grows
until every block is registered (8192 blocks, about 7 MiB, with the engine's default 1 GiB CPU KV cache: several
minutes of this load) and then stays flat. The soak therefore runs the server with --num-kv-blocks 2048 by default
and, before the load, primes the prefix cache with distinct prompts covering every block once, so that the fitted
window sees the steady state rather than the cache filling up.

Memory measurement: glibc adapts its mmap threshold to the sizes freed so far, so a server's RSS swings by tens
of MiB with the sizes of recent steps' temporary tensors, which would swamp a slope of 1 MiB/min over a short run.
The soak therefore starts the server with a fixed threshold (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_), so
RSS follows what is actually held; --no-pin-malloc measures the allocator as deployed.
Every loop here is bounded in count or time, and the server is killed if it does not stop by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import numpy as np

from .datasets import WORDS

MiB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")
RSS_READ_INTERVAL = 0.1  # seconds
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "MALLOC_TRIM_THRESHOLD_": str(1 * MiB)}


@dataclass
class SoakConfig:
    minutes: float = 5.0
    concurrency: int = 16
    warmup_s: Optional[float] = None  # None: a third of the run, at most 60 s
    max_slope: float = 1.0  # MiB per minute
    seed: int = 0
    model: Optional[str] = None
    num_kv_blocks: int = 2048
    block_size: int = 16  # the server's (its default); for priming the prefix cache
    request_timeout: float = 60.0
    drain_timeout: float = 30.0  # after the load: wait this long for KV usage to reach 0
    pin_malloc: bool = True
    out: Optional[str] = "soak-out"

    def __post_init__(self) -> None:
        if not self.minutes > 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.warmup_s is None:
            self.warmup_s = min(60.0, self.minutes * 60 / 3)
        if not 0 <= self.warmup_s < self.minutes * 60 - 5:
            raise ValueError(f"warmup_s must leave at least 5 s of samples, got {self.warmup_s}")


@dataclass
class Sample:
    t: float  # seconds since the load started
    rss_mib: float  # the lowest of the second's RSS readings (what is held between steps)
    rss_max_mib: float  # the highest (with the transient tensors of the steps in flight)
    kv_usage: Optional[float]
    running: Optional[float]
    waiting: Optional[float]
    # the second's lowest reading of each part (ServerProcess.memory_parts): where a slope comes from
    parts_mib: dict = field(default_factory=dict)


@dataclass
class Tally:
    ok: int = 0
    cancelled: int = 0  # left on purpose
    failed: int = 0
    by_kind: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)  # the first few failure texts

    def add(self, kind: str, outcome: str, error: Optional[str] = None) -> None:
        setattr(self, outcome, getattr(self, outcome) + 1)
        key = f"{kind}:{outcome}"
        self.by_kind[key] = self.by_kind.get(key, 0) + 1
        if error is not None and len(self.failures) < 20:
            self.failures.append(f"{kind}: {error}"[:300])


# -- the server ---------------------------------------------------------------------------------------------------
class ServerProcess:
    """`python -m asyncengine.api serve` on 127.0.0.1:0; the URL is read from its first stdout line."""

    def __init__(self, config: SoakConfig, log_path: Path):
        cmd = [sys.executable, "-m", "asyncengine.api", "serve", *([config.model] if config.model else []),
               "--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]
        cmd += ["--num-kv-blocks", str(config.num_kv_blocks), "--block-size", str(config.block_size)]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(PINNED_MALLOC if config.pin_malloc else {})}
        self.log = open(log_path, "w+b")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, env=env)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline().decode()), daemon=True).start()
        try:
            line = lines.get(timeout=120)
        except queue.Empty:
            self.kill()
            raise RuntimeError("the server printed no address within 120 s:\n" + self.tail())
        if not line.startswith("asyncengine serving on "):
            self.kill()
            raise RuntimeError(f"unexpected first line {line!r}:\n" + self.tail())
        self.url = line.split()[-1]
        self.part_of: dict[int, str] = {}  # pid -> its part (memory_parts)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def memory_parts(self) -> tuple[float, dict[str, float]]:
        """The RSS of the server and every process below it (its engine process, multiprocessing's tracker), in MiB,
        and its parts {name: MiB}: the anonymous memory of the API server, of the engine process and of the other
        processes, and the file-backed pages of them all (libraries, mapped weights). The parts sum to the RSS; the
        report gives each one's slope, to say where a slope of the RSS comes from."""
        parts = dict.fromkeys(("api server anon", "engine process anon", "other processes anon", "file-backed"), 0)
        for pid in _process_tree(self.pid):
            resident, shared = _statm_pages(pid)
            if pid not in self.part_of:  # read each process's command line once, not ten times a second
                self.part_of[pid] = _part_of(pid, self.pid)
            parts[self.part_of[pid]] += resident - shared
            parts["file-backed"] += shared
        return sum(parts.values()) * PAGE / MiB, {name: pages * PAGE / MiB for name, pages in parts.items()}

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM, then the exit status (None if it had to be killed)."""
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]


def _process_tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc/PID/task/*/children); processes that exit meanwhile are skipped."""
    tree, i = [pid], 0
    while i < len(tree):
        try:
            for task in os.listdir(f"/proc/{tree[i]}/task"):
                with open(f"/proc/{tree[i]}/task/{task}/children") as f:
                    tree += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            pass
        i += 1
    return tree


def _statm_pages(pid: int) -> tuple[int, int]:
    """(resident, resident and file-backed or shared) pages of a process; (0, 0) once it has exited."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            fields = f.read().split()
        return int(fields[1]), int(fields[2])
    except FileNotFoundError:  # exited between the listing and the read
        return 0, 0


def _part_of(pid: int, server_pid: int) -> str:
    """Which part of the server's memory a process's anonymous pages count in (ServerProcess.memory_parts)."""
    if pid == server_pid:
        return "api server anon"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
    except FileNotFoundError:
        return "other processes anon"
    return "engine process anon" if b"spawn_main" in command else "other processes anon"


# -- load -----------------------------------------------------------------------------------------------------------
def random_request(rng: random.Random) -> tuple[str, str, dict, Optional[int], Optional[float]]:
    """(kind, path, body, leave after k chunks or None, give up after s seconds or None)."""
    chat = rng.random() < 0.5
    stream = rng.random() < 0.7
    long = rng.random() < 0.2
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(200, 600) if long else rng.randint(3, 20)))
    body: dict = {"max_tokens": rng.randint(4, 64), "temperature": rng.choice([0.0, 0.7]), "stream": stream,
                  "ignore_eos": rng.random() < 0.5}
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    leave = give_up = None
    if stream and rng.random() < 0.2:
        leave = rng.randint(0, 10)  # 0: right after the response headers
    elif not stream and rng.random() < 0.1:
        give_up = rng.uniform(0.0, 0.5)
    kind = f"{'chat' if chat else 'cmpl'}-{'stream' if stream else 'json'}-{'long' if long else 'short'}"
    return kind, "/v1/chat/completions" if chat else "/v1/completions", body, leave, give_up


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, tally: Tally, timeout: float) -> None:
    kind, path, body, leave, give_up = random_request(rng)
    try:
        if give_up is not None:
            try:
                await asyncio.wait_for(client.post(url + path, json=body), give_up)
            except asyncio.TimeoutError:
                tally.add(kind, "cancelled")
                return
            tally.add(kind, "ok")  # it finished before we gave up
            return
        if body["stream"]:
            error = await asyncio.wait_for(_stream(client, url + path, body, leave), timeout)
        else:
            response = await asyncio.wait_for(client.post(url + path, json=body), timeout)
            error = None if response.status_code == 200 else f"HTTP {response.status_code}: {response.text[:200]}"
    except asyncio.TimeoutError:
        error = f"timeout after {timeout:g} s"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    if error == "left":
        tally.add(kind, "cancelled")
    elif error is None:
        tally.add(kind, "ok")
    else:
        tally.add(kind, "failed", error)


async def _stream(client: httpx.AsyncClient, url: str, body: dict, leave: Optional[int]) -> Optional[str]:
    """None when the stream completed well, "left" when we left on purpose, else the failure."""
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
        if leave == 0:
            return "left"
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return None
            event = json.loads(line[6:])
            if "error" in event:
                return f"error event: {json.dumps(event['error'])[:200]}"
            chunks += 1
            if leave is not None and chunks >= leave:
                return "left"
    return "stream ended without data: [DONE]"


async def read_metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(url + "/metrics", timeout=10)).text
    values = {}
    for line in text.splitlines():
        for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                values[name] = float(line.rsplit(" ", 1)[-1])
    return values


async def prime_prefix_cache(client: httpx.AsyncClient, url: str, config: SoakConfig) -> int:
    """Fill every KV block once with distinct prompt tokens (max_tokens 1), so the prefix cache starts full.
    Returns the prompt tokens sent; bounded by a prompt count and each request's timeout."""
    rng = random.Random(config.seed + 7919)
    target = int(1.2 * config.num_kv_blocks * config.block_size)
    sent = 0

    async def one() -> int:
        prompt = " ".join(rng.choice(WORDS) for _ in range(400))
        response = await asyncio.wait_for(client.post(url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": 1, "temperature": 0}), config.request_timeout)
        response.raise_for_status()
        return response.json()["usage"]["prompt_tokens"]

    for _ in range(target // (8 * 300) + 1):  # 8 at a time, each of 400 words (at least 300 tokens)
        if sent >= target:
            break
        sent += sum(await asyncio.gather(*[one() for _ in range(8)]))
    return sent


async def drive(config: SoakConfig, server: ServerProcess) -> tuple[list[Sample], Tally, Optional[float]]:
    """Run the load for config.minutes while sampling; then wait for KV usage 0. Returns the samples, the tally
    and the seconds KV usage took to reach 0 after the load (None: it did not within drain_timeout)."""
    tally, samples = Tally(), []
    duration = config.minutes * 60
    limits = httpx.Limits(max_connections=config.concurrency + 4, max_keepalive_connections=config.concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(config.request_timeout)) as client:
        await prime_prefix_cache(client, server.url, config)
        t0 = time.monotonic()
        deadline = t0 + duration

        async def worker(index: int) -> None:
            rng = random.Random(config.seed * 1000 + index)
            while time.monotonic() < deadline:
                await one_request(client, server.url, rng, tally, config.request_timeout)

        async def sample_once(readings: list[tuple[float, dict]]) -> None:
            metrics = await read_metrics(client, server.url)
            readings.append(server.memory_parts())
            totals = [total for total, _ in readings]
            parts = {name: min(p[name] for _, p in readings) for name in readings[0][1]}
            samples.append(Sample(round(time.monotonic() - t0, 2), min(totals), max(totals),
                                  metrics.get("vllm:kv_cache_usage_perc"), metrics.get("vllm:num_requests_running"),
                                  metrics.get("vllm:num_requests_waiting"), parts))

        async def sampler() -> None:
            next_at = t0
            while time.monotonic() < deadline:
                next_at += 1.0
                readings = []
                while time.monotonic() < next_at - RSS_READ_INTERVAL:
                    readings.append(server.memory_parts())
                    await asyncio.sleep(RSS_READ_INTERVAL)
                await sample_once(readings)
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))

        workers = [asyncio.ensure_future(worker(i)) for i in range(config.concurrency)]
        await asyncio.wait_for(sampler(), duration + 30)
        await asyncio.wait_for(asyncio.gather(*workers), config.request_timeout + 30)
        load_end = time.monotonic()
        drained = None
        while time.monotonic() - load_end < config.drain_timeout:
            await sample_once([])
            if samples[-1].kv_usage == 0 and not samples[-1].running and not samples[-1].waiting:
                drained = time.monotonic() - load_end
                break
            await asyncio.sleep(0.5)
    return samples, tally, drained


# -- verdict, report ------------------------------------------------------------------------------------------------
@dataclass
class SlopeFit:
    slope: float  # MiB per minute
    intercept: float  # MiB at t = 0
    stderr: float  # standard error of the slope, MiB per minute
    residual_std: float  # MiB

    def exceeds(self, limit: float, z: float = 2.0) -> bool:
        """True when the slope is above `limit` by more than z standard errors (a meaningful slope)."""
        return self.slope - z * self.stderr > limit


def rss_slope(samples: list[Sample], warmup_s: float) -> SlopeFit:
    """Least-squares line through (minutes, RSS floor MiB) of the samples after the warm-up.

    The standard error allows for autocorrelated residuals: a floor raised by a burst of long prompts stays up for
    several one-second samples, so neighbouring residuals are not independent, and the textbook error (which
    assumes they are) is too small, turning a transient bump near the end of a short run into a "slope". The
    error is widened by the AR(1) factor sqrt((1 + r) / (1 - r)), r being the lag-1 autocorrelation of the
    residuals (when positive); a steady leak still shows, since it moves the line and not only the residuals."""
    return fit_slope([(s.t / 60.0, s.rss_mib) for s in samples if s.t >= warmup_s], warmup_s)


def fit_slope(points: list[tuple[float, float]], warmup_s: float) -> SlopeFit:
    """rss_slope's line and error through (minutes, MiB) points."""
    if len(points) < 3:
        raise ValueError(f"only {len(points)} samples after the warm-up of {warmup_s:g} s")
    t, rss = np.array(points).T
    slope, intercept = np.polyfit(t, rss, 1)
    residuals = rss - (slope * t + intercept)
    spread = float(np.sum((t - t.mean()) ** 2))
    if spread == 0:
        return SlopeFit(float(slope), float(intercept), float("inf"), float(np.std(residuals)))
    stderr = float(np.sqrt(np.sum(residuals**2) / (len(t) - 2) / spread))
    stderr *= float(np.sqrt((1 + lag1) / (1 - lag1))) if (lag1 := lag1_autocorrelation(residuals)) > 0 else 1.0
    return SlopeFit(float(slope), float(intercept), stderr, float(np.std(residuals)))


def lag1_autocorrelation(values: np.ndarray, cap: float = 0.9) -> float:
    """Correlation of each value with the next, capped below 1 so the widening factor stays finite."""
    centred = values - values.mean()
    energy = float(np.sum(centred**2))
    if len(values) < 3 or energy == 0:
        return 0.0
    return min(cap, float(np.sum(centred[1:] * centred[:-1]) / energy))


def write_plot(path: Path, samples: list[Sample], config: SoakConfig, fit: SlopeFit) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.array([s.t for s in samples])
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    ax1.axvspan(0, config.warmup_s, color="0.92", label="warm-up (not fitted)", zorder=0)
    ax1.fill_between(t, [s.rss_mib for s in samples], [s.rss_max_mib for s in samples], color="C0", alpha=0.2,
                     label="server RSS, range within each second")
    ax1.plot(t, [s.rss_mib for s in samples], ".-", ms=3, lw=0.8, label="server RSS, lowest in each second")
    fit_t = t[t >= config.warmup_s]
    ax1.plot(fit_t, fit.slope * fit_t / 60.0 + fit.intercept, "r-",
             label=f"fit: {fit.slope:+.2f} ± {fit.stderr:.2f} MiB/min")
    ax1.set_ylabel("RSS (MiB)")
    ax1.legend(loc="best")
    ax1.set_title(f"asyncengine soak: {config.minutes:g} min, concurrency {config.concurrency}")
    ax2.plot(t, [s.kv_usage if s.kv_usage is not None else np.nan for s in samples], label="KV usage (0-1)")
    ax2b = ax2.twinx()
    ax2b.plot(t, [s.running if s.running is not None else np.nan for s in samples], "g-", lw=0.8, label="running")
    ax2b.plot(t, [s.waiting if s.waiting is not None else np.nan for s in samples], "m-", lw=0.8, label="waiting")
    ax2.set_xlabel("seconds since the load started")
    ax2.set_ylabel("KV usage")
    ax2b.set_ylabel("requests")
    lines = ax2.get_legend_handles_labels()
    lines2 = ax2b.get_legend_handles_labels()
    ax2.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_soak(config: SoakConfig) -> dict:
    """Run the soak; returns the report (also written under config.out). report["passed"] is the verdict."""
    out = Path(config.out) if config.out else None
    log_dir = out or Path(os.environ.get("TMPDIR", "/tmp"))
    log_dir.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(config, log_dir / "soak-server.log")
    exit_code: Optional[int] = None
    try:
        samples, tally, drained = asyncio.run(drive(config, server))
    finally:
        exit_code = server.stop()
    load_samples = [s for s in samples if s.t <= config.minutes * 60 + 1e-9]
    fit = rss_slope(load_samples, config.warmup_s)
    fitted = [s.rss_mib for s in load_samples if s.t >= config.warmup_s]
    part_slopes = {name: fit_slope([(s.t / 60.0, s.parts_mib[name]) for s in load_samples
                                    if s.t >= config.warmup_s], config.warmup_s).slope
                   for name in load_samples[0].parts_mib}
    problems = []
    if fit.exceeds(config.max_slope):
        problems.append(f"RSS grows by {fit.slope:.2f} ± {fit.stderr:.2f} MiB/min after the warm-up "
                        f"(limit {config.max_slope:g})")
    if tally.failed:
        problems.append(f"{tally.failed} requests failed unexpectedly, e.g. {tally.failures[:3]}")
    if drained is None:
        problems.append(f"KV usage did not return to 0 within {config.drain_timeout:g} s of the load's end "
                        f"(last sample {samples[-1].kv_usage if samples else None})")
    if exit_code != 0:
        problems.append(f"the server did not exit 0 on SIGTERM (status {exit_code}):\n{server.tail()}")
    if tally.ok == 0:
        problems.append("no request completed")
    report = {
        "passed": not problems,
        "problems": problems,
        "config": asdict(config),
        "rss": {"slope_mib_per_min": fit.slope, "slope_stderr_mib_per_min": fit.stderr,
                "detectable_slope_mib_per_min": config.max_slope + 2 * fit.stderr,
                "intercept_mib": fit.intercept, "residual_std_mib": fit.residual_std,
                "first_mib": load_samples[0].rss_mib, "last_mib": load_samples[-1].rss_mib,
                "peak_mib": max(s.rss_max_mib for s in load_samples),
                "fit_min_mib": min(fitted), "fit_max_mib": max(fitted), "fit_samples": len(fitted),
                "part_slopes_mib_per_min": part_slopes},
        "kv_drained_after_s": drained,
        "server_exit_code": exit_code,
        "requests": {"ok": tally.ok, "cancelled": tally.cancelled, "failed": tally.failed,
                     "by_kind": dict(sorted(tally.by_kind.items())), "failures": tally.failures},
        "samples": [asdict(s) for s in samples],
    }
    if out is not None:
        (out / "soak.json").write_text(json.dumps(report, indent=1))
        write_plot(out / "soak.png", load_samples, config, fit)
    return report


def format_report(report: dict) -> str:
    rss, req, cfg = report["rss"], report["requests"], report["config"]
    drained = report["kv_drained_after_s"]
    lines = [
        "== asyncengine soak " + "=" * 52,
        f"duration       {cfg['minutes']:g} min at concurrency {cfg['concurrency']} (warm-up {cfg['warmup_s']:g} s)",
        f"requests       {req['ok']} ok, {req['cancelled']} cancelled on purpose, {req['failed']} failed",
        f"server RSS     floor {rss['first_mib']:.1f} -> {rss['last_mib']:.1f} MiB, peak {rss['peak_mib']:.1f}; "
        f"after warm-up {rss['fit_min_mib']:.1f}..{rss['fit_max_mib']:.1f} MiB ({rss['fit_samples']} samples)",
        f"RSS slope      {rss['slope_mib_per_min']:+.3f} ± {rss['slope_stderr_mib_per_min']:.3f} MiB/min "
        f"(limit {cfg['max_slope']:g}; this run detects > {rss['detectable_slope_mib_per_min']:.2f}), "
        f"residual std {rss['residual_std_mib']:.2f} MiB",
        "by part        " + ", ".join(f"{name} {slope:+.2f}" for name, slope in rss["part_slopes_mib_per_min"].items())
        + " MiB/min",
        f"KV usage       {'back to 0 after %.1f s' % drained if drained is not None else 'NOT back to 0'}",
        f"server exit    {report['server_exit_code']}",
        f"verdict        {'PASS' if report['passed'] else 'FAIL'}",
    ]
    lines += [f"  - {p}" for p in report["problems"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup-s", type=float, default=None, help="default: a third of the run, at most 60 s")
    parser.add_argument("--max-slope", type=float, default=1.0, help="largest RSS slope allowed, MiB per minute")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the model in the package)")
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="the server's KV cache, in blocks")
    parser.add_argument("--block-size", type=int, default=16, help="the server's KV block size, in tokens")
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--no-pin-malloc", dest="pin_malloc", action="store_false",
                        help="measure RSS under glibc's adaptive mmap threshold (noisier)")
    parser.add_argument("--out", default="soak-out", help="folder for soak.json, soak.png and the server log")
    args = parser.parse_args(argv)
    try:
        config = SoakConfig(**vars(args))
    except ValueError as exc:
        parser.error(str(exc))
    report = run_soak(config)
    print(format_report(report))
    if config.out:
        print(f"wrote {Path(config.out) / 'soak.json'} and {Path(config.out) / 'soak.png'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
