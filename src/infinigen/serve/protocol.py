"""The OpenAI request bodies this server takes (pydantic models, strict: an unknown field is refused) and its
error answers: `APIError`, OpenAI's error body, and the one 400 a body that does not validate gets."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from fastapi.responses import Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, field_validator
from pydantic_core import PydanticCustomError


# ---- request bodies ---------------------------------------------------------------------------------------
def _unicode(text: str) -> str:
    """JSON's \ud800 escapes decode to lone surrogates, which no tokenizer (or UTF-8 encoder) takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("invalid_unicode", "the text holds a lone surrogate (not valid Unicode)")
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # OpenAI refuses arguments it does not know; so do we


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None
    include_obfuscation: Optional[bool] = None  # accepted and ignored: padding against length side channels


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: Text

    @field_validator("type")
    @classmethod
    def _only_text(cls, v: str) -> str:
        if v != "text":
            raise PydanticCustomError("unsupported_content", "content parts of type '{t}' are not supported; only "
                                      "'text' parts are", {"t": v})
        return v


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients replay whole messages (name, refusal: null, ...)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[Text, list[TextPart]]


# OpenAI fields this server does not implement: refused (400 naming the field) unless null or their no-op value
UNSUPPORTED = {"tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
               "parallel_tool_calls": (), "response_format": ({"type": "text"},), "logit_bias": ({},),
               "presence_penalty": (0,), "frequency_penalty": (0,), "best_of": (1,), "suffix": ("",),
               "audio": (), "modalities": (["text"],), "prediction": (), "reasoning_effort": (),
               "web_search_options": ()}


class _Body(_Strict):
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    seed: Optional[int] = Field(None, ge=0, le=2 ** 63 - 1)
    stop: Union[Text, list[Text], None] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(None, ge=1, le=1)
    # accepted and ignored: they do not change the answer
    user: Optional[str] = None
    metadata: Optional[dict] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    # refused unless neutral (UNSUPPORTED)
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None


class CompletionBody(_Body):
    prompt: Union[Text, list[int], list[Text], list[list[int]]]
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=5)
    echo: Optional[bool] = None
    best_of: Any = None
    suffix: Any = None


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None


def _field_names(*models) -> frozenset:
    """Every field name of these body models and the models inside them (what an error's `param` may name)."""
    names, todo = set(), list(models)
    while todo:
        m = todo.pop()
        for name, f in m.model_fields.items():
            names.add(name)
            todo += [t for t in _types(f.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
    return frozenset(names)


def _types(tp) -> list:
    args = getattr(tp, "__args__", None) or ()
    return [tp] + [x for a in args for x in _types(a)]


FIELDS = _field_names(CompletionBody, ChatBody)


# ---- errors ------------------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                   headers: dict | None = None):
    # ASCII-escaped: a message quoting the client's text is sent whatever that text holds
    return Response(json.dumps(error_body(message, type_, param, code)), status_code=status,
                    media_type="application/json", headers=headers)


def validation_error(errors: list[dict]) -> APIError:
    """One 400 for a body that does not validate: the most specific error of the first field at fault. Its
    `param` is the path of field names and list indices (pydantic's union branch labels left out)."""
    if not errors:
        return APIError(400, "invalid request")

    def path(err):
        loc = [x for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "extra_forbidden":  # the unknown name itself is the last element
            return [x for x in loc[:-1] if isinstance(x, int) or x in FIELDS] + loc[-1:]
        return [x for x in loc if isinstance(x, int) or x in FIELDS]

    first = path(errors[0])[:1]
    err = max((e for e in errors if path(e)[:1] == first), key=lambda e: len(e.get("loc", ())))  # first of the deepest
    param = ".".join(str(x) for x in path(err)) or None
    if err.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    msg = err.get("msg", "invalid request")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code=err.get("type"))
