"""An OpenAI chat-completions request body, checked field by field, as a `ReplyRequest`.

Every mistake is an `ApiError`: an HTTP status and one sentence naming the field and the fix,
which `app.api` sends as OpenAI's error object. Ranges are `DecodeSettings`' own checks, so the
API refuses exactly what the chat and the command line refuse. Fields that would change the
reply in a way this server cannot honour (n > 1, tools, penalties, logprobs) are refused;
others that only describe the caller (user, metadata, store) are ignored. Our own extra fields:
`mode`, `tree`, `drafter`, `acceptance`, `epsilon`, `delta`, `top_k`, and `draft_model` (the draft
model to load before the reply, or null for none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.engine import ReplyRequest
from core.decode.settings import ACCEPTANCE_RULES, MODES, DecodeSettings
from core.drafters.registry import DRAFTERS
from core.errors import UserError

SYSTEM_ROLES = ("system", "developer")  # joined into the system prompt
TURN_ROLES = ("user", "assistant")
REFUSED = {  # field → the value that means "not used"; anything else is refused
    "n": 1,
    "tools": None,
    "functions": None,
    "logprobs": False,
    "top_logprobs": None,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
}
SEEDS = (-(2**63), 2**64 - 1)  # what torch's generator takes (a negative seed wraps around, as in torch)
SHOWN = 60  # characters of a value echoed in an error message: a 100 KB value is not sent back whole
NAME_LENGTH = 1024  # the longest draft model name taken (a catalog id, a hub repo, a folder's path)


class ApiError(Exception):
    """A request the API answers with an OpenAI error object instead of a reply."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Call:
    request: ReplyRequest
    stream: bool  # server-sent events, one chunk per decoding step
    include_usage: bool  # streaming: a last chunk with the token counts (stream_options.include_usage)
    draft_model: str | None = None  # the draft model to reply with; "" none (JSON null); None: as loaded


def parse(body: object, model_id: str) -> Call:
    """The call a request body asks for; `model_id` is the model this server answers with."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object with 'model' and 'messages'.", None, "invalid_body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, f"'model' is required; this server answers with '{model_id}'.", "model", "missing_model")
    if model != model_id:
        raise ApiError(
            404, f"The model {_shown(model)} is not loaded here; use '{model_id}' (GET /v1/models lists it).",
            "model", "model_not_found",
        )  # fmt: skip
    for field, unused in REFUSED.items():
        value = body.get(field)
        if value not in (None, [], {}) and (value != unused or isinstance(value, bool) != isinstance(unused, bool)):
            raise ApiError(400, f"'{field}' is not supported here; leave it out.", field, "unsupported_parameter")
    messages, system = _messages(body.get("messages"))
    stream = _choice(body, "stream", (True, False), False)
    options = body.get("stream_options") or {}
    include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
    request = ReplyRequest(
        messages, _settings(body), system,
        mode=_choice(body, "mode", MODES, MODES[0]),
        tree=_text_field(body, "tree", ""),
        drafter=_choice(body, "drafter", ("", *DRAFTERS), ""),
        seed=_seed(body),
    )  # fmt: skip
    return Call(request, stream, include_usage, _draft_model(body))


def _messages(value: object) -> tuple[list[dict], str]:
    """The conversation (user and assistant turns) and the system prompt (system and developer messages)."""
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects.", "messages")
    turns, system = [], []
    for i, message in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{param} must be an object with 'role' and 'content'.", param)
        role = message.get("role")
        if role not in (*SYSTEM_ROLES, *TURN_ROLES):
            raise ApiError(
                400, f"{param} has role {_shown(role)}; use system, developer, user or assistant.", f"{param}.role"
            )
        content = _content(message.get("content"), f"{param}.content")
        if role in SYSTEM_ROLES:
            system.append(content)
        else:
            turns.append({"role": role, "content": content})
    if not turns or turns[-1]["role"] != "user":
        raise ApiError(
            400, "The last message must be the user's (role 'user'): it is what the reply answers.", "messages"
        )
    return turns, "\n\n".join(system)


def _content(value: object, param: str) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(value, str):
        return value
    parts = value if isinstance(value, list) else [None]
    if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        return "".join(p["text"] for p in parts)
    raise ApiError(
        400, f"{param} must be text (a string or a list of text parts); other content is not read here.", param
    )


def _settings(body: dict) -> DecodeSettings:
    """The decoding settings the body asks for; what it leaves out keeps DecodeSettings' defaults."""
    values: dict = {}
    for field in ("temperature", "top_p", "epsilon", "delta"):
        if body.get(field) is not None:
            values[field] = _number(body, field)
    if (top_k := _integer(body, "top_k")) is not None:
        values["top_k"] = top_k
    length = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if (limit := _integer(body, length)) is not None:
        values["max_new_tokens"] = limit
    if body.get("acceptance") is not None:
        values["acceptance"] = _choice(body, "acceptance", ACCEPTANCE_RULES, ACCEPTANCE_RULES[0])
    if body.get("stop") is not None:
        values["stop"] = _stop(body["stop"])
    for field, value in values.items():  # one at a time first, so an error names its field
        param = {"max_new_tokens": length}.get(field, field)
        try:
            DecodeSettings(**{field: value})
        except UserError as e:
            raise ApiError(400, str(e), param, "invalid_value") from None
    try:
        return DecodeSettings(**values)
    except UserError as e:
        raise ApiError(400, str(e), None, "invalid_value") from None


def _number(body: dict, field: str) -> float:
    value = body[field]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"'{field}' must be a finite number, got {_shown(value)}.", field, "invalid_type")
    return float(value)


def _integer(body: dict, field: str) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{field}' must be a whole number, got {_shown(value)}.", field, "invalid_type")
    return value


def _seed(body: dict) -> int | None:
    seed = _integer(body, "seed")
    if seed is not None and not SEEDS[0] <= seed <= SEEDS[1]:
        raise ApiError(400, "'seed' must be a whole number from -2**63 to 2**64 - 1.", "seed", "invalid_value")
    return seed


def _shown(value: object) -> str:
    """`value` as an error message quotes it, cut to SHOWN characters."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[: SHOWN - 1]}…"


def _choice(body: dict, field: str, choices: tuple, default: object) -> object:
    value = body.get(field)
    if value is None:
        return default
    if value not in choices or isinstance(value, bool) != isinstance(default, bool):
        names = ", ".join(repr(c) if c == "" else str(c).lower() for c in choices)
        raise ApiError(400, f"'{field}' must be one of {names}; got {_shown(value)}.", field, "invalid_value")
    return value


def _text_field(body: dict, field: str, default: str) -> str:
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ApiError(400, f"'{field}' must be a string, got {_shown(value)}.", field, "invalid_type")
    if len(value) > SHOWN:  # a name, which later messages quote whole
        raise ApiError(400, f"'{field}' must be a name, got {_shown(value)}.", field, "invalid_value")
    return value


def _draft_model(body: dict) -> str | None:
    """The draft model the body asks for: a name, "" for none (null), None where it names none."""
    if "draft_model" not in body:
        return None
    value = body["draft_model"]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ApiError(
            400, f"'draft_model' must be a model's name (a string) or null, got {_shown(value)}.", "draft_model",
            "invalid_type",
        )  # fmt: skip
    if len(value) > NAME_LENGTH:
        raise ApiError(
            400, f"'draft_model' must be a name of at most {NAME_LENGTH} characters, got {len(value):,}.",
            "draft_model", "invalid_value",
        )  # fmt: skip
    return value


def _stop(value: object) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 4:
        raise ApiError(400, "'stop' must be a string or a list of up to 4 strings.", "stop", "invalid_type")
    return tuple(stops)
