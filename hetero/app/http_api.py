"""The server's routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`,
`/metrics` (Prometheus) and `/stats` (the same live numbers as JSON, for `hetero monitor`).

Each generation route tokenizes, checks the request against the model and the context,
submits a sequence to the engine loop and relays its tokens, as one reply or as SSE chunks
ending in `data: [DONE]`. A stream whose client goes away cancels its sequence.
"""
from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from hetero.app import prom
from hetero.app.engine_loop import QueueFull, Request, StepFailed
from hetero.app.protocol import (ChatRequest, CompletionRequest, Sampling, StopFilter, chat_chunk, chat_reply,
                                 completion_chunk, completion_reply, error_body, new_id, usage)
from hetero.errors import UserError

if TYPE_CHECKING:
    from hetero.app.serve import ServerState

RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, param, code), headers


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="hetero", docs_url=None, redoc_url=None, openapi_url=None)
    registry = prom.make_registry(state.live)
    _handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if state.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        engine = _engine(state)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "hetero", "max_model_len": engine.ctx_size}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(prom.render(registry), media_type=prom.CONTENT_TYPE)

    @app.get("/stats")
    async def stats() -> dict:
        return state.live.snapshot()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HttpRequest) -> Response:
        engine = _engine(state)
        if engine.tok is None:
            raise ApiError(400, "this model has no tokenizer or chat template: use /v1/completions with token ids")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = await asyncio.to_thread(engine.tok.apply_chat_template, messages)
        except Exception as e:  # noqa: BLE001 - a template's own errors (e.g. roles out of order)
            raise ApiError(400, f"the chat template refused these messages: {e}", param="messages") from e
        return await _generate(state, http, body, ids, chat=True,
                               max_tokens=body.max_completion_tokens or body.max_tokens)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest) -> Response:
        engine = _engine(state)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) > 1:
                raise ApiError(400, f"got {len(prompt)} prompts: send one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if engine.tok is None:
                raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
            ids = await asyncio.to_thread(engine.tok.encode, prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < engine.cfg.vocab_size]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0–{engine.cfg.vocab_size - 1})",
                               param="prompt")
        return await _generate(state, http, body, ids, chat=False, max_tokens=body.max_tokens)

    return app


def _engine(state: ServerState):
    if state.engine is None:
        raise ApiError(503, "the model is still loading: retry when GET /health answers 200",
                       type_="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
    return state.engine


async def _generate(state: ServerState, http: HttpRequest, body: Sampling, ids: list[int], chat: bool,
                    max_tokens: int | None) -> Response:
    engine = state.engine
    if body.model is not None and body.model not in (state.model_name, engine.info.get("model")):
        raise ApiError(404, f"the model `{body.model}` does not exist here: this server serves `{state.model_name}` "
                            f"(GET /v1/models)", param="model", code="model_not_found")
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt" if not chat else "messages")
    if len(ids) + 1 > engine.ctx_size:
        raise ApiError(400, f"this model's maximum context length is {engine.ctx_size} tokens, but the prompt has "
                            f"{len(ids)} tokens (and the answer needs at least 1 more): shorten the prompt, or start "
                            f"the server with a larger --ctx-size", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
    room = engine.ctx_size - len(ids)
    max_new = min(room, max_tokens or state.opts.max_new_tokens or room)
    try:
        seq = engine.sequence(ids, ignore_eos=body.ignore_eos, max_new_tokens=max_new, **body.params())
    except UserError as e:
        raise ApiError(400, str(e)) from e
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def deliver(item) -> None:  # on the engine thread
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutting down)
            pass

    req = Request(seq, deliver)
    try:
        state.loop.submit(req)
    except StepFailed as e:
        raise ApiError(500, str(e), type_="server_error") from e
    except QueueFull as e:
        raise ApiError(503, f"the server is busy: {e}; retry later", type_="service_unavailable",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from e
    rid = new_id("chatcmpl" if chat else "cmpl")
    pieces = _pieces(state, req, queue, StopFilter(body.stops()))
    if body.stream:
        return StreamingResponse(_sse(state, req, pieces, rid, chat, body.include_usage, len(ids)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    collect = asyncio.ensure_future(_collect(pieces))
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():  # the client went away (or the server stops): pieces' finally cancels the sequence
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)
    if collect.cancelled():
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    try:
        text, finish, n = collect.result()
    except StepFailed as e:
        raise ApiError(500, str(e), type_="server_error") from e
    reply = chat_reply if chat else completion_reply
    return JSONResponse(reply(rid, state.model_name, text, finish, usage(len(ids), n)))


async def _collect(pieces) -> tuple[str, str, int]:
    text, finish, n = [], "stop", 0
    try:
        async for piece, finish, n in pieces:
            text.append(piece)
    finally:
        await pieces.aclose()
    return "".join(text), finish, n


async def _disconnected(http: HttpRequest, every_s: float = 0.5) -> None:
    """Returns once the client of a (non-streamed) request has closed its connection."""
    while not await http.is_disconnected():
        await asyncio.sleep(every_s)


async def _pieces(state: ServerState, req: Request, queue: asyncio.Queue,
                  stops: StopFilter) -> AsyncIterator[tuple[str, str | None, int]]:
    """(text, finish reason or None, tokens so far) per token; the sequence is cancelled if this ends early."""
    n, finished = 0, False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, StepFailed):
                finished = True
                raise item
            n += 1
            text = stops.push(item.text)
            if stops.hit:
                finished = True
                state.loop.cancel(req, reason="stop")
                yield text, "stop", n
                return
            if item.finish_reason is not None:
                finished = True
                yield text + stops.flush(), item.finish_reason, n
                return
            yield text, None, n
    finally:
        if not finished:
            state.loop.cancel(req)


async def _sse(state: ServerState, req: Request, pieces, rid: str, chat: bool, include_usage: bool,
               prompt_tokens: int) -> AsyncIterator[str]:
    model = state.model_name
    n = 0
    try:
        if chat:
            yield _data(chat_chunk(rid, model, {"role": "assistant", "content": ""}))
        async for text, finish, n in pieces:
            if text:
                yield _data(chat_chunk(rid, model, {"content": text}) if chat else completion_chunk(rid, model, text))
            if finish is not None:
                yield _data(chat_chunk(rid, model, {}, finish) if chat else completion_chunk(rid, model, "", finish))
        if include_usage:
            use = usage(prompt_tokens, n)
            yield _data(chat_chunk(rid, model, {}, use=use) if chat else completion_chunk(rid, model, "", use=use))
    except StepFailed as e:
        yield _data(error_body(str(e), "server_error"))
    finally:
        await pieces.aclose()  # a client that went away: its sequence is cancelled here
    yield "data: [DONE]\n\n"


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body, status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg, param = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
        elif not loc:
            msg, param = f"the body must be a JSON object: {first.get('msg', 'invalid')}", None
        else:
            got = first.get("input")
            shown = "" if first.get("type") == "missing" else f" (got {json.dumps(got, default=str)[:80]})"
            msg, param = f"{'.'.join(loc)}: {first.get('msg', 'invalid')}{shown}", loc[0]
        return JSONResponse(error_body(msg, param=param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def crash(_, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), status_code=500)
