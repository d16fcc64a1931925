"""Error responses: what was wrong, in the shape of the API the route copies.

TGI routes answer `{"error": message, "error_type": kind}`; OpenAI routes (`/v1/...`)
`{"error": {"message": message, "type": kind, "param": field, "code": null}}`.

    400 malformed JSON                  422 a field missing, unknown, of the wrong type or out of range,
    401 a missing or wrong API key          an empty or over-long prompt, max_new_tokens out of range
    503 queue full / shutting down (with Retry-After)    500 the request failed while generating
"""

from __future__ import annotations

import typing

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

# error kind -> (TGI error_type, OpenAI error type)
KINDS = {
    "malformed": ("validation", "invalid_request_error"),
    "validation": ("validation", "invalid_request_error"),
    "unauthorized": ("unauthorized", "authentication_error"),
    "overloaded": ("overloaded", "server_overloaded"),
    "generation": ("generation", "server_error"),
    "cancelled": ("overloaded", "server_error"),
}


def is_openai(request: Request) -> bool:
    return request.url.path.startswith("/v1/")


def error_payload(openai: bool, message: str, kind: str, param: str | None = None) -> dict:
    tgi_type, openai_type = KINDS[kind]
    if openai:
        return {"error": {"message": message, "type": openai_type, "param": param, "code": None}}
    return {"error": message, "error_type": tgi_type}


def error_response(
    request: Request, status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(error_payload(is_openai(request), message, kind, param), status_code=status, headers=headers)


def _fields_at(model: type[BaseModel] | None, loc: list) -> list[str] | None:
    """Field names of the object at `loc` inside `model` (descending through nested models and lists)."""
    for key in loc:
        if model is None:
            return None
        if isinstance(key, int):
            continue
        info = model.model_fields.get(key)
        if info is None:
            return None
        model = _nested_model(info.annotation)
    return sorted(model.model_fields) if model is not None else None


def _nested_model(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _nested_model(arg)
        if found is not None:
            return found
    return None


def describe(errors: list[dict], body_model: type[BaseModel] | None) -> tuple[int, str, str | None]:
    """(status, message, first field) for pydantic/FastAPI validation errors of a request body."""
    parts, param = [], None
    for e in errors:
        loc = [x for x in e.get("loc", ()) if x != "body"]
        where = ".".join(str(x) for x in loc) or "request body"
        param = param or (where if loc else None)
        kind = e.get("type", "")
        if kind == "json_invalid":
            return 400, f"malformed JSON: {e.get('ctx', {}).get('error', 'cannot parse the body')}", None
        if kind == "missing" and not loc:
            parts.append("the request body must be a JSON object")
        elif kind == "missing":
            parts.append(f"{where}: required field missing")
        elif kind == "extra_forbidden":
            supported = _fields_at(body_model, loc[:-1])
            parts.append(f"{where}: unknown field" + (f"; supported: {', '.join(supported)}" if supported else ""))
        else:
            msg = e.get("msg", "invalid").removeprefix("Value error, ")
            given = e.get("input")
            shown = "" if isinstance(given, dict) or given is None else f" (given: {given!r})"
            parts.append(f"{where}: {msg}{shown}")
    return 422, "; ".join(parts) or "invalid request", param
