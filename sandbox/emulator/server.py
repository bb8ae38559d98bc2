"""One emulated vLLM server: vLLM's OpenAI-compatible HTTP API on one address.

Like vLLM, the server listens only once the model is "loaded" (after the configured load delay):
before that a connection is refused, so `/health`, `/v1/models` and any probe fail. Responses
have vLLM's shapes (ids, `usage`, `prompt_tokens_details.cached_tokens`, SSE chunks ending with
`data: [DONE]`, the usage chunk of `stream_options.include_usage`) and its errors (`400` for a
context that is too long, `404` for an unknown model, `401` without the API key).

Output is made-up words, one per token, `max_tokens` of them (an emulated model never emits an
end-of-sequence token). A client that disconnects does not abort its request: the engine
finishes it as if someone were still reading.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from cacheroute.sandbox.emulator import tokens as tok
from cacheroute.sandbox.emulator.args import COMPLETIONS_DEFAULT_MAX_TOKENS, VLLM_VERSION, EmulatorConfig
from cacheroute.sandbox.emulator.engine import EngineRequest, RealtimeEngine
from cacheroute.sandbox.emulator.metrics import CONTENT_TYPE, EngineMetrics

LogSink = Callable[[str], None]
_DUMPS = json.JSONEncoder(separators=(",", ":")).encode


class RequestError(Exception):
    """A request vLLM would refuse; becomes an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


def _error(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.Response(status=status, text=_DUMPS(body), content_type="application/json")


def _positive_int(body: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(400, f"{name} must be a positive integer, got {value!r}")
        return int(value)
    return None


def _prompt_tokens(prompt: Any) -> list[str]:
    """The tokens of a completions prompt: text, a one-element list of text, or token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tok.words(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [str(t) for t in prompt]
    if isinstance(prompt, list):
        raise RequestError(400, "the emulator serves one prompt per request (got a batch of prompts)")
    raise RequestError(400, "prompt must be a string, a list with one string, or a list of token ids")


class Emulator:
    """One pod's vLLM server on `address:config.port`, served from the running loop."""

    def __init__(self, config: EmulatorConfig, address: str, *, log: LogSink | None = None) -> None:
        self.config = config
        self.address = address
        self._log = log or logging.getLogger("cacheroute.sandbox.emulator").info
        self.engine: RealtimeEngine | None = None
        self.metrics: EngineMetrics | None = None
        self._runner: web.AppRunner | None = None
        self._starting: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()
        self.failed: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.config.port}"

    def log(self, message: str, level: str = "INFO") -> None:
        self._log(f"{level} {time.strftime('%m-%d %H:%M:%S')} [emulator] {message}")

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        """Begin "loading"; the server listens once the load delay has passed."""
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._start(), name=f"emulator {self.url}")
        return self._starting

    async def _start(self) -> None:
        config = self.config
        self.log(f"vLLM emulator {VLLM_VERSION} serving {config.model} (profile {config.profile.name})")
        for note in config.notes:
            self.log(note)
        engine = RealtimeEngine(config.profile, config.block_size, on_first=self._scheduled, on_finish=self._done)
        self.engine = engine
        self.metrics = EngineMetrics(
            config,
            running=lambda: engine.running,
            waiting=lambda: engine.waiting,
            kv_usage=engine.kv_usage,
        )
        if config.load_delay_s > 0:
            self.log(f"Loading model weights (emulated: {config.load_delay_s:.1f} s)")
            await asyncio.sleep(config.load_delay_s)
        self.log(f"GPU KV cache size: {config.kv_capacity_tokens:,} tokens")
        self.log(
            f"Maximum concurrency for {config.max_model_len:,} tokens per request: "
            f"{config.kv_capacity_tokens / config.max_model_len:.2f}x"
        )
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ping", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.address, config.port, reuse_address=True).start()
        except OSError as exc:
            await runner.cleanup()
            self.failed = exc
            self.log(f"cannot listen on {self.url}: {exc}", "ERROR")
            raise
        self._runner = runner
        self.log(f"Starting vLLM API server 0 on {self.url}")
        self.ready.set()

    async def stop(self) -> None:
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        if self.engine is not None:
            self.engine.close()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
            self.log("Shutting down the API server")

    # -- engine callbacks ------------------------------------------------------------------------

    def _scheduled(self, request: EngineRequest) -> None:
        if self.metrics is not None:
            self.metrics.scheduled(request.input_tokens, request.cached_tokens)

    def _done(self, request: EngineRequest) -> None:
        if self.metrics is not None:
            self.metrics.finished(
                generated=request.output_tokens,
                ttft_s=request.first_token_at - request.arrival,
                e2e_s=request.finished_at - request.arrival,
                queue_s=request.scheduled_at - request.arrival,
                reason=request.finish_reason,
            )

    # -- plain endpoints -------------------------------------------------------------------------

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def _models(self, request: web.Request) -> web.Response:
        denied = self._denied(request)
        if denied is not None:
            return denied
        created = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": self.config.model,
                "parent": None,
                "max_model_len": self.config.max_model_len,
            }
            for name in self.config.served_model_names
        ]
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, _request: web.Request) -> web.Response:
        assert self.metrics is not None
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # -- generation ------------------------------------------------------------------------------

    def _denied(self, request: web.Request) -> web.Response | None:
        key = self.config.api_key
        if key is None or request.headers.get("Authorization") == f"Bearer {key}":
            return None
        return _error(401, "Unauthorized", "AuthenticationError")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json(loads=json.loads)
        except ValueError:
            raise RequestError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in self.config.served_model_names:
            raise RequestError(404, f"The model `{model}` does not exist.", "NotFoundError")
        if body.get("n", 1) != 1:
            raise RequestError(400, "the emulator serves n=1 only")
        return body

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        denied = self._denied(request)
        if denied is not None:
            return denied
        try:
            body = await self._body(request)
            if "prompt" not in body:
                raise RequestError(400, "prompt is required")
            prompt = _prompt_tokens(body["prompt"])
            max_tokens = _positive_int(body, "max_tokens") or COMPLETIONS_DEFAULT_MAX_TOKENS
            return await self._generate(request, body, prompt, max_tokens, chat=False)
        except RequestError as exc:
            return _error(exc.status, exc.message, exc.kind)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        denied = self._denied(request)
        if denied is not None:
            return denied
        try:
            body = await self._body(request)
            messages = body.get("messages")
            if not isinstance(messages, list):
                raise RequestError(400, "messages must be a list")
            try:
                prompt = tok.words(tok.chat_prompt(messages))
            except ValueError as exc:
                raise RequestError(400, str(exc)) from None
            max_tokens = _positive_int(body, "max_completion_tokens", "max_tokens")
            return await self._generate(request, body, prompt, max_tokens, chat=True)
        except RequestError as exc:
            return _error(exc.status, exc.message, exc.kind)

    def _submit(self, prompt: list[str], max_tokens: int) -> EngineRequest:
        config = self.config
        engine = self.engine
        assert engine is not None
        n_in = len(prompt)
        if n_in == 0:
            raise RequestError(400, "the prompt is empty")
        if n_in + max_tokens > config.max_model_len:
            raise RequestError(
                400,
                f"This model's maximum context length is {config.max_model_len} tokens. However, you requested "
                f"{n_in + max_tokens} tokens ({n_in} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.",
            )
        blocks = tok.block_ids(prompt, config.block_size, shared=config.prefix_caching)
        if not engine.fits(len(blocks), max_tokens):
            raise RequestError(
                400, f"the request needs more KV cache than the server has ({config.kv_capacity_tokens} tokens)"
            )
        return engine.submit(blocks, n_in, max_tokens)

    async def _generate(
        self, request: web.Request, body: Mapping[str, Any], prompt: list[str], max_tokens: int | None, *, chat: bool
    ) -> web.StreamResponse:
        limit = max_tokens or self.config.default_chat_max_tokens
        reason = "length" if max_tokens else "stop"
        flight = self._submit(prompt, limit)
        flight.finish_reason = reason
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if body.get("stream"):
            options = body.get("stream_options") or {}
            usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
            return await self._stream(request, flight, ident, created, chat=chat, reason=reason, usage=usage)
        while not flight.finished:
            await flight.changed.wait()
            flight.changed.clear()
        text = tok.output_text(0, flight.output_tokens)
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text.lstrip(), "tool_calls": []},
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": None,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
        reply = {
            "id": ident,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.config.served_name,
            "choices": [choice],
            "usage": self._usage(flight),
        }
        return web.Response(text=_DUMPS(reply), content_type="application/json")

    def _usage(self, flight: EngineRequest) -> dict[str, Any]:
        return {
            "prompt_tokens": flight.input_tokens,
            "total_tokens": flight.input_tokens + flight.output_tokens,
            "completion_tokens": flight.output_tokens,
            "prompt_tokens_details": {"cached_tokens": flight.cached_tokens},
        }

    async def _stream(
        self,
        request: web.Request,
        flight: EngineRequest,
        ident: str,
        created: int,
        *,
        chat: bool,
        reason: str,
        usage: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        engine = self.engine
        assert engine is not None
        loop = asyncio.get_running_loop()
        model = self.config.served_name
        head = (
            f'{{"id":"{ident}","object":"{"chat.completion.chunk" if chat else "text_completion"}",'
            f'"created":{created},"model":{_DUMPS(model)},"choices":['
        )

        def chunk(text: str, finish: str | None, first: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            return f"data: {head}{_DUMPS(choice)}]}}\n\n".encode()

        sent = 0
        try:
            while not flight.started:
                await flight.changed.wait()
                flight.changed.clear()
            interval = self.config.stream_interval_s
            while True:
                produced = engine.tokens_at(flight, loop.time())
                done = produced >= flight.output_tokens and flight.finished
                if produced > sent or done:
                    text = tok.output_text(sent, produced - sent)
                    await response.write(chunk(text, reason if done else None, first=sent == 0))
                    sent = produced
                if done:
                    break
                wake = loop.call_later(interval, flight.changed.set)
                await flight.changed.wait()
                flight.changed.clear()
                wake.cancel()
            if usage:
                tail: dict[str, Any] = {
                    "id": ident,
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": self._usage(flight),
                }
                await response.write(f"data: {_DUMPS(tail)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            # The client went away; the engine keeps the request, as documented above.
            pass
        return response
