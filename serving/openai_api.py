"""The OpenAI-compatible HTTP app: /v1/models, /v1/chat/completions, /v1/completions, /health and the chat page.

Answers stream as server-sent events in OpenAI's chunk shape, ending with `data: [DONE]`, or come
whole. Every refused request gets OpenAI's error shape with a 4xx status, never a traceback.
`usage.prompt_tokens_details.cached_tokens` and the `x-cached-tokens` / `x-prefilled-tokens`
headers tell how much of the prompt came from the prefix cache. A client that goes away cancels
its request before the engine's next step.
"""

import asyncio
import hmac
import json
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from .engine import Failed, Finished, Job, Started, Text
from .validation import ApiError, chat_generation, completion_generation, parse_body

CHAT_PAGE = Path(__file__).resolve().parent / "static" / "chat.html"


def error_response(error):
    return JSONResponse(error.body(), status_code=error.status)


async def read_body(request, max_bytes):
    """The request body, refused (413) once it passes max_bytes, before reading all of a huge one."""
    declared = request.headers.get("content-length")
    too_large = ApiError(413, f"request body over {max_bytes} bytes", code="body_too_large")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def usage(prompt_tokens, completion_tokens, cached_tokens):
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Shape:
    """How one endpoint words its answers: chat (message / delta) or text completion (text)."""

    def __init__(self, chat, model_name):
        self.chat, self.model_name = chat, model_name
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def envelope(self, choices, streaming, **extra):
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if streaming and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name,
                "choices": choices, **extra}

    def whole(self, text, reason, usage_fields):
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return self.envelope([{"index": 0, **body, "finish_reason": reason, "logprobs": None}], False,
                             usage=usage_fields)

    def chunk(self, text=None, reason=None, first=False):
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        return self.envelope([{**choice, "finish_reason": reason, "logprobs": None}], True)


def sse(payload):
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class Call:
    """One request in the engine, seen from the event loop: its events arrive in an asyncio queue."""

    def __init__(self, engine, generation):
        loop = asyncio.get_running_loop()
        self.events = asyncio.Queue()
        self.job = Job(prompt_ids=generation.prompt_ids, max_tokens=generation.max_tokens,
                       emit=lambda event: loop.call_soon_threadsafe(self.events.put_nowait, event),
                       temperature=generation.temperature, top_p=generation.top_p, seed=generation.seed,
                       stops=generation.stops)
        engine.submit(self.job)

    async def next_event(self, request):
        """The next event; cancels the job when the client disconnected while it waited."""
        while True:
            try:
                event = await asyncio.wait_for(self.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.job.cancelled.set()
                continue
            if isinstance(event, Failed):
                raise ApiError(500, event.message, code="generation_failed", kind="server_error")
            return event


def create_app(engine, tokenizer, limits, model_name, api_key=None, max_body_bytes=8 << 20):
    app = FastAPI(title="MiniMind", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request, error):
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request, error):
        code = "not_found" if error.status_code == 404 else None
        return error_response(ApiError(error.status_code, str(error.detail), code=code))

    @app.exception_handler(Exception)
    async def unexpected(request, error):
        return error_response(ApiError(500, f"internal error: {type(error).__name__}", kind="server_error"))

    @app.middleware("http")
    async def authorize(request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            if not hmac.compare_digest(header.encode(), f"Bearer {api_key}".encode()):
                return error_response(ApiError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                               code="invalid_api_key", kind="authentication_error"))
        return await call_next(request)

    @app.get("/")
    async def page():
        return FileResponse(CHAT_PAGE, media_type="text/html")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, **engine.stats}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "minimind",
                                            "context_length": limits.context}]}

    async def complete(request, parse, chat):
        generation = parse(parse_body(await read_body(request, max_body_bytes)), tokenizer, limits)
        call, shape = Call(engine, generation), Shape(chat, model_name)
        prompt_tokens = len(generation.prompt_ids)
        started = await call.next_event(request)
        headers = {"x-cached-tokens": str(started.cached_tokens),
                   "x-prefilled-tokens": str(prompt_tokens - started.cached_tokens)}
        if generation.stream:
            return StreamingResponse(stream(request, call, shape, generation, started.cached_tokens),
                                     media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"})
        pieces = []
        while not isinstance(event := await call.next_event(request), Finished):
            pieces.append(event.piece)
        fields = usage(prompt_tokens, event.completion_tokens, started.cached_tokens)
        return JSONResponse(shape.whole("".join(pieces), event.reason, fields), headers=headers)

    async def stream(request, call, shape, generation, cached_tokens):
        try:
            if shape.chat:
                yield sse(shape.chunk(first=True))
            while isinstance(event := await call.next_event(request), Text):
                yield sse(shape.chunk(event.piece))
            yield sse(shape.chunk(reason=event.reason))
            if generation.include_usage:
                yield sse(shape.envelope([], True, usage=usage(len(generation.prompt_ids), event.completion_tokens,
                                                               cached_tokens)))
        except ApiError as error:
            yield sse(error.body())
        finally:
            call.job.cancelled.set()  # the client left, or the job is over and this changes nothing
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat_generation, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, completion_generation, chat=False)

    return app
