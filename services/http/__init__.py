"""The HTTP layer shared by the three servers: the api_server, ``actorserve router`` and
``actorserve pd-proxy``.

- ``errors``: OpenAI-shaped error bodies and responses, ``APIError``, the 499 of a client
  that left.
- ``body``: ``read_body``, a request body with a size cap (413).
- ``disconnect``: ``until_disconnect``, racing a request's work against its client leaving.
- ``streaming``: ``BoundedStreamingResponse`` (a stream whose client must keep reading) and
  ``RelayResponse`` (an upstream answer passed on, with one close hook that always runs).
- ``middleware``: plain ASGI middlewares (X-Request-Id, internal errors, bearer auth, the
  access log line, the drain's 503s).
- ``server``: starting uvicorn: the event loop, signals and readiness.

It sits below every server in the layer contract (pyproject.toml): it imports only
starlette, fastapi, uvicorn and the standard library, and knows nothing of engines, replicas
or policies.
"""
