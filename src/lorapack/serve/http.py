"""The twin server's HTTP API: vLLM's OpenAI-compatible routes on a Starlette app (``lorapack[serve]``).

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events, or not),
``/v1/models``, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set, as in vLLM), ``/tokenize``, ``/health``, ``/version``, ``/metrics``;
``/lorapack/probe`` (one server-sent event, no engine: the start-up HTTP-path probe's target).

The HTTP path: a client's TTFT against a real vLLM includes its API server's HTTP path, and so does the
profile's frontend share (``Profile.frontend``: fitted from what real clients saw). The twin server's own path
would count it twice, so at start-up the app streams ``PROBE_REQUESTS`` one-event responses to itself over
loopback (a keep-alive connection, as the benchmark clients use) and the median round trip is taken out of the
frontend share (``TwinServer.set_http_path_s``; ``--http-path-ms`` sets it instead, 0 turns it off). Requests
in the probe's first ~0.1 s see the whole share.
Errors are vLLM's JSON (``{"error": {"message", "type", "param", "code"}}``) with its status codes.

Prompt length: ``prompt_token_ids`` / a prompt given as token ids are exact; text goes through the
``--tokenizer`` when one is given, else the documented tokenizer-free count (``count_text_tokens``: one token
per 4 UTF-8 bytes, rounded up). A chat's prompt is its messages' contents plus ``CHAT_TOKENS_PER_MESSAGE``
tokens each (role markers of a chat template). The output text is synthetic (``TOKEN_TEXT``, one word per
token); its length is ``max_tokens`` (the twin has no end-of-sequence token: ``ignore_eos`` is accepted and
changes nothing) and its timing the twin's.

Safety: ``--api-key`` (Bearer token on ``/v1`` routes, as vLLM), a cap on the request body
(``max_body_bytes``), on ``max_tokens`` (``--max-model-len``), and on open connections (uvicorn's
``limit_concurrency``, set by the command). An adapter's path is a label: nothing is ever opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import __version__
from . import ARRIVAL_HEADER
from .metrics import TwinMetrics
from .twin import LoraModule, RequestStream, TwinServer, TwinServerError

CHAT_TOKENS_PER_MESSAGE = 4
TOKEN_TEXT = (" the", " twin", " says", " hello", " to", " you", " and", " waits")
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default (vLLM's too)
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
PROBE_PATH = "/lorapack/probe"
PROBE_REQUESTS = 40  # timed round trips of the start-up probe (after PROBE_WARMUP untimed ones)
PROBE_WARMUP = 10
PROBE_CONNECT_TIMEOUT_S = 30.0  # the server may take a while to listen on a loaded machine
PROBE_EVENT = b"data: {}\n\n"
log = logging.getLogger("lorapack.serve")


def count_text_tokens(text: str) -> int:
    """The tokenizer-free prompt length: one token per 4 UTF-8 bytes, rounded up (at least 1 for any text)."""
    return max(1, math.ceil(len(text.encode("utf-8")) / 4)) if text else 0


@dataclass
class HttpOptions:
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tokenizer: Callable[[str], int] | None = None  # text -> token count (--tokenizer); None: count_text_tokens
    allow_runtime_lora: bool | None = None  # None: from the environment, as vLLM
    http_path_ms: float | None = None  # the server's own HTTP path; None: measured by the start-up probe
    probe_address: tuple[str, int] | None = None  # where the server listens (None: no probe, path 0)


def error(message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "param": param, "code": status}},
                        status_code=status)


async def _json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise TwinServerError(f"request body of {int(declared)} bytes is over the limit of {max_bytes} bytes", 413,
                          "RequestEntityTooLarge")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise TwinServerError(f"request body over the limit of {max_bytes} bytes", 413, "RequestEntityTooLarge")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TwinServerError(f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise TwinServerError("the request body must be a JSON object")
    return data


def _int_field(data: dict, name: str, default: int | None) -> int | None:
    v = data.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TwinServerError(f"{name} {v!r}: expected an integer")
    return v


class TwinApp:
    """The Starlette app of one twin server (``app`` attribute)."""

    def __init__(self, twin: TwinServer, options: HttpOptions | None = None) -> None:
        self.twin = twin
        self.options = options or HttpOptions()
        self.metrics = TwinMetrics(twin)
        allow = self.options.allow_runtime_lora
        if allow is None:
            allow = os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true")
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/metrics", self.render_metrics, methods=["GET"]),
            Route(PROBE_PATH, self.probe, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]
        if allow:
            routes += [Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
                       Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"])]
        self.app = Starlette(routes=routes, lifespan=self._lifespan)
        if self.options.api_key:
            self.app.add_middleware(_ApiKey, key=self.options.api_key)
        self.app.add_middleware(_Received)  # outermost: the request's arrival is when its headers were read

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """The twin steps while the app runs; the HTTP-path probe runs once the server listens."""
        self.twin.start()
        probe = None
        opts = self.options
        if opts.http_path_ms is not None:
            self.twin.set_http_path_s(opts.http_path_ms / 1000.0)
        elif opts.probe_address is not None:
            probe = asyncio.get_running_loop().create_task(self._measure_http_path(*opts.probe_address))
        try:
            yield
        finally:
            if probe is not None:
                probe.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await probe
            await self.twin.stop()

    async def _measure_http_path(self, host: str, port: int) -> None:
        try:
            path_s = await measure_http_path_s(host, port)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            log.warning("the HTTP-path probe of %s:%d failed (%s): the frontend share is served whole",
                        host, port, exc)
            return
        self.twin.set_http_path_s(path_s)
        log.info("HTTP path %.2f ms (median of %d loopback round trips), taken out of the %.2f ms frontend share",
                 path_s * 1000, PROBE_REQUESTS, self.twin.frontend_s * 1000)

    async def probe(self, request: Request) -> Response:
        async def one_event() -> AsyncIterator[bytes]:
            yield PROBE_EVENT

        return StreamingResponse(one_event(), media_type="text/event-stream")

    # ---- small routes ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def version(self, request: Request) -> JSONResponse:
        twin = self.twin
        return JSONResponse({"version": twin.srv.vllm_version, "lorapack": __version__, "twin": True,
                             "time_scale": twin.time_scale, "model": twin.profile.model, "gpu": twin.profile.gpu,
                             "twin_now_s": twin.now_s(), "twin_lag": twin.lag_summary(),
                             "frontend_ms": twin.frontend_s * 1000, "http_path_ms": twin.http_path_s * 1000})

    async def render_metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> JSONResponse:
        twin = self.twin
        created = int(time.time())
        data = [{"id": twin.model_name, "object": "model", "created": created, "owned_by": "vllm",
                 "root": twin.profile.model, "parent": None, "max_model_len": int(twin.srv.max_model_len),
                 "permission": []}]
        for a in twin.adapters.by_name.values():
            data.append({"id": a.name, "object": "model", "created": int(a.created_s), "owned_by": "vllm",
                         "root": a.path, "parent": twin.model_name, "max_model_len": None, "permission": []})
        return JSONResponse({"object": "list", "data": data})

    async def tokenize(self, request: Request) -> JSONResponse:
        try:
            data = await _json_body(request, self.options.max_body_bytes)
            n = self._prompt_tokens(data)
        except TwinServerError as exc:
            return error(str(exc), exc.status, exc.err_type)
        return JSONResponse({"count": n, "max_model_len": int(self.twin.srv.max_model_len),
                             "tokens": list(range(n)), "token_strs": None})

    async def load_lora_adapter(self, request: Request) -> Response:
        try:
            data = await _json_body(request, self.options.max_body_bytes)
        except TwinServerError as exc:
            return error(str(exc), exc.status, exc.err_type)
        name, path = data.get("lora_name"), data.get("lora_path")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            return error("Both 'lora_name' and 'lora_path' must be provided.", 400, "InvalidUserInput")
        rank = data.get("rank")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            return error(f"rank {rank!r}: expected an integer >= 1 (a lorapack key: the adapter's LoRA rank)")
        try:
            self.twin.load_adapter(LoraModule(name=name, path=path, rank=rank))
        except TwinServerError as exc:
            return error(str(exc), exc.status, exc.err_type)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        try:
            data = await _json_body(request, self.options.max_body_bytes)
        except TwinServerError as exc:
            return error(str(exc), exc.status, exc.err_type)
        name = data.get("lora_name")
        if not name or not isinstance(name, str):
            return error("'lora_name' needs to be provided to unload a LoRA adapter.", 400, "InvalidUserInput")
        try:
            self.twin.unload_adapter(name)
        except TwinServerError as exc:
            return error(str(exc), exc.status, exc.err_type)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    # ---- generation -----------------------------------------------------------------------------

    def _count(self, text: str) -> int:
        return self.options.tokenizer(text) if self.options.tokenizer is not None else count_text_tokens(text)

    def _prompt_tokens(self, data: dict) -> int:
        """The prompt length of a completions / chat / tokenize body (module docstring)."""
        ids = data.get("prompt_token_ids")
        if ids is None and isinstance(data.get("prompt"), list) and data["prompt"] \
                and all(isinstance(x, int) and not isinstance(x, bool) for x in data["prompt"]):
            ids = data["prompt"]
        if ids is not None:
            if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
                raise TwinServerError("prompt_token_ids: expected a list of token ids")
            return len(ids)
        if "messages" in data:
            messages = data["messages"]
            if not isinstance(messages, list) or not messages:
                raise TwinServerError("messages: expected a non-empty list of messages")
            n = 0
            for m in messages:
                if not isinstance(m, dict) or "role" not in m:
                    raise TwinServerError("messages: each message needs a 'role' and a 'content'")
                content = m.get("content") or ""
                if isinstance(content, list):  # content parts: the text ones count
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                if not isinstance(content, str):
                    raise TwinServerError("messages: a message's content must be text")
                n += self._count(content) + CHAT_TOKENS_PER_MESSAGE
            return n
        prompt = data.get("prompt")
        if isinstance(prompt, list):
            if len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            else:
                raise TwinServerError("prompt: the twin server takes one prompt per request (a string or token ids)")
        if not isinstance(prompt, str):
            raise TwinServerError("prompt: expected a string or a list of token ids")
        return self._count(prompt)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        twin = self.twin
        try:
            data = await _json_body(request, self.options.max_body_bytes)
            model = data.get("model", twin.model_name)
            if not isinstance(model, str):
                raise TwinServerError(f"model {model!r}: expected a string")
            prompt_tokens = self._prompt_tokens(data)
            default = None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
            max_tokens = _int_field(data, "max_completion_tokens", None) if chat else None
            if max_tokens is None:
                max_tokens = _int_field(data, "max_tokens", default)
            n = _int_field(data, "n", 1)
            if n != 1:
                raise TwinServerError(f"n {n}: the twin server generates one choice per request")
            stream = bool(data.get("stream", False))
            opts = data.get("stream_options") or {}
            include_usage = bool(opts.get("include_usage", False)) if isinstance(opts, dict) else False
            twin.adapter_index(model)  # 404 before the length checks, as vLLM
            out_tokens = twin.check_lengths(prompt_tokens, max_tokens)
            s = twin.submit(model, prompt_tokens, out_tokens, request.scope.get(RECEIVED_KEY))
        except TwinServerError as exc:
            return error(str(exc), exc.status, exc.err_type)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        # when the request entered the engine, on this machine's monotonic clock (not a vLLM header): a client on
        # the same machine can simulate exactly the arrivals the twin served (bench/serve_fidelity.py)
        arrival = {ARRIVAL_HEADER: f"{twin.wall_at(s.t_arr_s):.6f}"}
        if stream:
            return StreamingResponse(self._sse(s, rid, created, chat, include_usage), media_type="text/event-stream",
                                     headers=arrival)
        try:
            while await s.tokens.get() is not None:
                pass
        finally:
            if not s.finished:
                twin.abort(s)
        text = "".join(TOKEN_TEXT[k % len(TOKEN_TEXT)] for k in range(s.produced))
        usage = {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.produced,
                 "total_tokens": s.prompt_tokens + s.produced}
        reason = "length" if s.produced >= s.max_tokens else "abort"
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            body = {"id": rid, "object": "chat.completion", "created": created, "model": s.model,
                    "choices": [choice], "usage": usage}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            body = {"id": rid, "object": "text_completion", "created": created, "model": s.model,
                    "choices": [choice], "usage": usage}
        return JSONResponse(body, headers=arrival)

    async def _sse(self, s: RequestStream, rid: str, created: int, chat: bool,
                   include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per token, the finish reason on the last, then usage and [DONE]."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": created, "model": s.model}

        def chunk(text: str | None, reason: str | None, first: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            return b"data: " + json.dumps({**head, "choices": [choice]}).encode() + b"\n\n"

        # the chunks of the tokens before the last differ only in their text: made once (5,000 tokens/s)
        token_chunks = [chunk(t, None) for t in TOKEN_TEXT]
        sent = 0
        try:
            if chat:
                yield chunk(None, None, first=True)
            while True:
                n_new = await s.tokens.get()
                if n_new is None:
                    break
                for _ in range(n_new):
                    k = sent % len(TOKEN_TEXT)
                    yield chunk(TOKEN_TEXT[k], "length") if sent + 1 == s.max_tokens else token_chunks[k]
                    sent += 1
            if include_usage:
                usage = {"prompt_tokens": s.prompt_tokens, "completion_tokens": sent,
                         "total_tokens": s.prompt_tokens + sent}
                yield b"data: " + json.dumps({**head, "choices": [], "usage": usage}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            if not s.finished:  # the client went away mid-stream: vLLM aborts the request
                self.twin.abort(s)


async def measure_http_path_s(host: str, port: int, n: int = PROBE_REQUESTS, warmup: int = PROBE_WARMUP) -> float:
    """Median wall seconds from sending a streamed request to ``PROBE_PATH`` to reading its one event, over one
    keep-alive loopback connection (raw HTTP/1.1: the probe's own client costs next to nothing)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PROBE_CONNECT_TIMEOUT_S
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            break
        except OSError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.01)
    body = b"{}"
    req = (f"POST {PROBE_PATH} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
           f"content-length: {len(body)}\r\n\r\n").encode() + body

    async def round_trip() -> float:
        t0 = time.perf_counter()
        writer.write(req)
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the headers
        size = int((await reader.readline()).strip(), 16)  # chunked transfer: the event's chunk
        await reader.readexactly(size + 2)
        took = time.perf_counter() - t0
        await reader.readuntil(b"0\r\n\r\n")  # the last chunk
        return took

    times: list[float] = []
    try:
        for k in range(warmup + n):
            took = await asyncio.wait_for(round_trip(), PROBE_CONNECT_TIMEOUT_S)
            if k >= warmup:
                times.append(took)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    times.sort()
    return times[len(times) // 2]


RECEIVED_KEY = "lorapack.received"  # ASGI scope key: time.monotonic() when the app got the request


class _Received:
    """Stamp each HTTP request with the time the server began to receive it (before its body is read and
    parsed): the twin's arrival time, as close as the server can see to when the client sent it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope[RECEIVED_KEY] = time.monotonic()
        await self.app(scope, receive, send)


class _ApiKey:
    """vLLM's ``--api-key``: every ``/v1`` route needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            if auth != self.expected:
                response = JSONResponse({"error": "Unauthorized"}, status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
