"""JSON request bodies, read and parsed only once the caller is authenticated.

A route that declares a pydantic body makes FastAPI read and parse the JSON before any dependency
runs, so an unauthenticated client could make the server hold and parse megabytes, and a truncated
body would answer 422 before the missing token's 401. Routes here take their body through
:func:`json_body`, a dependency declared after the caller's: FastAPI solves dependencies in
declaration order, so a request without a valid token is refused before its body is read.

The body is parsed with duplicate keys refused (``core.strictjson``) and validated with the route's
pydantic model; errors keep the shape FastAPI's would have (``invalid request: body.field: ...``).
A body sent as YAML (``Content-Type: application/yaml``, ``application/x-yaml`` or ``text/yaml``) is the
same document, read with the definitions' strict YAML loader (no aliases, dates or duplicate keys), so
an operator can post a definition file's text without converting it; its syntax errors name the line
and column, never the content.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from durable_dataflow.api import errors
from durable_dataflow.core import strictjson
from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.definitions import definitions

Model = TypeVar("Model", bound=BaseModel)
BODY = ("body",)
YAML_MEDIA_TYPES = ("application/yaml", "application/x-yaml", "text/yaml")
YAML_ORIGIN = "request.yaml"  # how a YAML body's errors name it


def _invalid(location: tuple[str | int, ...], message: str) -> InputError:
    return InputError(errors.validation_message([{"loc": location, "msg": message}], BODY))


def _parsed(raw: bytes) -> Any:
    try:
        return strictjson.loads(raw)
    except strictjson.DuplicateKey as error:
        raise _invalid((), str(error)) from None
    except ValueError as error:  # malformed JSON, or bytes that are not UTF-8/16/32
        raise _invalid((getattr(error, "pos", "json"),), "JSON decode error") from None
    except RecursionError:
        raise _invalid((), "JSON nested too deeply") from None


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _parsed_yaml(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{YAML_ORIGIN}: the body is not UTF-8 text") from None
    return definitions.parse_yaml_document(text, YAML_ORIGIN)


def json_body(model: type[Model], *, required: bool = True) -> Callable[[Request], Awaitable[Model]]:
    """A dependency: the request's JSON (or YAML) body as ``model``. Without ``required``, an empty body (or
    ``null``) is the model's defaults. Declare it after the caller's dependency."""

    async def dependency(request: Request) -> Model:
        raw = await request.body()
        parse = _parsed_yaml if _media_type(request) in YAML_MEDIA_TYPES else _parsed
        value = parse(raw) if raw.strip() else None
        if value is None:
            if required:
                raise _invalid((), "Field required")
            return model()
        try:
            return model.model_validate(value)
        except ValidationError as error:
            raise InputError(
                errors.validation_message(error.errors(include_input=False, include_url=False), BODY)
            ) from None

    return dependency


def body_openapi(model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
    """The route's ``openapi_extra``: ``model`` documented as its request body, in JSON or YAML."""
    schema = model.model_json_schema()
    content = {media: {"schema": schema} for media in ("application/json", *YAML_MEDIA_TYPES)}
    return {"requestBody": {"required": required, "content": content}}
