"""A fake of the Kubernetes API's pod list and watch, in process, for the discovery tests.

No cluster runs here, so this serves the two calls ``services/router/discovery.py`` makes,
shaped as the API server answers them (a fake, not a conformance model):

- ``GET /api/v1/namespaces/NS/pods?labelSelector=k=v,...``: a ``PodList`` with
  ``metadata.resourceVersion``.
- The same with ``watch=1&resourceVersion=RV``: a chunked stream of JSON lines, ``{"type":
  "ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|"ERROR", "object": ...}``, the events after RV
  and then each new one as it happens. A version older than the history kept
  (``compact()``) gets what the API server sends: an ``ERROR`` event whose object is a
  ``Status`` with ``code`` 410, then the end of the stream (or, with ``gone_status``, an
  HTTP 410 answer).

The test changes pods (``set_pod``, ``delete_pod``), ends the open watches
(``drop_watches``, as an API server restart would), makes the next requests fail
(``fail_next``), and reads what was asked (``requests``).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from tests.router_fakes import ServerThread


class FakeKubeAPI:
    def __init__(self, namespace: str = "serving") -> None:
        self.namespace = namespace
        self.lock = threading.Lock()
        self.version = 100
        self.pods: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (version, type, pod)
        self.oldest = self.version  # a watch from before this gets 410
        self.generation = 0  # drop_watches() ends streams of older generations
        self.fail = 0  # answer this many next requests with 500
        self.gone_status = False  # 410 as the HTTP status instead of an ERROR event
        self.requests: list[dict[str, str]] = []  # each request's query (and auth header)
        self.thread = ServerThread(self.app())
        self.url = self.thread.url

    def stop(self) -> None:
        self.drop_watches()
        self.thread.stop()

    # ---------------------------------------------------------------- the test's side

    def set_pod(self, name: str, ip: str | None, ready: bool = True, phase: str = "Running",
                labels: dict[str, str] | None = None, deleting: bool = False) -> None:  # fmt: skip
        """Create or update a pod (an ADDED or MODIFIED event)."""
        with self.lock:
            self.version += 1
            kind = "MODIFIED" if name in self.pods else "ADDED"
            meta: dict[str, Any] = {"name": name, "namespace": self.namespace,
                                    "labels": labels or {"app": "actorserve"},
                                    "resourceVersion": str(self.version)}  # fmt: skip
            if deleting:
                meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
            status: dict[str, Any] = {"phase": phase, "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}  # fmt: skip
            if ip is not None:
                status["podIP"] = ip
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}
            self.pods[name] = pod
            self.history.append((self.version, kind, pod))

    def delete_pod(self, name: str) -> None:
        with self.lock:
            self.version += 1
            pod = self.pods.pop(name)
            pod = {**pod, "metadata": {**pod["metadata"], "resourceVersion": str(self.version)}}
            self.history.append((self.version, "DELETED", pod))

    def compact(self) -> None:
        """Forget the history: a watch from any version seen so far gets 410 Gone."""
        with self.lock:
            self.version += 1
            self.history.clear()
            self.oldest = self.version

    def drop_watches(self) -> None:
        with self.lock:
            self.generation += 1

    def lists(self) -> int:
        return sum(1 for r in self.requests if "watch" not in r)

    # ---------------------------------------------------------------- the API's side

    def _selected(self, pod: dict[str, Any], selector: str) -> bool:
        labels = pod["metadata"].get("labels") or {}
        for part in filter(None, selector.split(",")):
            key, _, value = part.partition("=")
            if labels.get(key) != value:
                return False
        return True

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/api/v1/namespaces/{namespace}/pods")
        async def pods(request: Request, namespace: str) -> Response:
            query = dict(request.query_params)
            if auth := request.headers.get("authorization"):
                query["authorization"] = auth
            self.requests.append(query)
            with self.lock:
                if self.fail:
                    self.fail -= 1
                    return JSONResponse({"kind": "Status", "code": 500}, status_code=500)
            if namespace != self.namespace:
                return JSONResponse({"kind": "PodList", "metadata": {"resourceVersion":
                                     str(self.version)}, "items": []})  # fmt: skip
            selector = query.get("labelSelector", "")
            if query.get("watch") not in ("1", "true"):
                with self.lock:
                    items = [p for p in self.pods.values() if self._selected(p, selector)]
                    version = str(self.version)
                return JSONResponse({"kind": "PodList", "apiVersion": "v1",
                                     "metadata": {"resourceVersion": version}, "items": items})  # fmt: skip
            since = int(query.get("resourceVersion") or 0)
            if since < self.oldest and self.gone_status:
                return JSONResponse({"kind": "Status", "code": 410, "reason": "Expired"},
                                    status_code=410)  # fmt: skip
            return StreamingResponse(self._events(since, selector), media_type="application/json")

        return app

    async def _events(self, since: int, selector: str) -> AsyncIterator[bytes]:
        with self.lock:
            generation = self.generation
            gone = since < self.oldest
        if gone:
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                      "reason": "Expired", "message": f"too old resource version: {since}"}  # fmt: skip
            yield json.dumps({"type": "ERROR", "object": status}).encode() + b"\n"
            return
        sent = since
        while True:
            with self.lock:
                if self.generation != generation:
                    return
                new = [(v, k, p) for v, k, p in self.history if v > sent]
            for version, kind, pod in new:
                sent = version
                if self._selected(pod, selector):
                    yield json.dumps({"type": kind, "object": pod}).encode() + b"\n"
            await asyncio.sleep(0.02)  # (the fake's own poll of its history)
