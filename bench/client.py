"""The benchmark client: streams requests to an OpenAI-compatible server and times each chunk.

Timing follows vLLM's ``endpoint_request_func`` with one stricter rule the seeds ask for: the
first token time (TTFT) is the first chunk whose text (``choices[0].text``, or
``choices[0].delta.content`` for chat) is non-empty; a leading role-only or empty chunk does not
count. Inter-token latencies (ITL) are the gaps between content chunks. E2E latency ends at the
last chunk with ``choices``. Output and prompt token counts come from the final ``usage`` chunk
(``stream_options.include_usage``); without one, the dataset's prompt length and the number of
content chunks stand in.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.datasets import SampleRequest
from bench.serve import CHAT
from services import clock


@dataclass
class RequestOutput:
    """What one request measured; times in seconds, ``start_time`` from the benchmark start."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0
    generated_text: str = ""


@dataclass
class RequestSettings:
    """Per-run request fields shared by every request."""

    base_url: str
    endpoint: str
    model: str
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_payload(req: SampleRequest, s: RequestSettings) -> dict[str, Any]:
    """The JSON body for ``req``; chat messages need the chat endpoint, text fits either."""
    body: dict[str, Any] = {
        "model": s.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": s.temperature,
    }
    if req.expected_output_len is not None:
        body["max_tokens"] = req.expected_output_len
    if s.ignore_eos:
        body["ignore_eos"] = True
    prompt = req.prompt
    is_messages = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    if s.endpoint == CHAT:
        if not is_messages:
            text = prompt if isinstance(prompt, str) else None
            if text is None:
                raise ValueError("token-id prompts need --endpoint /v1/completions")
            prompt = [{"role": "user", "content": text}]
        body["messages"] = prompt
    else:
        if is_messages:
            raise ValueError("chat messages need --endpoint /v1/chat/completions")
        body["prompt"] = prompt
    body.update(s.extra_body)
    return body


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or ""


async def send_request(
    client: httpx.AsyncClient, req: SampleRequest, s: RequestSettings, t0: float
) -> RequestOutput:
    """Stream one request; never raises for server or network errors (they go in ``error``)."""
    chat = s.endpoint == CHAT
    out = RequestOutput(prompt_len=req.prompt_len or 0)
    body = build_payload(req, s)
    st = clock.perf_counter()
    out.start_time = st - t0
    last_content = last_chunk = st
    usage: dict[str, Any] | None = None
    chunks = 0
    try:
        async with client.stream(
            "POST", s.base_url + s.endpoint, json=body, headers=s.headers
        ) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:300]
                out.error = f"HTTP {r.status_code}: {detail}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = clock.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"])[:300]
                    return out
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices")
                if not choices:
                    continue
                last_chunk = now
                text = _chunk_text(choices[0], chat)
                if not text:
                    continue
                if chunks == 0:
                    out.ttft = now - st
                else:
                    out.itl.append(now - last_content)
                last_content = now
                chunks += 1
                out.generated_text += text
    except (httpx.HTTPError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"[:300]
        return out
    out.latency = last_chunk - st
    if chunks == 0:  # nothing but empty text (e.g. one special token): first token at the end
        out.ttft = out.latency
    if usage is not None:
        out.output_tokens = int(usage.get("completion_tokens") or 0)
        # The server's count wins: it includes the chat template, which the client never sees.
        out.prompt_len = int(usage.get("prompt_tokens") or out.prompt_len)
    else:  # a server without include_usage: count content chunks, the best a client can do
        out.output_tokens = chunks
    out.success = True
    return out


def make_client(max_concurrency: int | None, timeout: float | None) -> httpx.AsyncClient:
    limits = httpx.Limits(
        max_connections=max_concurrency, max_keepalive_connections=max_concurrency
    )
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=30.0))


async def run_requests(
    client: httpx.AsyncClient,
    requests: list[SampleRequest],
    settings: RequestSettings,
    arrivals: list[float],
    max_concurrency: int | None,
    on_done: Any = None,
) -> tuple[list[RequestOutput], float]:
    """Send ``requests[i]`` at ``arrivals[i]`` s (after its parent finished), at most
    ``max_concurrency`` in flight. Returns the outputs in request order and the duration."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    done = [asyncio.Event() for _ in requests]
    t0 = clock.perf_counter()

    async def one(i: int) -> RequestOutput:
        try:
            wait = max(0.0, t0 + arrivals[i] - clock.perf_counter())
            await asyncio.sleep(clock.real_seconds(wait))
            parent = requests[i].parent
            if parent is not None:
                await done[parent].wait()
            if sem is None:
                out = await send_request(client, requests[i], settings, t0)
            else:
                async with sem:
                    out = await send_request(client, requests[i], settings, t0)
        finally:
            done[i].set()  # a failed turn must not stall the rest of its conversation
        if on_done is not None:
            on_done(out)
        return out

    outputs = await asyncio.gather(*(one(i) for i in range(len(requests))))
    return list(outputs), clock.perf_counter() - t0


async def fetch_models(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> list[str]:
    """The served model names from ``/v1/models``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = await client.get(base_url + "/v1/models", headers=headers)
    r.raise_for_status()
    return [m["id"] for m in r.json().get("data", [])]
