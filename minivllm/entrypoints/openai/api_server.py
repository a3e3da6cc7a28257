"""The HTTP server: OpenAI's endpoints on an `AsyncLLM`, with FastAPI and uvicorn.

    minivllm serve --port 8000                   # then, from any OpenAI client:
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[...], stream=True)

    POST /v1/completions, /v1/chat/completions   generate (stream: true -> server-sent events)
    GET  /v1/models, /health, /metrics           what is served, is it alive, how is it doing
    POST /tokenize, /detokenize                  the model's tokenizer

Every error is a JSON body in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
and leaves the server as it was: 400 for a bad request (its message names the field), 401
without the API key, 404 for an unknown route or model, 405 (with `Allow`) for a wrong method,
413 for a body over the limit, 503 when too many requests already wait (or the engine is
dead), 500 for a failure of ours; a stream that fails once started ends with an error event
and `[DONE]`. If the engine core dies, `minivllm serve` tells the open requests and exits
with an error, as vLLM's server does, for whatever supervises it to restart it. The routes
declare their request models, so `/openapi.json` documents every body and every error.

The model directory's generation_config.json gives the defaults of the sampling fields a
request leaves out (vLLM's `--generation-config auto`; "vllm" ignores it; or a folder).

The server binds the loopback address unless told otherwise: it has no TLS and, without
--api-key, no authentication.
"""

from __future__ import annotations

import asyncio
import logging
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
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM, EngineDeadError
from minivllm.entrypoints.openai.metrics import make_registry
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    RequestFieldError,
    SamplingRequest,
    TokenizeRequest,
    TokenizeResponse,
    declare_model_bounds,
)
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.openai.serving_engine import (
    OpenAIError,
    as_openai_error,
    cancel_on_disconnect,
    with_error_event,
)
from minivllm.models.loader import load_generation_defaults

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, /v1 and the tokenizer routes need "Bearer <key>"
    served_model_name: str | None = None  # default: the model directory's name
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_waiting_requests: int | None = 1024
    # "auto": the model directory's generation_config.json; "vllm": none; or a folder holding one
    generation_config: str = "auto"
    # The engine core in a process of its own (vLLM V1's design), or stepped in a thread here.
    engine_core_process: bool = True


def sampling_defaults(generation_config: str, model_path) -> dict:
    """The sampling defaults `--generation-config` names."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        defaults = load_generation_defaults(model_path)
    else:
        defaults = load_generation_defaults(generation_config, required=True)
    if defaults:
        logger.warning(
            "Default sampling parameters have been overridden by the model's generation "
            "config: %s. If this is not intended, start the server with --generation-config "
            "vllm.",
            defaults,
        )
    return defaults


# --- errors --------------------------------------------------------------------------------------


def error_response(error: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.response().model_dump(), status_code=error.status, headers=headers)


def validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """Pydantic's errors as one message, and the request field the first one is in (the
    location in the body without FastAPI's leading "body", its first part). A value our own
    validators refused (a RequestFieldError) keeps its message and field as they were raised."""
    parts, param = [], None
    for item in error.errors():
        loc = item["loc"][1:] if item["loc"][:1] == ("body",) else item["loc"]
        if item["type"] == "json_invalid":  # its location is a character position
            parts.append(f"Invalid JSON: {item['ctx']['error']} at character {loc[0]}")
            continue
        refused = item.get("ctx", {}).get("error")
        if isinstance(refused, RequestFieldError):
            param = param or refused.param
            parts.append(str(refused))
            continue
        location = ".".join(str(part) for part in loc)
        param = param or (str(loc[0]) if loc else None)
        message = str(refused) if isinstance(refused, ValueError) else item["msg"]
        parts.append(f"{location}: {message}" if location else message)
    return "; ".join(parts), param


class BodyLimitMiddleware:
    """413 for a request body over `limit` bytes, checked while it arrives (a huge body is
    never held in memory); the body is then handed on to the app as it came."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            message = f"the request body is {int(declared)} bytes; the limit is {self.limit}"
            await error_response(OpenAIError(413, message))(scope, receive, send)
            return
        body, first = bytearray(), None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                first = message  # the client left before sending it all
                break
            body += message.get("body", b"")
            if len(body) > self.limit:
                error = OpenAIError(
                    413, f"the request body is over the limit of {self.limit} bytes"
                )
                await error_response(error)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        first = first or {"type": "http.request", "body": bytes(body), "more_body": False}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()  # later: the disconnect the routes watch for

        await self.app(scope, replay, send)


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
    defaults = sampling_defaults(settings.generation_config, engine.model_path)
    # A body without a Content-Type is read as JSON, as OpenAI's and vLLM's servers do.
    app = FastAPI(title="minivllm OpenAI-compatible server", strict_content_type=False)
    app.state.server = ServerState(
        engine=engine,
        settings=settings,
        model_name=model_name,
        completions=OpenAIServingCompletion(engine, [model_name], defaults),
        chat=OpenAIServingChat(engine, [model_name], defaults),
        registry=make_registry(engine, model_name),
    )
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_request_bytes)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)
    app.include_router(router)
    app.openapi = lambda: served_openapi(app)
    return app


def served_openapi(app: FastAPI) -> dict:
    """FastAPI's schema with the bounds of the model served (its vocabulary and context), less
    the 422 it documents for every body: this server answers validation errors with OpenAI's
    400, which the routes document instead."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        schemas = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        serving = app.state.server.completions
        declare_model_bounds(schema, serving.vocab_size, serving.engine.max_model_len)
        app.openapi_schema = schema
    return app.openapi_schema


router = APIRouter()


def state_of(raw_request: Request) -> ServerState:
    return raw_request.app.state.server


async def openai_error(_: Request, error: OpenAIError) -> JSONResponse:
    return error_response(error)


async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
    # A 405 keeps its `Allow` header.
    return error_response(OpenAIError(error.status_code, str(error.detail)), error.headers)


async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    """A body that does not parse or fit the request model: OpenAI's 400 (FastAPI's default
    would be a 422 in its own shape)."""
    message, param = validation_message(error)
    return error_response(OpenAIError(400, message, param))


async def internal_error(_: Request, error: Exception) -> JSONResponse:
    return error_response(as_openai_error(error))


def documented(*statuses: int) -> dict:
    """The `responses=` of a route's errors, in OpenAI's error shape, so that /openapi.json
    describes everything the route may answer."""
    return {status: {"model": ErrorResponse} for status in statuses}


GENERATION_ERRORS = (400, 401, 404, 413, 500, 503)
TOKENIZER_ERRORS = (400, 401, 404, 413, 500)


def streamed(response_model, chunk_model) -> dict:
    """A generation route's 200: JSON, or server-sent events of chunks."""
    return {
        "model": response_model,
        "content": {"text/event-stream": {"schema": {"description": chunk_model.__name__}}},
    }


@router.get(
    "/health",
    response_class=Response,
    responses={
        200: {"description": "the engine is running"},
        503: {"description": "the engine is not running"},
    },
)
async def health(raw_request: Request) -> Response:
    return Response(status_code=200 if state_of(raw_request).engine.is_running else 503)


@router.get("/v1/models", responses=documented(401, 500))
async def models(raw_request: Request) -> ModelList:
    state = state_of(raw_request)
    card = ModelCard(
        id=state.model_name,
        root=str(state.engine.model_path),
        max_model_len=state.engine.max_model_len,
    )
    return ModelList(data=[card])


async def generate(raw_request: Request, request: SamplingRequest, serving) -> Response:
    try:
        started = serving.start_request(request)
    except Exception as error:
        raise as_openai_error(error) from None
    if request.stream:
        # Starlette cancels the stream when the client disconnects; the generator's cleanup
        # then aborts the requests.
        events = with_error_event(serving.stream(request, started))
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        response = await cancel_on_disconnect(raw_request, serving.respond(request, started))
    except Exception as error:
        raise as_openai_error(error) from None
    if response is None:
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(response.model_dump(mode="json"))


@router.post(
    "/v1/completions",
    responses={
        **documented(*GENERATION_ERRORS),
        200: streamed(CompletionResponse, CompletionResponse),
    },
)
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    return await generate(raw_request, request, state_of(raw_request).completions)


@router.post(
    "/v1/chat/completions",
    responses={
        **documented(*GENERATION_ERRORS),
        200: streamed(ChatCompletionResponse, ChatCompletionChunk),
    },
)
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    return await generate(raw_request, request, state_of(raw_request).chat)


@router.post("/tokenize", responses=documented(*TOKENIZER_ERRORS))
async def tokenize(request: TokenizeRequest, raw_request: Request) -> TokenizeResponse:
    state = state_of(raw_request)
    state.completions.check_model(request.model)
    try:
        if request.messages is not None:
            tokens = state.chat.chat_prompt_ids(request.messages, request.add_generation_prompt)
        else:
            tokens = list(state.engine.tokenizer.encode(request.prompt))
    except (ValueError, TypeError) as error:
        raise as_openai_error(error) from None
    return TokenizeResponse(
        count=len(tokens), max_model_len=state.engine.max_model_len, tokens=tokens
    )


@router.post("/detokenize", responses=documented(*TOKENIZER_ERRORS))
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> DetokenizeResponse:
    state = state_of(raw_request)
    state.completions.check_model(request.model)
    vocab_size = state.completions.vocab_size
    outside = [token for token in request.tokens if not 0 <= token < vocab_size]
    if outside:
        error = RequestFieldError(
            "tokens", f"tokens has ids outside the vocabulary [0, {vocab_size}): {outside[:5]}"
        )
        raise as_openai_error(error)
    return DetokenizeResponse(prompt=state.engine.tokenizer.decode(request.tokens))


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus' text format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        503: {"description": "the engine is not running"},
    },
)
async def metrics(raw_request: Request) -> Response:
    # Reading the engine's counters waits for the current step: off the event loop.
    text = await asyncio.to_thread(generate_latest, state_of(raw_request).registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


# --- running it ----------------------------------------------------------------------------------


# How often `minivllm serve` checks that its engine still runs (vLLM's watchdog: 5 s).
WATCHDOG_INTERVAL_S = 0.5
# How long a stopping server waits for its connections to close.
GRACEFUL_SHUTDOWN_S = 5


def run_server(config: EngineConfig, settings: ServerSettings) -> None:
    """`minivllm serve`: load the engine, serve until Ctrl-C, shut the engine down. If the
    engine core dies, the open requests end with an error, /health answers 503, and the
    server stops with EngineDeadError (as vLLM's does), for a supervisor to restart it,
    rather than answering 503 for ever."""
    engine = AsyncLLM.from_config(
        config, settings.max_waiting_requests, multiprocess=settings.engine_core_process
    )
    try:
        app = build_app(engine, settings)
        uvicorn_config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level="info",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        asyncio.run(serve_while_engine_runs(uvicorn.Server(uvicorn_config), engine))
    finally:
        engine.shutdown()


async def serve_while_engine_runs(server: uvicorn.Server, engine: AsyncLLM) -> None:
    """Serve until the server is stopped; raise EngineDeadError if it stopped because the
    engine died."""
    watchdog = asyncio.create_task(stop_when_engine_dies(server, engine))
    try:
        await server.serve()
    finally:
        watchdog.cancel()
    if not engine.is_running:
        raise EngineDeadError("the engine stopped, so the server did")


async def stop_when_engine_dies(server: uvicorn.Server, engine: AsyncLLM) -> None:
    while engine.is_running:
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
    logger.error("the engine is not running: stopping the server")
    server.should_exit = True


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
