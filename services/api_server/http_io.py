"""HTTP plumbing for the app: strict body parsing and validation. The shared HTTP layer
(errors, disconnects, streaming, middlewares) lives in ``services/http``; its names are
re-exported here for the api_server's modules."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec
import pydantic
from fastapi import FastAPI, Request

from services.http.body import read_body
from services.http.disconnect import until_disconnect as until_disconnect
from services.http.errors import APIError as APIError
from services.http.errors import ClientGone as ClientGone
from services.http.errors import error_body as error_body
from services.http.errors import error_response as error_response
from services.http.middleware import AccessLogMiddleware as AccessLogMiddleware
from services.http.middleware import AuthMiddleware as AuthMiddleware
from services.http.middleware import InternalErrorMiddleware as InternalErrorMiddleware
from services.http.middleware import XRequestIdMiddleware as XRequestIdMiddleware
from services.http.streaming import BoundedStreamingResponse as BoundedStreamingResponse
from services.protocol import SamplingParams

_msgpack = msgspec.msgpack.Encoder()
M = TypeVar("M", bound=pydantic.BaseModel)


async def read_json(request: Request, limit: int) -> Any:
    body = await read_body(request, limit)
    try:
        value = msgspec.json.decode(body)  # strict: rejects invalid UTF-8 and lone surrogates
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise APIError(400, f"Invalid JSON body: {e}") from None
    except RecursionError:
        raise APIError(400, "Invalid JSON body: nested too deeply") from None
    _check_integers(value)
    return value


def _check_integers(body: Any) -> None:
    """Every integer of the body fits the engine's messages (msgpack: -2**63 to 2**64), in
    free-form fields (``chat_template_kwargs``, ``tools``, ...) too; else a 400 naming the
    top-level field."""
    try:
        _msgpack.encode(body)
    except OverflowError:
        fields = body.items() if isinstance(body, dict) else ()
        param = next((k for k, v in fields if not _encodes(v)), None)
        raise APIError(400, "An integer in the request is out of range.", param) from None


def _encodes(value: Any) -> bool:
    try:
        _msgpack.encode(value)
    except OverflowError:
        return False
    return True


def parse_body(model: type[M], body: Any) -> M:
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        param = str(err["loc"][0]) if err["loc"] else None
        raise APIError(400, f"{loc}: {err['msg']}", param) from None


def document_bodies(app: FastAPI, bodies: dict[str, tuple[type[pydantic.BaseModel], ...]]) -> None:
    """Put the request bodies of routes that read their own JSON (``read_json`` +
    ``parse_body``) into ``/openapi.json``: POST ``path`` takes one of ``bodies[path]``.
    Clients and schema-driven fuzzers (schemathesis) then see what the routes accept."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, models in bodies.items():
            refs = []
            for model in models:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                refs.append({"$ref": f"#/components/schemas/{model.__name__}"})
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}
                },
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def validate_sampling(sampling: SamplingParams, max_logprobs: int) -> None:
    try:
        sampling.validate(max_logprobs)
    except ValueError as e:
        param = getattr(e, "param", None) or str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param) from None


async def prepend(first: tuple[int, Any], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item
