"""The frontend process: an aiohttp + uvloop server speaking OpenAI's HTTP API.

It parses and validates requests (frontend/protocol.py), hands them to the tokenizer
workers, and streams the detokenizer's text back as JSON or server-sent events. It never
touches token ids or the model, so it stays responsive whatever the engine is doing.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import uvloop
from aiohttp import web

from frontend.engine_client import EngineClient, RequestStream
from frontend.protocol import ApiError, ModelNames, Plan, parse_chat, parse_completion
from frontend.responses import SSE_DONE, Choice, Formatter, UsageCounter, sse
from ipc.messages import Drain, EngineInfo, TextDelta
from ipc.process import ParentLink, StartupError
from ipc.sockets import SocketPaths

logger = logging.getLogger(__name__)
_json = msgspec.json.Encoder()
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class FrontendOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The launcher flags the frontend needs."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_request_bytes: int = 16 * 2**20
    num_tokenizer_workers: int = 1


def json_response(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


class Frontend:
    """Server state and the HTTP handlers. Ready once the launcher sends EngineInfo."""

    def __init__(self, options: FrontendOptions, client: EngineClient):
        self.options = options
        self.client = client
        self.info: EngineInfo | None = None
        self.models: ModelNames | None = None
        self.draining = False
        self.inflight = 0
        self.started = int(time.time())
        self.stopped = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones

    # ---- lifecycle

    def on_engine_info(self, info: EngineInfo, link: ParentLink) -> None:
        self.info = info
        self.models = ModelNames([self.options.served_model_name or info.model_name])
        self.spawn(self.client.receive_forever())
        link.ready()

    def spawn(self, coro: Awaitable) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, give the in-flight ones up to `timeout` s, then stop."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.inflight:
            logger.warning("shutdown timeout: %d requests still in flight", self.inflight)
        self.stopped.set()

    # ---- routes

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/health", self.health),
            web.get("/ready", self.ready),
            web.get("/v1/models", self.list_models),
            web.get("/v1/server_info", self.server_info),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
        ]

    async def health(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        if self.info is None or self.draining:
            return json_response({"status": "draining" if self.draining else "loading"}, status=503)
        return json_response({"status": "ready"})

    async def list_models(self, request: web.Request) -> web.Response:
        info, models = self._serving()
        data = [
            {"id": name, "object": "model", "created": self.started, "owned_by": "sluice",
             "root": info.model_dir, "max_model_len": info.max_model_len}
            for name in models.names
        ]
        return json_response({"object": "list", "data": data})

    async def server_info(self, request: web.Request) -> web.Response:
        """Live counters for operators and tests: engine pages, in-flight requests, workers."""
        info, models = self._serving()
        try:
            engine = await self.client.stats()
        except asyncio.TimeoutError:
            raise ApiError(503, "the scheduler did not answer in time", type="server_error") from None
        workers = {str(w): self.client.worker_counts.get(w, 0) for w in range(self.options.num_tokenizer_workers)}
        return json_response({
            "model": models.primary, "max_model_len": info.max_model_len,
            "requests_in_flight": self.inflight, "tokenizer_workers": workers, "engine": engine,
        })

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat, "chatcmpl-")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion, "cmpl-")

    # ---- generation

    def _serving(self) -> tuple[EngineInfo, ModelNames]:
        if self.info is None or self.models is None:
            raise ApiError(503, "the model is still loading", type="server_error")
        return self.info, self.models

    async def _generate(self, request: web.Request, parse: Callable[[bytes, ModelNames], Plan],
                        prefix: str) -> web.StreamResponse:
        _, models = self._serving()
        if self.draining:
            raise ApiError(503, "the server is shutting down", type="server_error")
        plan = parse(await request.read(), models)
        rid = prefix + uuid.uuid4().hex
        for i, prompt in enumerate(plan.prompts):
            prompt.rid = f"{rid}-{i}" if len(plan.prompts) > 1 else rid
        fmt = Formatter(plan.kind, rid, plan.model)
        self.inflight += 1
        stream = self.client.open(plan.prompts, plan.n)
        try:
            if plan.stream:
                return await self._stream(request, plan, stream, fmt)
            return await self._complete(stream, fmt)
        finally:
            self.client.close(stream)  # aborts anything unfinished: the client left, or an error
            self.inflight -= 1

    async def _complete(self, stream: RequestStream, fmt: Formatter) -> web.Response:
        choices = [Choice(i) for i in range(stream.num_choices)]
        usage = UsageCounter()
        while not stream.finished:
            for delta in await stream.next():
                _apply(choices[stream.choice_index(delta)], delta, usage)
        return json_response(fmt.full(choices, usage))

    async def _stream(self, request: web.Request, plan: Plan, stream: RequestStream,
                      fmt: Formatter) -> web.StreamResponse:
        batch = await stream.next()  # an early error (say, context length) is still a JSON 400
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        choices = [Choice(i) for i in range(stream.num_choices)]
        usage = UsageCounter()
        head = [sse(fmt.role_chunk(c.index)) for c in choices] if plan.kind == "chat" else []
        while True:
            chunks = head
            for delta in batch:
                choice = choices[stream.choice_index(delta)]
                _apply(choice, delta, usage)
                chunks.append(sse(fmt.chunk(choice, delta)))
            await resp.write(b"".join(chunks))
            head = []
            if stream.finished:
                break
            try:
                batch = await stream.next()
            except ApiError as exc:  # too late for a status code: report it in the stream
                await resp.write(sse(exc.body()))
                break
        if plan.include_usage:
            await resp.write(sse(fmt.usage_chunk(usage)))
        await resp.write(SSE_DONE)
        await resp.write_eof()
        return resp


def _apply(choice: Choice, delta: TextDelta, usage: UsageCounter) -> None:
    choice.texts.append(delta.text)
    if delta.logprobs:
        choice.logprobs.extend(delta.logprobs)
    if delta.finish_reason is not None:
        choice.finish_reason = delta.finish_reason
        usage.add(delta)


# ---------------------------------------------------------------- middlewares


def error_middleware() -> Callable:
    """Every failure leaves as an OpenAI-style JSON error; nothing takes the server down."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable]) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return json_response(exc.body(), status=exc.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return json_response(ApiError(exc.status, exc.text or exc.reason).body(), status=exc.status)
        except Exception:
            logger.exception("%s %s failed", request.method, request.path)
            error = ApiError(500, "internal server error", type="server_error")
            return json_response(error.body(), status=500)

    return middleware


def auth_middleware(api_key: str) -> Callable:
    """Every /v1/ call must carry `Authorization: Bearer <api_key>`."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable]) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return await handler(request)

    return middleware


def build_app(frontend: Frontend) -> web.Application:
    middlewares = [error_middleware()]
    if frontend.options.api_key:
        middlewares.append(auth_middleware(frontend.options.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=frontend.options.max_request_bytes)
    app.add_routes(frontend.routes())
    return app


# ---------------------------------------------------------------- process entry


async def serve(link: ParentLink, options: FrontendOptions, paths: SocketPaths) -> None:
    frontend = Frontend(options, EngineClient(paths))
    runner = web.AppRunner(build_app(frontend), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, options.host, options.port).start()
    except OSError as exc:
        raise StartupError(f"cannot listen on {options.host}:{options.port}: {exc.strerror or exc}") from exc
    logger.info("listening on http://%s:%d", options.host, options.port)
    loop = asyncio.get_running_loop()

    def on_message(msg: Any) -> None:  # runs on the link's thread
        if isinstance(msg, EngineInfo):
            loop.call_soon_threadsafe(frontend.on_engine_info, msg, link)
        elif isinstance(msg, Drain):
            loop.call_soon_threadsafe(lambda: frontend.spawn(frontend.drain(msg.timeout)))

    link.set_handler(on_message)
    await frontend.stopped.wait()
    await runner.cleanup()


def run_frontend(link: ParentLink, options: FrontendOptions, paths: SocketPaths) -> None:
    """Process entry: serve HTTP until the launcher says drain."""
    uvloop.run(serve(link, options, paths))
