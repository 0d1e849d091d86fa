"""Shared pieces of the reliability tests (issue 6): a server on the embedded default model, SSE clients that
leave at chosen points, and process-memory readings. The tests at the bottom check the helpers themselves.

Everything here runs on loopback only, and every wait is bounded (a client timeout, `wait_until`, or
`asyncio.wait_for`), so a hang fails a test instead of stalling the run.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
from test_server_harness import ServerThread, host_port

from asyncengine.config import default_model_path

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 2**20


def default_model_server(app_kwargs: Optional[dict] = None, sndbuf: Optional[int] = None,
                         **engine_kwargs) -> ServerThread:
    """A ServerThread on the model shipped with the package (`EngineConfig()` with no model named)."""
    return ServerThread(default_model_path(), app_kwargs=app_kwargs, sndbuf=sndbuf, **engine_kwargs)


def rss_bytes(pid: Optional[int] = None) -> int:
    """Resident set size of a process (this one by default), from /proc/<pid>/statm."""
    with open(f"/proc/{pid or 'self'}/statm") as f:
        return int(f.read().split()[1]) * PAGE


def settled_rss() -> int:
    """RSS after a full garbage collection and glibc's malloc_trim: what live objects hold, without the free
    heap memory that the allocator keeps (which swings by tens of MiB with the last steps' tensor sizes)."""
    gc.collect()
    _malloc_trim()
    return rss_bytes()


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS is read as it is
        pass


def count_batch_sizes(engine) -> list[int]:
    """Wrap the engine's device step to record each step's number of sampling requests; returns the live list."""
    core = engine.client.engine
    run = core.run
    sizes: list[int] = []

    def recording_run(step):
        sizes.append(len(step.inputs.sampling_requests))
        return run(step)

    core.run = recording_run
    return sizes


def prompt_bank(n: int, seed: int = 0) -> list[str]:
    """`n` distinct short prompts in the default model's register (Shakespeare and the King James Bible)."""
    import random

    openers = ["The king", "My lord", "And the LORD", "O gentle", "Thou art", "Now is the", "Behold, the",
               "Good morrow", "What say you", "Then spake", "Fair lady", "In the beginning", "Hark, the",
               "I pray thee", "The queen", "And it came", "Sweet prince", "Blessed are", "Alas, poor", "Wherefore"]
    words = ["night", "sword", "crown", "heaven", "river", "father", "sea", "house", "blood", "love", "land",
             "friend", "soul", "day", "earth", "fire", "city", "servant", "death", "word"]
    rng = random.Random(seed)
    prompts, seen = [], set()
    while len(prompts) < n:
        text = f"{rng.choice(openers)} {rng.choice(words)} of {rng.choice(words)}"
        if rng.random() < 0.5:
            text += f" and the {rng.choice(words)}"
        if text not in seen:
            seen.add(text)
            prompts.append(text)
    return prompts


# -- SSE clients ------------------------------------------------------------------------------------------------
@dataclass
class StreamResult:
    status: int
    events: list = field(default_factory=list)  # parsed JSON objects, then "[DONE]"
    chunks_at: list = field(default_factory=list)  # perf_counter() of each content chunk
    body: bytes = b""  # the raw body of a non-200 answer

    @property
    def text(self) -> str:
        return "".join(_chunk_text(e) for e in self.events if isinstance(e, dict))

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def finish_reasons(self) -> list:
        return [c.get("finish_reason") for e in self.events if isinstance(e, dict) for c in e.get("choices") or []
                if c.get("finish_reason")]

    @property
    def errors(self) -> list:
        return [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]


def _chunk_text(event: dict) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def stream_sse(client: httpx.AsyncClient, url: str, body: dict, *, leave_after: Optional[int] = None,
                     read_delay: float = 0.0) -> StreamResult:
    """POST a streaming request and read its events. `leave_after=k`: close the connection after k content
    chunks (0: right after the response headers). `read_delay`: sleep this long after each event."""
    async with client.stream("POST", url, json=body) as response:
        result = StreamResult(response.status_code)
        if response.status_code != 200:
            result.body = await response.aread()
            return result
        if leave_after == 0:
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            event = "[DONE]" if payload == "[DONE]" else json.loads(payload)
            result.events.append(event)
            if isinstance(event, dict) and _chunk_text(event):
                result.chunks_at.append(time.perf_counter())
                if leave_after is not None and len(result.chunks_at) >= leave_after:
                    return result  # leaving the block closes the connection mid-stream
            if read_delay:
                await asyncio.sleep(read_delay)
    return result


async def send_and_close(url: str, path: str, body: dict, linger: float = 0.0) -> None:
    """Send a whole HTTP request on a raw connection and close it `linger` seconds later, reading nothing:
    a client that leaves before (or while) its prompt is prefilled."""
    host, port = host_port(url)
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    try:
        writer.write(head + data)
        await writer.drain()
        if linger:
            await asyncio.sleep(linger)
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 5)
        except (OSError, asyncio.TimeoutError):
            pass


def http_pool(n: int, timeout: float = 60.0) -> httpx.AsyncClient:
    """An AsyncClient that can hold `n` connections at once (none waits for a pooled one)."""
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
                             timeout=httpx.Timeout(timeout, pool=timeout))


# -- tests of the helpers ---------------------------------------------------------------------------------------
def test_prompt_bank_is_distinct_and_reproducible():
    bank = prompt_bank(200)
    assert len(set(bank)) == 200 and bank == prompt_bank(200)


def test_rss_reading_sees_an_allocation():
    before = settled_rss()
    block = bytearray(32 * MiB)
    block[::PAGE] = b"x" * len(block[::PAGE])  # touch every page
    assert rss_bytes() - before > 24 * MiB
    del block
