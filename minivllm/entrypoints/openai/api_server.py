"""The HTTP server: OpenAI's endpoints on an `AsyncLLM`, with FastAPI and uvicorn.

    minivllm serve --port 8000                   # then, from any OpenAI client:
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[...], stream=True)

    POST /v1/completions, /v1/chat/completions   generate (stream: true -> server-sent events)
    GET  /v1/models, /health, /metrics           what is served, is it alive, how is it doing
    POST /tokenize, /detokenize                  the model's tokenizer

Every error is a JSON body in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
and leaves the server as it was: 400 for a bad request (its message names the field), 401
without the API key, 404 for an unknown route or model, 413 for a body over the limit, 503
when too many requests already wait. The server binds the loopback address unless told
otherwise: it has no TLS and, without --api-key, no authentication.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError
from minivllm.entrypoints.openai.metrics import make_registry
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.openai.serving_engine import OpenAIError, cancel_on_disconnect

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
# A message such as "top_p must be > 0 and <= 1, got 0.0" names its field first.
FIELD_IN_MESSAGE = re.compile(r"^(\w+) must ")


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, /v1 and the tokenizer routes need "Bearer <key>"
    served_model_name: str | None = None  # default: the model directory's name
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_waiting_requests: int | None = 1024


# --- errors --------------------------------------------------------------------------------------


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.response().model_dump(), status_code=error.status)


def as_openai_error(error: Exception) -> OpenAIError:
    """The client-facing form of an error raised while starting a request."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, (ValueError, TypeError)):
        match = FIELD_IN_MESSAGE.match(str(error))
        return OpenAIError(400, str(error), param=match.group(1) if match else None)
    if isinstance(error, (EngineOverloadedError, EngineDeadError)):
        return OpenAIError(503, str(error))
    raise error


def validation_message(error: ValidationError) -> tuple[str, str | None]:
    """Pydantic's errors as one message, and the first offending field."""
    parts, param = [], None
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"])
        param = param or location or None
        parts.append(f"{location}: {item['msg']}" if location else item["msg"])
    return "; ".join(parts), param


async def read_request(raw_request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    """The body, parsed and type-checked: 413 over `limit` bytes (checked while reading, so a
    huge body is never held in memory), 400 for malformed JSON or wrong types."""
    declared = raw_request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise OpenAIError(413, f"the request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in raw_request.stream():
        body += chunk
        if len(body) > limit:
            raise OpenAIError(413, f"the request body is over the limit of {limit} bytes")
    try:
        return model.model_validate_json(bytes(body))
    except ValidationError as error:
        message, param = validation_message(error)
        raise OpenAIError(400, message, param) from None


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>`, on /v1 and the tokenizer routes; /health and
    /metrics stay open, as in vLLM, for load balancers and scrapers. (A plain ASGI middleware:
    it must not buffer streamed responses or hide a client's disconnect from them.)"""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        protected = path.startswith("/v1") or path in ("/tokenize", "/detokenize")
        if scope["type"] == "http" and protected:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(OpenAIError(401, "invalid or missing API key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# --- the app -------------------------------------------------------------------------------------


@dataclass
class ServerState:
    """What the routes serve from, one per app (`app.state.server`). The routes are module-level
    functions that look it up on each request rather than closures over an engine: FastAPI
    caches route functions process-wide, and a closure there would keep its engine (and its
    gigabytes) alive after the server stopped."""

    engine: AsyncLLM
    settings: ServerSettings
    model_name: str
    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    registry: CollectorRegistry


def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `engine` (which it does not own: the caller shuts it down)."""
    model_name = settings.served_model_name or Path(engine.model_path).name
    app = FastAPI(title="minivllm OpenAI-compatible server")
    app.state.server = ServerState(
        engine=engine,
        settings=settings,
        model_name=model_name,
        completions=OpenAIServingCompletion(engine, [model_name]),
        chat=OpenAIServingChat(engine, [model_name]),
        registry=make_registry(engine, model_name),
    )
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.include_router(router)
    return app


router = APIRouter()


def state_of(raw_request: Request) -> ServerState:
    return raw_request.app.state.server


async def openai_error(_: Request, error: OpenAIError) -> JSONResponse:
    return error_response(error)


async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
    return error_response(OpenAIError(error.status_code, str(error.detail)))


@router.get("/health")
async def health(raw_request: Request) -> Response:
    return Response(status_code=200 if state_of(raw_request).engine.is_running else 503)


@router.get("/v1/models")
async def models(raw_request: Request) -> ModelList:
    state = state_of(raw_request)
    card = ModelCard(
        id=state.model_name,
        root=str(state.engine.model_path),
        max_model_len=state.engine.max_model_len,
    )
    return ModelList(data=[card])


async def generate(raw_request: Request, request_type: type[BaseModel], serving) -> Response:
    limit = state_of(raw_request).settings.max_request_bytes
    request = await read_request(raw_request, request_type, limit)
    try:
        started = serving.start_request(request)
    except Exception as error:
        raise as_openai_error(error) from None
    if request.stream:
        # Starlette cancels the stream when the client disconnects; the generator's cleanup
        # then aborts the requests.
        return StreamingResponse(serving.stream(request, started), media_type="text/event-stream")
    response = await cancel_on_disconnect(raw_request, serving.respond(started))
    if response is None:
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(response.model_dump(mode="json"))


@router.post("/v1/completions")
async def create_completion(raw_request: Request) -> Response:
    return await generate(raw_request, CompletionRequest, state_of(raw_request).completions)


@router.post("/v1/chat/completions")
async def create_chat_completion(raw_request: Request) -> Response:
    return await generate(raw_request, ChatCompletionRequest, state_of(raw_request).chat)


@router.post("/tokenize")
async def tokenize(raw_request: Request) -> TokenizeResponse:
    state = state_of(raw_request)
    request = await read_request(raw_request, TokenizeRequest, state.settings.max_request_bytes)
    state.completions.check_model(request.model)
    try:
        if request.messages is not None:
            tokens = state.chat.chat_prompt_ids(request.messages, request.add_generation_prompt)
        elif request.prompt is not None:
            tokens = list(state.engine.tokenizer.encode(request.prompt))
        else:
            raise ValueError("give a prompt or messages")
    except (ValueError, TypeError) as error:
        raise as_openai_error(error) from None
    return TokenizeResponse(
        count=len(tokens), max_model_len=state.engine.max_model_len, tokens=tokens
    )


@router.post("/detokenize")
async def detokenize(raw_request: Request) -> DetokenizeResponse:
    state = state_of(raw_request)
    request = await read_request(raw_request, DetokenizeRequest, state.settings.max_request_bytes)
    state.completions.check_model(request.model)
    return DetokenizeResponse(prompt=state.engine.tokenizer.decode(request.tokens))


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    # Reading the engine's counters waits for the current step: off the event loop.
    text = await asyncio.to_thread(generate_latest, state_of(raw_request).registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


# --- running it ----------------------------------------------------------------------------------


def run_server(config: EngineConfig, settings: ServerSettings) -> None:
    """`minivllm serve`: load the engine, serve until Ctrl-C, shut the engine down."""
    engine = AsyncLLM.from_config(config, settings.max_waiting_requests)
    try:
        app = build_app(engine, settings)
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="info")
    finally:
        engine.shutdown()


def wait_until_healthy(base_url: str, timeout_s: float, is_alive: Callable[[], bool]) -> None:
    """Poll `GET /health` until it answers 200: RuntimeError if the server stops first
    (`is_alive()` turns false), TimeoutError after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_alive():
            raise RuntimeError("the server stopped while starting")
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"the server at {base_url} did not answer /health in {timeout_s} s")


class BackgroundServer:
    """A server in a thread of this process, on a free loopback port: for tests, notebooks and
    `bench serve` against an engine you built yourself.

        with BackgroundServer(AsyncLLM.from_config(config)) as server:
            openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    """

    def __init__(
        self,
        engine: AsyncLLM,
        settings: ServerSettings | None = None,
        startup_timeout_s: float = 60,
    ):
        self.engine = engine
        self.settings = settings or ServerSettings()
        # Binding port 0 here lets the OS pick a free port, with no race against other servers.
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((self.settings.host, 0))
        self.port = self.socket.getsockname()[1]
        self.base_url = f"http://{self.settings.host}:{self.port}"
        app = build_app(engine, self.settings)
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", timeout_keep_alive=30)
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )
        self.thread.start()
        wait_until_healthy(self.base_url, startup_timeout_s, self.thread.is_alive)

    def stop(self) -> None:
        """Stop serving and shut the engine down."""
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.socket.close()
        self.engine.shutdown()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
