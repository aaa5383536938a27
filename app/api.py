"""OpenAI-compatible routes on the chat's own server: `POST /v1/chat/completions` and `GET /v1/models`.

A request becomes an `Engine.reply`, exactly like a chat turn, so it waits behind the replies
already queued on the engine's one compute thread (the chat's included) and never runs beside
them. A reply comes whole or, with `"stream": true`, as server-sent events: one chunk per
decoding step, then `data: [DONE]`. Every reply, and the last chunk with a `finish_reason`,
carries a `medusa` field with the speculation figures (and the draft model loaded). A request
whose `draft_model` differs from the loaded one loads it first (or none, for null), for every
reply after it too; one that does not load is a 400 and the draft model stays. Mistakes are
OpenAI error objects with a 4xx status (503 while the model loads), one sentence each, never a
traceback. A body must be sent as JSON (`app.guard`, around the server, has checked its host,
origin, key and size), and a reply whose client has gone away, whole or streamed, ends at its
next step.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterator

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.engine import Engine, NotReady, Reply, figures
from app.openai_request import ApiError, Call, parse
from core.decode.generate import Finished, StepEvent, collect
from core.errors import ContextExceeded, UserError
from models.draft_model import draft_name

log = logging.getLogger("medusa-chat")

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}  # ours → OpenAI's finish_reason
OWNER = "medusa-chat"
WATCH_SECONDS = 0.1  # how often a reply in progress asks whether its client is still there


def router(engine: Engine) -> APIRouter:
    api = APIRouter(prefix="/v1")

    @api.get("/models")
    def models() -> dict:
        """The model this server answers with (the one loaded, or loading)."""
        return {"object": "list", "data": [{"id": engine.model_id, "object": "model", "created": 0, "owned_by": OWNER}]}

    @api.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            call = parse(await _body(request), engine.model_id)
        except ApiError as e:
            return _error(e)
        stop = threading.Event()  # set when the client goes away: the reply ends at its next step
        # watched once the body is read (a watcher's receive would take its messages); streamed: `_sse` takes over
        watcher = asyncio.create_task(_watch(request, stop))
        try:
            if call.draft_model is not None and draft_name(call.draft_model) != engine.draft_model:
                await run_in_threadpool(_switch_draft, engine, call.draft_model)
            reply = await run_in_threadpool(engine.reply, call.request, stop.is_set)
            # the first step (the prefill) waits for this reply's turn; errors come before any byte is sent
            first = await run_in_threadpool(next, reply.events)
            events = itertools.chain([first], reply.events)
            completion = _Completion(engine.model_id, call, reply)
            if call.stream:
                return StreamingResponse(_sse(completion, events, stop), media_type="text/event-stream")
            steps, done = await run_in_threadpool(collect, events)
            return JSONResponse(completion.whole(steps, done))
        except ApiError as e:
            return _error(e)
        except UserError as e:
            return _error(_user_error(e))
        except Exception as e:
            return _error(_failure(e))
        finally:
            watcher.cancel()

    return api


async def _body(request: Request) -> object:
    """The request's JSON body: a JSON media type, valid UTF-8 and JSON, nested at most as deep as
    Python's parser goes, and no lone surrogate (valid JSON, but not text) anywhere in it."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(
            415, "The request body must be JSON sent as 'Content-Type: application/json'.", None,
            "unsupported_media_type",
        )  # fmt: skip
    try:
        body = json.loads(await request.body())
    except ValueError:  # not JSON, or not UTF-8
        raise ApiError(400, "The request body is not valid JSON; send a JSON object.", None, "invalid_json") from None
    except RecursionError:
        raise ApiError(400, "The request body is nested too deeply; send a flatter JSON object.", None,
                       "invalid_json") from None  # fmt: skip
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ApiError(
            400, "The request body holds a lone surrogate (such as \\ud800), which is not text; send valid Unicode.",
            None, "invalid_unicode",
        ) from None  # fmt: skip
    return body


async def _watch(request: Request, stop: threading.Event) -> None:
    """Set `stop` once the client has gone away (asked between steps, every WATCH_SECONDS): a reply
    nobody waits for, whole or streamed, ends at its next step instead of holding the queue."""
    while not await request.is_disconnected():
        await asyncio.sleep(WATCH_SECONDS)
    stop.set()


def _switch_draft(engine: Engine, name: str) -> None:
    """The engine's draft model switched to `name` (none for ""); a 400 naming the field if it does not load."""
    try:
        engine.set_draft_model(name)
    except NotReady:
        raise
    except UserError as e:
        raise ApiError(400, str(e), "draft_model", "invalid_value") from None


def _user_error(e: UserError) -> ApiError:
    if isinstance(e, NotReady):
        return ApiError(503, str(e), "model", "model_not_ready", "server_error")
    if isinstance(e, ContextExceeded):
        return ApiError(400, str(e), "messages", "context_length_exceeded")
    return ApiError(400, str(e), None, "invalid_value")


def _failure(e: Exception) -> ApiError:
    """Something that should not happen: logged with its traceback, one sentence for the caller."""
    log.exception("an API reply failed")
    return ApiError(500, f"The reply failed ({type(e).__name__}); details are in the log.", kind="server_error")


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class _Completion:
    """The OpenAI objects of one reply: a whole `chat.completion` or its `chat.completion.chunk`s."""

    def __init__(self, model: str, call: Call, reply: Reply) -> None:
        self.model, self.call, self.reply = model, call, reply
        self.id = f"chatcmpl-{secrets.token_hex(12)}"
        self.created = int(time.time())

    def whole(self, steps: list[StepEvent], done: Finished) -> dict:
        message = {"role": "assistant", "content": done.text}
        choice = {"index": 0, "message": message, "finish_reason": FINISH[done.finish_reason], "logprobs": None}
        head = self._head("chat.completion")
        return head | {"choices": [choice], "usage": self.usage(done), "medusa": self.figures(steps, done)}

    def chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage(self, done: Finished) -> dict:
        prompt, completion = len(self.reply.prompt_ids), len(done.token_ids)
        cached = {"cached_tokens": done.prompt_reused}  # OpenAI's name: the prompt tokens the kept cache held
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": cached}  # fmt: skip

    def figures(self, steps: list[StepEvent], done: Finished) -> dict:
        """The speculation figures: tokens per step, drafted tokens accepted at each step, speed, tree, drafter."""
        accepted = [e.accepted for e in steps]
        decode = accepted[1:]  # the prefill (step 1) drafts nothing
        request = self.call.request
        return figures(done) | {
            "accepted_per_step": accepted,
            "mean_accepted_per_step": sum(decode) / len(decode) if decode else 0.0,
            "mode": request.mode, "drafter": self.reply.drafter, "tree": self.reply.tree,
            "draft_model": self.reply.draft_model,
            "acceptance": request.settings.acceptance, "dropped_messages": self.reply.dropped,
        }  # fmt: skip

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


async def _sse(
    completion: _Completion, events: Iterator[StepEvent | Finished], stop: threading.Event
) -> AsyncIterator[str]:
    """Server-sent events: the role, one content delta per step, the finish with the figures, [DONE]."""
    yield _data(completion.chunk({"role": "assistant", "content": ""}))
    stops = completion.call.request.settings.stop
    hold = max(map(len, stops), default=1) - 1  # text that may still turn out to begin a stop string
    text, sent, steps = "", 0, []
    try:
        while True:
            item = await run_in_threadpool(next, events)
            if isinstance(item, Finished):
                break
            steps.append(item)
            text += item.text
            if any(s in text for s in stops):  # the reply ends here; the Finished text is cut before it
                continue
            if len(text) - hold > sent:
                yield _data(completion.chunk({"content": text[sent : len(text) - hold]}))
                sent = len(text) - hold
        if item.text[sent:]:  # what was held back, cut at a stop string, and the last characters
            yield _data(completion.chunk({"content": item.text[sent:]}))
        last = completion.chunk({}, FINISH[item.finish_reason]) | {"medusa": completion.figures(steps, item)}
        yield _data(last)
        if completion.call.include_usage:
            yield _data({**completion.chunk({}), "choices": [], "usage": completion.usage(item)})
    except Exception as e:  # after the first byte the status is sent: the error goes in the stream
        yield _data(_failure(e).body())
    finally:
        stop.set()  # the client left (or the reply ended): the compute thread moves on
    yield "data: [DONE]\n\n"


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
