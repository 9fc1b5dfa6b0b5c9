"""Online serving benchmark for any OpenAI-compatible server (duet, vLLM, SGLang, ...).

Drives a live server with streaming ``/v1/completions`` requests and reports latency and
throughput using vLLM's metric definitions (``vllm bench serve``):

* TTFT  - request sent -> first streamed chunk carrying text.
* ITL   - gaps between successive text chunks, pooled over all successful requests.
* TPOT  - per request ``(e2e - TTFT) / (output_tokens - 1)``; requests with one output token are skipped.
* E2EL  - request sent -> last text chunk.
* request / input / output / total token throughput over the benchmark's wall-clock duration.

Output token counts come from the server's ``usage.completion_tokens`` (the request sets
``stream_options.include_usage``); if the server sends no usage the requested length is used
(requests set ``ignore_eos`` so the two agree on servers that honour it).

Prompts are random token sequences from the model's tokenizer (seeded).  By default the token ids
themselves are sent as ``prompt`` (the completions API accepts a list of ints), so the input length
is exact; ``--prompt-format text`` decodes them to text and re-encodes/adjusts until the text
tokenizes to the wanted length.

Usage::

    python -m benchmarks.bench_serving --base-url http://127.0.0.1:30000 \\
        --num-prompts 200 --request-rate 8 --random-input-len 1024 --random-output-len 128 \\
        --output-file out/duet_rate8.json

The metric computation (:func:`compute_metrics`) is a pure function over :class:`RequestRecord`
objects, so it can be tested without a server.  Library use: ``await run_benchmark(args)`` with an
``argparse.Namespace`` (missing attributes take the CLI defaults) returns the result dict.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
import warnings
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import numpy as np

DEFAULT_BASE_URL = "http://127.0.0.1:30000"
DEFAULT_ENDPOINT = "/v1/completions"
DEFAULT_TIMEOUT_S = 6 * 60 * 60  # same as vLLM's AIOHTTP_TIMEOUT
MAX_RESERVED_CLIENTS = 4096
CLIENT_CPU_WARN = 0.8

# Keys every result JSON carries (vLLM's names), besides the per-percentile ones.
METRIC_KEYS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "total_token_throughput",
)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


# --------------------------------------------------------------------------------------------
# Per-request records and the (pure) metric computation
# --------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """What one request did, in ``time.perf_counter()`` seconds.

    ``chunk_times`` holds the arrival time of every streamed chunk that carried text;
    ``output_tokens`` is ``usage.completion_tokens`` when the server reported it, else ``None``.
    """

    prompt_len: int
    expected_output_len: int
    send_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    end_time: float | None = None
    output_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    success: bool = False
    error: str = ""
    generated_text: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time if self.chunk_times else 0.0

    @property
    def latency(self) -> float:
        """End-to-end latency as vLLM defines it: send -> last text chunk."""
        return self.chunk_times[-1] - self.send_time if self.chunk_times else 0.0

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [t[i] - t[i - 1] for i in range(1, len(t))]

    @property
    def num_output_tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else self.expected_output_len


def _pct_key(p: float) -> str:
    return str(int(p)) if float(p) == int(p) else str(p)


def compute_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    percentiles: Sequence[float] = (99,),
) -> dict[str, Any]:
    """vLLM-style serving metrics from per-request records (pure; times in seconds in, ms out).

    Only successful requests contribute tokens and latencies; failed ones are counted in
    ``failed``.  Percentiles use numpy's linear interpolation; an empty population gives 0.
    """
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    input_lens: list[int] = []
    output_lens: list[int] = []
    completed = failed = total_input = total_output = usage_missing = 0

    for r in records:
        if not r.success:
            failed += 1
            input_lens.append(r.prompt_len)
            output_lens.append(0)
            continue
        completed += 1
        n_out = r.num_output_tokens
        if r.output_tokens is None:
            usage_missing += 1
        total_input += r.prompt_len
        total_output += n_out
        input_lens.append(r.prompt_len)
        output_lens.append(n_out)
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        itls.extend(r.itls)
        if n_out > 1:
            tpots.append((r.latency - r.ttft) / (n_out - 1))

    if completed == 0:
        warnings.warn("All requests failed; latency metrics are zero.", stacklevel=2)

    dur = duration if duration > 0 else float("nan")
    result: dict[str, Any] = {
        "completed": completed,
        "failed": failed,
        "duration": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / dur,
        "input_throughput": total_input / dur,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
        "usage_missing": usage_missing,
    }
    pops = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name, values in pops.items():
        arr = np.asarray(values, dtype=np.float64) * 1000.0
        has = arr.size > 0
        result[f"mean_{name}_ms"] = float(arr.mean()) if has else 0.0
        result[f"median_{name}_ms"] = float(np.median(arr)) if has else 0.0
        result[f"std_{name}_ms"] = float(arr.std()) if has else 0.0
        for p in percentiles:
            result[f"p{_pct_key(p)}_{name}_ms"] = float(np.percentile(arr, p)) if has else 0.0
    # Per-request detail, aligned with the request order (vLLM's layout).
    result["input_lens"] = input_lens
    result["output_lens"] = output_lens
    result["ttfts"] = [r.ttft if r.success else 0.0 for r in records]
    result["itls"] = [r.itls if r.success else [] for r in records]
    result["errors"] = [r.error for r in records]
    return result


def format_result_table(result: dict[str, Any], percentiles: Sequence[float] = (99,)) -> str:
    """The end-of-run summary, laid out like vLLM's 'Serving Benchmark Result'."""
    lines: list[str] = []

    def title(s: str, c: str) -> None:
        lines.append("{s:{c}^{n}}".format(s=s, n=50, c=c))

    def row(name: str, value: Any, fmt: str = "") -> None:
        v = format(value, fmt) if fmt and value is not None else str(value)
        lines.append(f"{name:<40} {v:<10}")

    title(" Serving Benchmark Result ", "=")
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    if "request_rate" in result:
        row("Request rate (req/s):", result["request_rate"])
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    row("Input token throughput (tok/s):", result["input_throughput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f")
    sections = {
        "ttft": ("Time to First Token", "TTFT"),
        "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
        "itl": ("Inter-token Latency", "ITL"),
        "e2el": ("End-to-end Latency", "E2EL"),
    }
    for key, (header, short) in sections.items():
        title(header, "-")
        row(f"Mean {short} (ms):", result[f"mean_{key}_ms"], ".2f")
        row(f"Median {short} (ms):", result[f"median_{key}_ms"], ".2f")
        for p in percentiles:
            row(f"P{_pct_key(p)} {short} (ms):", result[f"p{_pct_key(p)}_{key}_ms"], ".2f")
    lines.append("=" * 50)
    errs = [e for e in result.get("errors", []) if e]
    if errs:
        distinct: dict[str, int] = {}
        for e in errs:
            distinct[e] = distinct.get(e, 0) + 1
        lines.append(f"Errors ({len(errs)} failed requests, {len(distinct)} distinct):")
        for e, n in sorted(distinct.items(), key=lambda kv: -kv[1])[:5]:
            lines.append(f"  [{n}x] {e[:200]}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Prompt sampling
# --------------------------------------------------------------------------------------------


@dataclass
class SampledRequest:
    prompt: Any  # list[int] (token-ids) or str (text)
    prompt_len: int
    output_len: int
    extra_body: dict[str, Any] | None = None  # e.g. a response_format (--json-schema-ratio)


# --json-schema-ratio: an unbounded string field, so the grammar does not end the output before
# --random-output-len (ignore_eos keeps the lengths equal to the unconstrained requests').
BENCH_JSON_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def mark_json_schema(reqs: list[SampledRequest], ratio: float, seed: int) -> int:
    """Give a seeded random share `ratio` of the requests a json_schema response_format; returns how many."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError("--json-schema-ratio must be in [0, 1]")
    rng = np.random.default_rng(seed + 2)
    chosen = rng.permutation(len(reqs))[: round(ratio * len(reqs))]
    fmt = {"type": "json_schema", "json_schema": {"name": "bench", "schema": BENCH_JSON_SCHEMA}}
    for i in chosen.tolist():
        reqs[i].extra_body = {"response_format": fmt}
    return len(chosen)


def sample_lengths(
    rng: np.random.Generator, num: int, length: int, range_ratio: float, minimum: int = 1
) -> np.ndarray:
    """vLLM's RandomDataset rule: integers uniform in [floor(L*(1-r)), ceil(L*(1+r))], 0 <= r < 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1) (vLLM's definition)")
    low = max(math.floor(length * (1 - range_ratio)), minimum)
    high = max(math.ceil(length * (1 + range_ratio)), low)
    return rng.integers(low, high + 1, size=num)


def _allowed_token_ids(tokenizer: Any, vocab_size: int | None) -> np.ndarray:
    if tokenizer is None:
        if not vocab_size:
            raise ValueError("--tokenizer none needs --vocab-size")
        return np.arange(vocab_size, dtype=np.int64)
    n = vocab_size or tokenizer.vocab_size
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    ids = np.asarray([i for i in range(n) if i not in special], dtype=np.int64)
    if ids.size == 0:
        raise ValueError("tokenizer has no non-special token ids")
    return ids


def _text_prompt(
    tokenizer: Any, allowed: np.ndarray, rng: np.random.Generator, content_len: int, max_iters: int = 16
) -> tuple[str, int]:
    """Random text whose (special-token-free) encoding is exactly ``content_len`` tokens if possible.

    Returns the text and its token count as the server would see it (with special tokens).
    """
    ids = rng.choice(allowed, size=content_len).tolist()
    text = ""
    for _ in range(max_iters):
        text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        enc = tokenizer.encode(text, add_special_tokens=False)
        if len(enc) == content_len:
            break
        if len(enc) > content_len:
            ids = enc[:content_len]
        else:
            ids = enc + rng.choice(allowed, size=content_len - len(enc)).tolist()
    return text, len(tokenizer.encode(text, add_special_tokens=True))


def sample_random_requests(
    tokenizer: Any,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    prompt_format: str = "token-ids",
    vocab_size: int | None = None,
) -> list[SampledRequest]:
    """Seeded random prompts.  token-ids: exactly the sampled length; text: re-encoded to it."""
    rng = np.random.default_rng(seed)
    allowed = _allowed_token_ids(tokenizer, vocab_size)
    if prompt_format == "token-ids":
        in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    elif prompt_format == "text":
        if tokenizer is None:
            raise ValueError("--prompt-format text needs a tokenizer")
        n_special = int(tokenizer.num_special_tokens_to_add())
        in_lens = sample_lengths(rng, num_prompts, max(input_len - n_special, 1), range_ratio)
    else:
        raise ValueError(f"unknown prompt format {prompt_format!r}")
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    reqs: list[SampledRequest] = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        if prompt_format == "token-ids":
            ids = rng.choice(allowed, size=n_in).tolist()
            reqs.append(SampledRequest(prompt=ids, prompt_len=n_in, output_len=n_out))
        else:
            text, n = _text_prompt(tokenizer, allowed, rng, n_in)
            reqs.append(SampledRequest(prompt=text, prompt_len=n, output_len=n_out))
    return reqs


# --------------------------------------------------------------------------------------------
# HTTP client
# --------------------------------------------------------------------------------------------


class ClientPool:
    """Hands each in-flight request its own ``httpx.AsyncClient`` (hence its own keep-alive connection).

    httpcore 1.0.x's connection pool rescans every connection whenever a request starts or ends
    (O(connections x queued requests), encode/httpcore#1035), so one shared client with a few hundred
    concurrent streams adds seconds to TTFT and bunches chunks (ITL) (measured here: 256 streams took
    ~9-14 s instead of ~2.5 s).  Idle clients are reused, so open TCP connections never exceed the
    peak concurrency, and a client is never shared by two requests at once.  A single SSL context is
    shared by all clients (building one per client costs ~30 ms).

    raw: (host, port) of a plain-http server: the streams go over RawConnections instead (--http-client raw).
    """

    def __init__(self, timeout: Any, raw: tuple[str, int] | None = None) -> None:
        import httpx

        self._httpx = httpx
        self._timeout = timeout
        self._raw = raw
        make_ctx = getattr(httpx, "create_ssl_context", None)  # httpx >= 0.28; else per-client contexts
        self._verify: Any = make_ctx() if make_ctx is not None else True
        self._free: list[Any] = []
        self._all: list[Any] = []
        self.in_use = 0
        self.peak_in_use = 0

    def reserve(self, n: int) -> None:
        """Pre-build clients (about 0.5 ms each) so a burst does not pay for it inside the timed run."""
        self._free[:0] = [self._new() for _ in range(n - len(self._all))]

    def acquire(self) -> Any:
        self.in_use += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return self._free.pop() if self._free else self._new()

    def _new(self) -> Any:
        if self._raw is not None:
            conn = RawConnection(*self._raw, connect_timeout=self._timeout.connect)
            self._all.append(conn)
            return conn
        client = self._httpx.AsyncClient(
            timeout=self._timeout,
            limits=self._httpx.Limits(max_connections=4, max_keepalive_connections=1),
            trust_env=False,  # never route loopback benchmarks through an environment proxy
            verify=self._verify,
        )
        self._all.append(client)
        return client

    def release(self, client: Any) -> None:
        self.in_use -= 1
        self._free.append(client)

    @property
    def size(self) -> int:
        return len(self._all)

    async def send(self, url: str, model: str, req: SampledRequest, **kw: Any) -> RequestRecord:
        client = self.acquire()
        try:
            if self._raw is not None:
                return await send_request_raw(client, urlsplit(url).path, model, req,
                                              timeout=self._timeout.read, **kw)
            return await send_request(client, url, model, req, **kw)
        finally:
            self.release(client)

    async def aclose(self) -> None:
        for c in self._all:
            await c.aclose()
        self._all.clear()
        self._free.clear()


def _headers(api_key: str | None) -> dict[str, str]:
    key = api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _error_of(data: Any) -> str | None:
    if isinstance(data, dict):
        if data.get("error"):
            return f"stream error: {json.dumps(data['error'])[:500]}"
        if data.get("object") == "error":
            return f"stream error: {data.get('message', data)}"
    return None


def _payload(model: str, req: SampledRequest, extra_body: dict[str, Any] | None) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if extra_body:
        payload.update(extra_body)
    if req.extra_body:
        payload.update(req.extra_body)
    return payload


def _sse_line(rec: RequestRecord, text_parts: list[str], line: str, now: float) -> bool:
    """One line of the event stream, received at `now`, into the record; True when it ended the request
    with an error (recorded)."""
    line = line.strip()
    if not line or line.startswith(":") or not line.startswith("data:"):
        return False
    chunk = line[len("data:") :].strip()
    if chunk == "[DONE]":
        return False
    data = json.loads(chunk)
    err = _error_of(data)
    if err:
        rec.error = err
        return True
    for choice in data.get("choices") or []:
        text = choice.get("text")
        if text:
            rec.chunk_times.append(now)
            text_parts.append(text)
            break
    usage = data.get("usage")
    if usage:
        if usage.get("completion_tokens") is not None:
            rec.output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            rec.usage_prompt_tokens = int(usage["prompt_tokens"])
    return False


async def send_request(
    client: Any,
    url: str,
    model: str,
    req: SampledRequest,
    extra_body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> RequestRecord:
    """One streaming completion; never raises (errors land in the record)."""
    payload = _payload(model, req, extra_body)
    rec = RequestRecord(prompt_len=req.prompt_len, expected_output_len=req.output_len)
    text_parts: list[str] = []
    rec.send_time = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:500]}"
                return rec
            async for line in resp.aiter_lines():
                if _sse_line(rec, text_parts, line, time.perf_counter()):
                    return rec
        rec.end_time = time.perf_counter()
        if rec.chunk_times:
            rec.success = True
        else:
            rec.error = "Never received a chunk with text in the stream"
    except Exception as e:  # noqa: BLE001 - any failure is a failed request, never a crashed run
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    finally:
        rec.generated_text = "".join(text_parts)
    return rec


class RawConnection:
    """One keep-alive HTTP/1.1 connection to a plain-http server, for the streaming POSTs (--http-client raw).

    httpx/httpcore cost about as much CPU per received chunk as the server spends producing it (a timeout
    scope, a task lookup and a pause/resume of the socket reader per read), so at tens of thousands of
    events per second the client was the bottleneck; this reads the chunked body with asyncio streams
    directly. The metrics are unchanged: every SSE line is timestamped when it is read, as with httpx."""

    def __init__(self, host: str, port: int, connect_timeout: float) -> None:
        self.host, self.port, self.connect_timeout = host, port, connect_timeout
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> None:
        try:
            self.reader, self.writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, limit=1 << 20), self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as e:
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {e}") from e

    async def aclose(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
        """Send the request and read the status and headers; the body is then read with body()."""
        if self.writer is None or self.writer.is_closing() or self.reader.at_eof():
            await self.aclose()
            await self._connect()
        head = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Content-Type: application/json",
                f"Content-Length: {len(body)}", "Accept: */*"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        try:
            raw = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            # A kept-alive connection the server closed meanwhile: once more on a fresh one.
            await self.aclose()
            await self._connect()
            self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
            raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = {}
        for line in lines[1:]:
            if line:
                k, _, v = line.partition(":")
                fields[k.strip().lower()] = v.strip()
        self._headers = fields
        return status, fields

    async def body(self) -> AsyncIterator[bytes]:
        """The response body as it arrives (chunked, Content-Length or until the server closes)."""
        fields, reader = self._headers, self.reader
        keep = fields.get("connection", "").lower() != "close"
        if "chunked" in fields.get("transfer-encoding", "").lower():
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":
                        pass  # trailers
                    break
                data = await reader.readexactly(size + 2)
                yield data[:-2]
        elif "content-length" in fields:
            yield await reader.readexactly(int(fields["content-length"]))
        else:  # delimited by the server closing the connection
            while data := await reader.read(1 << 16):
                yield data
            keep = False
        if not keep:
            await self.aclose()


class ConnectError(OSError):
    """The raw client could not connect (httpx's ConnectError, same name in the records)."""


async def send_request_raw(
    conn: RawConnection,
    path: str,
    model: str,
    req: SampledRequest,
    extra_body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float | None = None,
) -> RequestRecord:
    """send_request over a RawConnection; never raises (errors land in the record). timeout: seconds for
    the whole request (None: none)."""
    body = json.dumps(_payload(model, req, extra_body)).encode()
    rec = RequestRecord(prompt_len=req.prompt_len, expected_output_len=req.output_len)
    text_parts: list[str] = []
    rec.send_time = time.perf_counter()
    try:
        await asyncio.wait_for(_stream_raw(conn, path, body, headers or {}, rec, text_parts), timeout)
    except Exception as e:  # noqa: BLE001 - any failure is a failed request, never a crashed run
        await conn.aclose()
        if isinstance(e, asyncio.IncompleteReadError):
            e = RemoteProtocolError("the server closed the connection mid-response")
        elif isinstance(e, asyncio.TimeoutError):
            e = ReadTimeout(f"no complete response within {timeout:g} s")
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    finally:
        rec.generated_text = "".join(text_parts)
    return rec


async def _stream_raw(conn: RawConnection, path: str, body: bytes, headers: dict[str, str], rec: RequestRecord,
                      text_parts: list[str]) -> None:
    status, _ = await conn.post(path, body, headers)
    if status != 200:
        data = b"".join([part async for part in conn.body()])
        rec.error = f"HTTP {status}: {data.decode('utf-8', errors='replace')[:500]}"
        return
    pending = b""
    async for part in conn.body():
        now = time.perf_counter()
        lines = (pending + part).split(b"\n")
        pending = lines.pop()
        for line in lines:
            if _sse_line(rec, text_parts, line.decode("utf-8"), now):
                await conn.aclose()  # the rest of the body is unread
                return
    if pending and _sse_line(rec, text_parts, pending.decode("utf-8"), time.perf_counter()):
        return
    rec.end_time = time.perf_counter()
    if rec.chunk_times:
        rec.success = True
    else:
        rec.error = "Never received a chunk with text in the stream"


class RemoteProtocolError(Exception):
    """The server broke off the response (httpx's name for it)."""


class ReadTimeout(Exception):
    """--request-timeout passed (httpx's name for it)."""


async def _arrivals(
    requests: Sequence[SampledRequest], rate: float, burstiness: float, rng: np.random.Generator
) -> AsyncIterator[SampledRequest]:
    """Yield requests with gamma-distributed gaps (burstiness 1 = Poisson); rate inf = no gaps."""
    for i, req in enumerate(requests):
        yield req
        if math.isinf(rate) or i == len(requests) - 1:
            continue
        theta = 1.0 / (rate * burstiness)
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))


async def fetch_model_id(client: Any, base_url: str, headers: dict[str, str]) -> str:
    resp = await client.get(f"{base_url.rstrip('/')}/v1/models", headers=headers)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no models; pass --model")
    return data[0]["id"]


def _is_this_host(base_url: str) -> bool:
    import ipaddress
    import socket

    host = urlsplit(base_url).hostname or ""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def fetch_server_info(client: Any, base_url: str, headers: dict[str, str]) -> dict:
    """The server's /server_info ({} when it has none: not a duet or SGLang server)."""
    try:
        resp = await client.get(f"{base_url.rstrip('/')}/server_info", headers=headers)
        info = resp.json() if resp.status_code == 200 else {}
    except Exception:  # noqa: BLE001 - not a duet server
        return {}
    return info if isinstance(info, dict) else {}


def served_model_path(info: dict, base_url: str) -> str | None:
    """The model folder the server serves, from its /server_info; None when the server is on another host,
    does not say, or the folder is not here."""
    if not _is_this_host(base_url):
        return None
    args = info.get("args")
    path = args.get("model_path") if isinstance(args, dict) else None
    return path if isinstance(path, str) and os.path.isdir(path) else None


def load_tokenizer(name_or_path: str | None, trust_remote_code: bool = False) -> Any:
    if name_or_path is None or name_or_path.lower() == "none":
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)


# --------------------------------------------------------------------------------------------
# CLI / driver
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_serving",
        description="Benchmark an OpenAI-compatible server with streaming /v1/completions requests "
        "(vLLM metric definitions).",
    )
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help="server root (default %(default)s)")
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT, help="completions path (default %(default)s)")
    p.add_argument("--model", default=None, help="model name to send; default: first of GET /v1/models")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer folder (or hub id); default: the model folder named by the server's "
        "/server_info when the server runs on this host, else the model name. "
        "'none' = random ids in [0, --vocab-size) (token-ids format only)",
    )
    p.add_argument("--vocab-size", type=int, default=None, help="vocab size for --tokenizer none")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="mean arrivals per second (Poisson unless --burstiness); inf = all at once",
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival gaps; 1 = Poisson"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [floor(L*(1-r)), ceil(L*(1+r))], 0 <= r < 1 (vLLM's definition)",
    )
    p.add_argument(
        "--prompt-format",
        choices=("token-ids", "text"),
        default="token-ids",
        help="send the sampled token ids (exact input length) or their decoded text",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json-schema-ratio",
        type=float,
        default=0.0,
        help="share of requests sent with a json_schema response_format (structured outputs), 0 to 1",
    )
    p.add_argument(
        "--http-client",
        choices=("raw", "httpx"),
        default="raw",
        help="raw: a lean HTTP/1.1 reader on asyncio streams (plain http; httpx's per-chunk CPU made the "
        "client the bottleneck at tens of thousands of events/s); httpx: httpx (https too)",
    )
    p.add_argument("--num-warmups", type=int, default=1, help="untimed requests before the run")
    p.add_argument(
        "--metric-percentiles", default="99", help="comma-separated percentiles to report, e.g. 50,90,99"
    )
    p.add_argument("--request-timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY if set)")
    p.add_argument("--label", default=None, help="free-form label stored in the JSON (used by plot.py)")
    p.add_argument("--output-file", default=None, help="write the result JSON here")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def _with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    full = build_parser().parse_args([])
    for k, v in vars(args).items():
        setattr(full, k, v)
    return full


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by ``args``; print the table, write --output-file, return the dict."""
    import httpx
    from tqdm import tqdm

    args = _with_defaults(args)
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (inf for all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    percentiles = [float(p) for p in str(args.metric_percentiles).split(",") if p.strip()]
    base_url = args.base_url.rstrip("/")
    url = base_url + args.endpoint
    headers = _headers(args.api_key)

    timeout = httpx.Timeout(args.request_timeout, connect=60.0)
    raw = None
    if args.http_client == "raw":
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError(f"--http-client raw speaks plain http only; use --http-client httpx for {base_url}")
        raw = (parts.hostname, parts.port or 80)
    pool = ClientPool(timeout, raw)
    try:
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as meta_client:
            model = args.model or await fetch_model_id(meta_client, base_url, headers)
            # Default: the folder the server on this host loads (its /server_info), else the model name
            # (vLLM reports the served path; a hub id is tried from the local cache).
            server_info = await fetch_server_info(meta_client, base_url, headers)
        tok_name = args.tokenizer or served_model_path(server_info, base_url) or model
        try:
            tokenizer = load_tokenizer(tok_name, args.trust_remote_code)
        except Exception as e:
            raise SystemExit(
                f"could not load tokenizer {tok_name!r} ({type(e).__name__}: {e}); "
                "pass --tokenizer PATH, or --tokenizer none --vocab-size N"
            ) from e

        requests = sample_random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
            args.prompt_format,
            args.vocab_size,
        )
        num_json_schema = mark_json_schema(requests, args.json_schema_ratio, args.seed)

        if args.num_warmups > 0:
            warm = await asyncio.gather(
                *[
                    pool.send(url, model, requests[i % len(requests)], headers=headers)
                    for i in range(args.num_warmups)
                ]
            )
            if not any(w.success for w in warm):
                raise RuntimeError(f"warm-up request failed, is the server up? {warm[0].error}")

        # Peak concurrency is at most this; Poisson runs may need fewer (unused clients hold no socket).
        pool.reserve(min(args.num_prompts, args.max_concurrency or args.num_prompts, MAX_RESERVED_CLIENTS))
        arrival_rng = np.random.default_rng(args.seed + 1)
        print(
            f"Benchmarking {url} model={model} prompts={len(requests)} rate={args.request_rate} "
            f"max_concurrency={args.max_concurrency} format={args.prompt_format}",
            file=sys.stderr,
        )
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        pbar = tqdm(total=len(requests), disable=args.disable_tqdm)

        async def one(req: SampledRequest) -> RequestRecord:
            if sem is None:
                rec = await pool.send(url, model, req, headers=headers)
            else:
                async with sem:
                    rec = await pool.send(url, model, req, headers=headers)
            pbar.update(1)
            return rec

        tasks: list[asyncio.Task[RequestRecord]] = []
        pool.peak_in_use = pool.in_use
        start = time.perf_counter()
        cpu_start = time.process_time()
        async for req in _arrivals(requests, args.request_rate, args.burstiness, arrival_rng):
            tasks.append(asyncio.create_task(one(req)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        client_cpu_s = time.process_time() - cpu_start
        pbar.close()
        max_concurrent = pool.peak_in_use
    finally:
        await pool.aclose()

    metrics = compute_metrics(records, duration, percentiles)
    rate = args.request_rate
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "label": args.label,
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model": model,
        "model_id": model,
        "tokenizer": tok_name,
        "tokenizer_id": tok_name,
        "prompt_format": args.prompt_format,
        "num_prompts": args.num_prompts,
        "request_rate": rate if not math.isinf(rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "seed": args.seed,
        "num_warmups": args.num_warmups,
        "json_schema_ratio": args.json_schema_ratio,
        "num_json_schema_requests": num_json_schema,
        "max_concurrent_requests": max_concurrent,
        "http_client": args.http_client,
        # Benchmark-client CPU time over the run; near 1.0 x duration means the (single-threaded)
        # client, not the server, may be limiting throughput and inflating TTFT/ITL.
        "client_cpu_s": client_cpu_s,
        "client_cpu_util": client_cpu_s / duration if duration > 0 else 0.0,
        "prompt_len_mismatches": sum(
            1 for r in records if r.success and r.usage_prompt_tokens not in (None, r.prompt_len)
        ),
        # What the server captured and how it split its memory (duet's /server_info), so the serving
        # numbers carry the graph sizes and KV slots they were measured with.
        "server_scheduler_info": server_info.get("scheduler_info"),
    }
    result.update(metrics)
    # Text events per output token: 1 when the server streams every token as its own event, less when tokens
    # that queued in the server went out together (ITL is per event, as in vLLM's bench; TPOT per token).
    result["text_chunks_per_output_token"] = sum(len(r.chunk_times) for r in records if r.success) / max(
        1, metrics["total_output_tokens"])
    print(format_result_table(result, percentiles))
    if result["client_cpu_util"] > CLIENT_CPU_WARN:
        print(
            f"WARNING: the benchmark client used {100 * result['client_cpu_util']:.0f}% of a CPU core; "
            "it may be the bottleneck (lower the concurrency, or run several clients).",
            file=sys.stderr,
        )
    if args.output_file:
        write_result(result, args.output_file)
    return result


def write_result(result: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    return asyncio.run(run_benchmark(args))


if __name__ == "__main__":
    main()
