"""One streamed request over SSE, timed; plus the HTTP client and the model lookup.

Timing contract (all from `time.perf_counter()`):
  - the clock starts just before the POST is issued (so TTFT includes connecting, if a new connection is needed);
  - a *content chunk* is an SSE event whose first choice carries non-empty text (`text` for completions,
    `delta.content` or `delta.reasoning_content` for chat); role-only, finish-only and usage-only events are
    not content;
  - TTFT is the time to the first content chunk, ITL the gaps between consecutive content chunks, and E2EL the
    time to the end of the stream;
  - output tokens are the server's `usage.completion_tokens` when it reports usage (we ask for it with
    `stream_options.include_usage`), else the number of content chunks.
A request succeeds only on HTTP 200, at least one content chunk, no error event and a final `data: [DONE]`.

The transport is aiohttp (its HTTP parser is C). On a 2-core machine the client shares the cores with the server it
measures, so its cost per SSE event biases the figure: 64 streams x 64 tokens against `asyncengine serve` on CPU,
httpx's client took 130 us of CPU per event (its stream reader, httpcore and anyio in Python), aiohttp's 45 us
(session 11, loadtest/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from .config import BenchmarkConfig
from .datasets import SampleRequest
from .records import FAILED, OK, RequestRecord

DONE = "[DONE]"
MAX_ERROR_CHARS = 500


def make_http_client(config: BenchmarkConfig) -> aiohttp.ClientSession:
    """A session whose connection pool is sized by `config.pool_size()`; the per-request deadline is enforced by
    `send_request`, so the session's own timeouts only bound connecting and silent reads (each `config.timeout`).
    Use it as an async context manager (it closes its connections)."""
    size = config.pool_size()
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=size, limit_per_host=size),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.timeout, sock_read=config.timeout),
        headers=headers,
    )


async def fetch_first_model(client: aiohttp.ClientSession, config: BenchmarkConfig) -> str:
    """The id of the first model listed by GET /v1/models; RuntimeError with the reason when there is none."""
    url = config.base_url + "/v1/models"
    try:
        async with client.get(url, timeout=aiohttp.ClientTimeout(total=min(config.timeout, 30.0))) as response:
            response.raise_for_status()
            return (await response.json(content_type=None))["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise RuntimeError(f"cannot read a model id from {url}: {type(exc).__name__}: {exc}") from exc


def build_payload(config: BenchmarkConfig, model: str, request: SampleRequest) -> dict:
    """The JSON body for one request (streaming, with usage, `extra_body` merged last)."""
    body: dict = {
        "model": model,
        "max_tokens": request.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.is_chat:
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body


async def send_request(
    client: aiohttp.ClientSession, config: BenchmarkConfig, payload: dict, record: RequestRecord
) -> RequestRecord:
    """Send one streaming request and fill `record` in place as events arrive (so a caller that cancels this
    coroutine still holds what was measured). Never raises except on cancellation; failures are recorded
    as `status=FAILED` with an error text."""
    start = time.perf_counter()
    state = _StreamState(start)
    try:
        await asyncio.wait_for(_stream(client, config, payload, record, state), config.timeout)
    except asyncio.TimeoutError:
        record.error = f"timeout: no complete response within {config.timeout:g} s"
    except Exception as exc:  # noqa: BLE001 - any transport or protocol fault is this request's failure
        record.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    record.e2el_s = time.perf_counter() - start
    _finish(record, state)
    return record


class _StreamState:
    """Progress of one stream: when the last content chunk came, and whether [DONE] was seen."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.last_chunk: float | None = None
        self.done = False


async def _stream(
    client: aiohttp.ClientSession, config: BenchmarkConfig, payload: dict, record: RequestRecord,
    state: _StreamState,
) -> None:
    async with client.post(config.url, json=payload) as response:
        if response.status != 200:
            body = (await response.read()).decode(errors="replace")
            record.error = f"HTTP {response.status}: {body}"[:MAX_ERROR_CHARS]
            return
        async for line in sse_lines(response.content):
            if not _handle_line(line, config.is_chat, record, state):
                return


async def sse_lines(stream: aiohttp.StreamReader):
    """The lines of a response body as str, without their line ends (LF or CRLF), as the bytes arrive; no limit
    on a line's length (a logprobs event can be long), unlike StreamReader.readline."""
    pending = b""
    async for data in stream.iter_any():
        lines = (pending + data).split(b"\n")
        pending = lines.pop()
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if pending:
        yield pending.rstrip(b"\r").decode()


def _handle_line(line: str, is_chat: bool, record: RequestRecord, state: _StreamState) -> bool:
    """Apply one SSE line to the record; False when the stream is over (done or error)."""
    data = sse_data(line)
    if data is None:
        return True
    if data == DONE:
        state.done = True
        return False
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        event = None
    if not isinstance(event, dict):
        record.error = f"malformed SSE data: {data}"[:MAX_ERROR_CHARS]
        return False
    if "error" in event:
        record.error = f"server error event: {json.dumps(event['error'])}"[:MAX_ERROR_CHARS]
        return False
    if chunk_content(event, is_chat):
        _on_content(record, state, time.perf_counter())
    usage = event.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        record.output_tokens = int(usage["completion_tokens"])
        record.usage_reported = True
        if usage.get("prompt_tokens") is not None:
            record.prompt_len = int(usage["prompt_tokens"])
    return True


def _on_content(record: RequestRecord, state: _StreamState, now: float) -> None:
    if state.last_chunk is None:
        record.ttft_s = now - state.start
    else:
        record.itl_s.append(now - state.last_chunk)
    state.last_chunk = now
    record.chunks += 1


def _finish(record: RequestRecord, state: _StreamState) -> None:
    if not record.usage_reported:
        record.output_tokens = record.chunks
    if record.error is None and record.chunks == 0:
        record.error = "no content chunk received"
    elif record.error is None and not state.done:
        record.error = "stream ended without data: [DONE]"
    record.status = OK if record.error is None else FAILED


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line, or None for blank lines, comments (pings) and other fields."""
    if not line.startswith("data:"):
        return None
    data = line[5:]
    return data[1:] if data.startswith(" ") else data


def chunk_content(event: dict, is_chat: bool) -> str:
    """The text carried by the first choice of a streamed completion/chat chunk ('' when there is none)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if is_chat:
        delta = choice.get("delta") or {}
        # reasoning models stream their thinking first; it is output the user waits through, so it counts
        return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
    return choice.get("text") or ""
