"""Replicas found in Kubernetes: the pods a label selector names, as they become ready and go.

``actorserve router --service-discovery --selector app=actorserve`` (and the PD proxy's
``--prefill-selector`` / ``--decode-selector``; sglang-router's flags) lists the selected
pods in one namespace and then watches them through the Kubernetes API: a pod joins the
router's replicas (``Router.add_replica``, the same health checks, load readings and
retries as a ``--backend`` URL) once it is ``Running``, has a pod IP, its ``Ready``
condition is ``True`` and it is not being deleted; it leaves (``Router.remove_replica``:
its open requests finish on their connections) when it is deleted, stops being ready or
starts terminating. A terminating pod leaves at once, before its drain answers 503, so no
request is sent to a replica that is shutting down.

Why plain HTTP (httpx) and not the official ``kubernetes`` client: the router needs two
calls, ``GET /api/v1/namespaces/NS/pods?labelSelector=...`` and the same with
``watch=1&resourceVersion=RV`` (a chunked stream of JSON lines), and the client would add
a dozen packages (and a thread per watch) for them.

The loop, as client-go's reflector runs it:

1. List, remember the list's ``resourceVersion``, and make the replica set match the ready
   pods (joins and leaves for what changed while the watch was down).
2. Watch from that version (``allowWatchBookmarks``: bookmarks keep the version fresh);
   ``ADDED``/``MODIFIED``/``DELETED`` update one pod each. The server ends a watch after
   ``timeoutSeconds``; the next one starts from the last version seen.
3. ``410 Gone`` (an ``ERROR`` event or the response's status: the version is older than
   the API server keeps) lists again. Any other failure (connection refused, 5xx, a
   broken stream) waits with backoff (``backoff_s``: 0.5 s doubling to 30 s, reset by a
   successful list) and lists again.

In a cluster (no ``api_url``) the API is ``https://$KUBERNETES_SERVICE_HOST:
$KUBERNETES_SERVICE_PORT``, authenticated with the service account's token (read again
for every request: the kubelet rotates it) and verified with its CA, both in
``/var/run/secrets/kubernetes.io/serviceaccount``; the namespace defaults to the pod's
own (the same folder's ``namespace`` file). An explicit ``api_url`` (tests, or
``kubectl proxy``'s ``http://127.0.0.1:8001``) sends no token. The service account needs
``get``, ``list`` and ``watch`` on pods in that namespace (deploy/kubernetes/common/).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import httpx

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
WATCH_TIMEOUT_S = 300  # the server ends each watch after this; the next starts where it stopped


def parse_selector(items: list[str]) -> dict[str, str]:
    """``--selector app=x role=y`` (or ``app=x,role=y``) -> labels; ValueError in one line.
    Equality only, as sglang-router's selector: every label must match."""
    labels: dict[str, str] = {}
    for item in items:
        for part in item.split(","):
            key, sep, value = part.strip().partition("=")
            if not part.strip():
                continue
            if not sep or not key.strip():
                raise ValueError(f"a selector is key=value, got {part.strip()!r}")
            labels[key.strip()] = value.strip()
    if not labels:
        raise ValueError("the selector names no label")
    return labels


@dataclass
class DiscoveryConfig:
    """Which pods are replicas, and where to ask about them."""

    selector: dict[str, str]
    port: int = 8000  # where each pod's server listens (``actorserve serve``'s default)
    namespace: str | None = None  # None: the pod's own (service account), else "default"
    api_url: str | None = None  # None: in cluster (KUBERNETES_SERVICE_HOST, token, CA)
    backoff_s: tuple[float, float] = (0.5, 30.0)  # first and longest wait after a failure
    sa_dir: Path = field(default=SERVICE_ACCOUNT)

    @property
    def label_selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.selector.items())

    def describe(self) -> str:
        return f"pods {self.label_selector} in {self.resolved_namespace()}, port {self.port}"

    def resolved_namespace(self) -> str:
        if self.namespace:
            return self.namespace
        with contextlib.suppress(OSError):
            own = (self.sa_dir / "namespace").read_text().strip()
            if own:
                return own
        return "default"


def pod_url(pod: dict[str, Any], port: int) -> str | None:
    """The replica URL of a pod that may serve (running, an IP, ready, not terminating);
    None for any other."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    ip = status.get("podIP")
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    if not ip or not ready:
        return None
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


class Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class KubeAPI:
    """The two pod calls, in cluster or against an explicit URL."""

    def __init__(self, config: DiscoveryConfig) -> None:
        self.config = config
        self.namespace = config.resolved_namespace()
        verify: ssl.SSLContext | bool = True
        if config.api_url is not None:
            self.base = config.api_url.rstrip("/")
            self.token_file: Path | None = None
        else:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ValueError(
                    "not in a Kubernetes pod (KUBERNETES_SERVICE_HOST is not set): give "
                    "--service-discovery-api-url (e.g. kubectl proxy's http://127.0.0.1:8001)"
                )
            self.base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
            self.token_file = config.sa_dir / "token"
            ca = config.sa_dir / "ca.crt"
            if ca.exists():
                verify = ssl.create_default_context(cafile=str(ca))
        self.client = httpx.AsyncClient(verify=verify, timeout=httpx.Timeout(10.0))
        self.path = f"/api/v1/namespaces/{quote(self.namespace, safe='')}/pods"

    def _headers(self) -> dict[str, str]:
        if self.token_file is None:
            return {}
        try:
            return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}
        except OSError:
            return {}

    async def list_pods(self) -> dict[str, Any]:
        r = await self.client.get(
            self.base + self.path,
            params={"labelSelector": self.config.label_selector},
            headers=self._headers(),
        )
        if r.status_code == 410:
            raise Gone()
        r.raise_for_status()
        body = r.json()
        if not isinstance(body, dict) or not isinstance(body.get("items"), list):
            raise ValueError("the pod list is not a PodList")
        return body

    @contextlib.asynccontextmanager
    async def watch(self, version: str) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """The watch's events from ``version``, one JSON object a line."""
        params = {
            "labelSelector": self.config.label_selector,
            "watch": "1",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        # Bookmarks come about once a minute: a stream silent for longer is a dead one.
        timeout = httpx.Timeout(10.0, read=WATCH_TIMEOUT_S + 30.0)
        async with self.client.stream(
            "GET", self.base + self.path, params=params, headers=self._headers(), timeout=timeout
        ) as r:
            if r.status_code == 410:
                raise Gone()
            r.raise_for_status()

            async def events() -> AsyncIterator[dict[str, Any]]:
                async for line in r.aiter_lines():
                    if line.strip():
                        yield json.loads(line)

            yield events()

    async def aclose(self) -> None:
        await self.client.aclose()


class Replicas(Protocol):
    """What discovery drives: the router (``Router``) or one side of the PD proxy."""

    refused: dict[str, str]

    async def add_replica(self, url: str) -> Any: ...

    async def remove_replica(self, url: str) -> bool: ...


class PodWatcher:
    """Keeps ``members`` (pod name -> replica URL) equal to the selected ready pods, calling
    ``on_join(url)`` and ``on_leave(url)`` as it changes (one at a time, in order)."""

    def __init__(
        self,
        config: DiscoveryConfig,
        on_join: Callable[[str], Awaitable[None]],
        on_leave: Callable[[str], Awaitable[None]],
        role: str = "backend",
    ) -> None:
        self.config = config
        self.on_join, self.on_leave = on_join, on_leave
        self.role = role
        self.members: dict[str, str] = {}
        self.lists = 0  # successful lists (the first, and each after 410 or a failure)
        self.synced = asyncio.Event()  # set once the first list is applied

    async def run(self, api: KubeAPI | None = None) -> None:
        """List and watch until cancelled (through ``api``, closed then; else its own)."""
        api = api if api is not None else KubeAPI(self.config)
        first, longest = self.config.backoff_s
        delay = first
        log.info("discovering %ss: %s", self.role, self.config.describe())
        try:
            while True:
                try:
                    version = await self._list(api)
                    delay = first
                    loop = asyncio.get_running_loop()
                    while True:  # watches, each from where the last one stopped
                        began = loop.time()
                        version = await self._watch(api, version)
                        if loop.time() - began < 1.0:  # ended at once: not a spin on it
                            await asyncio.sleep(first)
                except Gone:
                    log.info("%s discovery: the watch's version is gone (410): listing again",
                             self.role)  # fmt: skip
                    continue
                except (httpx.HTTPError, OSError, ValueError) as e:
                    log.warning("%s discovery: %s; listing again in %.1f s", self.role,
                                _why(e), delay)  # fmt: skip
                await asyncio.sleep(delay)
                delay = min(delay * 2, longest)
        finally:
            await api.aclose()

    async def _list(self, api: KubeAPI) -> str:
        body = await api.list_pods()
        pods: dict[str, str] = {}
        for pod in body["items"]:
            name, url = _name(pod), pod_url(pod, self.config.port)
            if name and url:
                pods[name] = url
        for name in [n for n in self.members if self.members[n] != pods.get(n)]:
            await self._leave(name)
        for name, url in pods.items():
            if name not in self.members:
                await self._join(name, url)
        self.lists += 1
        self.synced.set()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, api: KubeAPI, version: str) -> str:
        """One watch until the server ends it; returns the last version seen."""
        async with api.watch(version) as events:
            async for event in events:
                obj = event.get("object") if isinstance(event, dict) else None
                if not isinstance(obj, dict):
                    raise ValueError(f"a watch event without an object: {event!r:.200}")
                kind = event.get("type")
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise ValueError(f"watch error: {obj.get('message') or obj}")
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind == "BOOKMARK":
                    continue
                name = _name(obj)
                if not name:
                    continue
                url = None if kind == "DELETED" else pod_url(obj, self.config.port)
                if self.members.get(name) != url:
                    if name in self.members:
                        await self._leave(name)
                    if url is not None:
                        await self._join(name, url)
        return version

    async def _join(self, name: str, url: str) -> None:
        self.members[name] = url
        log.info("%s pod %s ready at %s: adding it", self.role, name, url)
        try:
            await self.on_join(url)
        except Exception:  # a replica that fails to join must not stop discovery
            log.exception("%s pod %s: adding %s failed", self.role, name, url)

    async def _leave(self, name: str) -> None:
        url = self.members.pop(name)
        log.info("%s pod %s gone or not ready: removing %s", self.role, name, url)
        try:
            await self.on_leave(url)
        except Exception:
            log.exception("%s pod %s: removing %s failed", self.role, name, url)


def _name(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}".strip("/")


def _why(e: BaseException) -> str:
    message = str(e).strip().splitlines()
    return f"{type(e).__name__}: {message[0]}" if message else type(e).__name__


@contextlib.asynccontextmanager
async def discovering(
    config: DiscoveryConfig | None, router: Replicas, role: str = "backend"
) -> AsyncIterator[PodWatcher | None]:
    """Run a ``PodWatcher`` feeding ``router`` for the body's duration (nothing without a
    config). A pod whose replica the router refuses (its block hashes differ) is left out
    and logged, as the admin endpoint refuses one."""
    if config is None:
        yield None
        return

    async def join(url: str) -> None:
        await router.add_replica(url)
        if url in router.refused:
            log.error("%s %s refused: %s", role, url, router.refused.pop(url))
            await router.remove_replica(url)

    async def leave(url: str) -> None:
        await router.remove_replica(url)

    watcher = PodWatcher(config, join, leave, role)
    api = KubeAPI(config)  # (not in a pod and no api_url: ValueError, before anything runs)
    task = asyncio.create_task(watcher.run(api))
    try:
        yield watcher
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
