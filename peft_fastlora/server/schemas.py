"""The request bodies the endpoint accepts, as pydantic models (strict: a string is no number, a
number no boolean; unknown fields are refused, as OpenAI's API refuses them).

Fields OpenAI defines that this server cannot honour are declared, so that a request using them
gets a 400 naming them (``unsupported_fields``) rather than an "unrecognized argument".
"""

from __future__ import annotations

from typing import Any, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import APIError



class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    """What completions and chat completions share."""

    model: str = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Optional[int] = Field(default=None, ge=-1)  # -1 or 0: no cut (vLLM's convention)
    n: int = Field(default=1, ge=1)
    seed: Optional[int] = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # declared so that they are refused by name (see unsupported_fields)
    logit_bias: Optional[Any] = None
    best_of: Optional[Any] = None
    response_format: Optional[Any] = None
    tools: Optional[Any] = None
    tool_choice: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    parallel_tool_calls: Optional[Any] = None
    repetition_penalty: Optional[Any] = None
    min_p: Optional[Any] = None

    def unsupported_fields(self) -> List[str]:
        out = []
        for name in ("logit_bias", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
                     "repetition_penalty", "min_p"):
            if getattr(self, name) not in (None, {}, []):
                out.append(name)
        if self.best_of is not None and self.best_of != self.n:
            out.append("best_of (other than n)")
        fmt = self.response_format
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            out.append("response_format (other than text)")
        return out

    def stop_strings(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: Optional[str] = None

    def unsupported_fields(self) -> List[str]:
        out = super().unsupported_fields()
        if self.echo:
            out.append("echo")
        if self.suffix:
            out.append("suffix")
        return out


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: Optional[str] = None


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, List[ContentPart]]
    name: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for i, part in enumerate(self.content):
            if part.type != "text":
                raise APIError(f"messages: content part {i} is of type {part.type!r}; this server takes text only",
                               param="messages")
            if part.text is None:
                raise APIError(f"messages: content part {i} is of type 'text' and has no text", param="messages")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)


class LoadAdapterRequest(_Strict):
    lora_name: str = Field(min_length=1, max_length=200)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadAdapterRequest(_Strict):
    lora_name: str = Field(min_length=1, max_length=200)
    lora_path: Optional[str] = None  # vLLM's clients may send it; not needed


def parse(model_cls, body: Any):
    """``model_cls`` validated from a decoded JSON body; a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError("the body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        raise _field_error(e.errors(include_url=False, include_input=False)) from None


def _field_error(errors: list) -> APIError:
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ())]
    # a union reports each alternative: name the field, not the alternative's type
    union = False
    while len(loc) > 1 and not loc[-1].isdigit() and loc[-1] not in _FIELD_NAMES:
        loc.pop()
        union = True
    where = ".".join(loc) or "body"
    kind = first.get("type", "")
    same = [e for e in errors if [str(p) for p in e.get("loc", ())][:len(loc)] == loc] if union else [first]
    if kind == "missing":
        message = f"{where} is required"
    elif kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {where}"
    elif union:
        message = _union_message(loc, same)
    else:
        message = f"{where}: {first.get('msg', 'invalid value')}"
    others = len(errors) - len(same)
    if others:
        message += f" (and {others} more problems)"
    return APIError(message, param=loc[0] if loc else None)


def _union_message(loc: List[str], errors: list) -> str:
    """One field that matched none of its forms: the forms, and where the one form that got
    furthest failed."""
    where, forms = ".".join(loc), []
    for e in errors:
        form = str(e["loc"][len(loc)]) if len(e["loc"]) > len(loc) else None
        if form is not None and form not in forms:
            forms.append(form)
    message = f"{where} must be one of: {', '.join(forms)}"
    depth = max(len(e["loc"]) for e in errors)
    deepest = [e for e in errors if len(e["loc"]) == depth]
    if depth > len(loc) + 1 and len(deepest) == 1:  # one form got further than the others: say where it failed
        deepest = deepest[0]
        inner = [str(p) for p in deepest["loc"][:len(loc)] + deepest["loc"][len(loc) + 1:]]
        message += f" ({'.'.join(inner)}: {deepest.get('msg', 'invalid value')})"
    return message


_FIELD_NAMES = {name for cls in (CompletionRequest, ChatCompletionRequest, Message, ContentPart, StreamOptions,
                                 LoadAdapterRequest, UnloadAdapterRequest) for name in cls.model_fields}
