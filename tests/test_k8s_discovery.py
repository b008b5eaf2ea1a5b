"""The router finds its replicas in Kubernetes (issue 36): ``--service-discovery``.

Against the in-process fake of the API's pod list and watch (tests/k8s_fake.py; no cluster
runs here): a pod that becomes ready joins the router's replicas and gets traffic, one that
stops being ready, starts terminating or is deleted leaves, a watch whose version is gone
(410) lists again, and a failing API is retried with backoff. Each pod is a scriptable
replica (tests/router_fakes.py) on its own loopback address (127.0.0.N), all on one port,
as pods have one IP each and the same port.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest

from services.router.app import build_app
from services.router.config import RouterConfig
from services.router.discovery import DiscoveryConfig, parse_selector, pod_url
from services.router.pd_proxy import build_pd_app
from services.router.router import reachable
from tests.k8s_fake import FakeKubeAPI
from tests.router_fakes import FakeReplica, ServerThread, free_port, wait_for

REPO = Path(__file__).resolve().parent.parent
KEY = "admin-key"


class HostServerThread(ServerThread):
    """``ServerThread`` on another loopback address (a pod's IP)."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        import threading

        import uvicorn

        self.port, self.url = port, f"http://{host}:{port}"
        config = uvicorn.Config(app, host=host, port=port, log_level="error", lifespan="on",
                                timeout_graceful_shutdown=1)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(f"a replica on {host}:{port}", lambda: self.server.started)


def pod_replica(name: str, ip: str, port: int) -> FakeReplica:
    with mock.patch("tests.router_fakes.ServerThread",
                    lambda app: HostServerThread(app, ip, port)):  # fmt: skip
        return FakeReplica(name)


def common_port() -> int:
    """A port free on the loopback addresses the pods use."""
    for _ in range(50):
        port = free_port()
        with contextlib.ExitStack() as stack:
            try:
                for n in range(2, 8):
                    s = stack.enter_context(socket.socket())
                    s.bind((f"127.0.0.{n}", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no common free port")


@pytest.fixture
def kube() -> Iterator[FakeKubeAPI]:
    api = FakeKubeAPI()
    yield api
    api.stop()


@pytest.fixture
def pods() -> Iterator[Callable[[str, str], FakeReplica]]:
    port = common_port()
    made: list[FakeReplica] = []

    def make(name: str, ip: str) -> FakeReplica:
        replica = pod_replica(name, ip, port)
        made.append(replica)
        return replica

    make.port = port  # type: ignore[attr-defined]
    yield make
    for r in made:
        r.stop()


def discovery(kube: FakeKubeAPI, port: int, **kw: Any) -> DiscoveryConfig:
    return DiscoveryConfig(selector={"app": "actorserve"}, port=port, namespace=kube.namespace,
                           api_url=kube.url, backoff_s=(0.05, 0.2), **kw)  # fmt: skip


@contextlib.contextmanager
def router_for(config: RouterConfig) -> Iterator[str]:
    server = ServerThread(build_app(config))
    try:
        yield server.url
    finally:
        server.stop()


def backends(url: str) -> dict[str, bool]:
    r = httpx.get(f"{url}/admin/backends", headers={"Authorization": f"Bearer {KEY}"})
    return {b["url"]: b["healthy"] for b in r.json()["backends"]}


def complete(url: str) -> str:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 1}, timeout=10)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"]).strip().rstrip("0")


# ------------------------------------------------------------------------------ units


def _pod(**status: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"phase": "Running", "podIP": "10.0.0.5",
                            "conditions": [{"type": "Ready", "status": "True"}]}  # fmt: skip
    base.update(status)
    return {"metadata": {"name": "p"}, "status": base}


def test_a_pod_serves_only_running_with_an_ip_ready_and_not_terminating() -> None:
    assert pod_url(_pod(), 8000) == "http://10.0.0.5:8000"
    assert pod_url(_pod(podIP="fd00::5"), 8000) == "http://[fd00::5]:8000"
    assert pod_url(_pod(phase="Pending"), 8000) is None
    assert pod_url(_pod(podIP=None), 8000) is None
    assert pod_url(_pod(conditions=[{"type": "Ready", "status": "False"}]), 8000) is None
    assert pod_url(_pod(conditions=[]), 8000) is None
    terminating = _pod()
    terminating["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert pod_url(terminating, 8000) is None


def test_selectors_are_labels_that_must_all_match() -> None:
    assert parse_selector(["app=x", "role=decode"]) == {"app": "x", "role": "decode"}
    assert parse_selector(["app=x,role=prefill"]) == {"app": "x", "role": "prefill"}
    for bad in (["app"], ["=x"], []):
        with pytest.raises(ValueError):
            parse_selector(bad)


def test_kv_events_bound_to_every_interface_are_reached_at_the_pods_address() -> None:
    assert reachable("tcp://*:5556", "http://10.0.0.5:8000") == "tcp://10.0.0.5:5556"
    assert reachable("tcp://0.0.0.0:5557", "http://10.0.0.5:8000") == "tcp://10.0.0.5:5557"
    assert reachable("tcp://*:5556", "http://[fd00::5]:8000") == "tcp://[fd00::5]:5556"
    assert reachable("tcp://10.0.0.9:5556", "http://10.0.0.5:8000") == "tcp://10.0.0.9:5556"
    assert reachable("", "http://10.0.0.5:8000") == ""


def test_in_cluster_the_api_is_found_from_the_environment_with_the_token(
    tmp_path: Path, kube: FakeKubeAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a pod: KUBERNETES_SERVICE_HOST/PORT, the service account's token on every request
    (read again each time: the kubelet rotates it) and its namespace by default. The fake
    speaks HTTP, so the scheme is checked apart from the rest."""
    from services.router.discovery import KubeAPI

    (tmp_path / "token").write_text("t0ken\n")
    (tmp_path / "namespace").write_text(kube.namespace)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    config = DiscoveryConfig(selector={"app": "actorserve"}, sa_dir=tmp_path)
    api = KubeAPI(config)
    assert (api.base, api.namespace) == ("https://10.96.0.1:443", kube.namespace)
    api.base = kube.url  # the same calls, to the fake
    import asyncio

    async def list_twice() -> None:
        await api.list_pods()
        (tmp_path / "token").write_text("rotated")
        await api.list_pods()
        await api.aclose()

    asyncio.run(list_twice())
    assert [r["authorization"] for r in kube.requests] == ["Bearer t0ken", "Bearer rotated"]
    assert kube.requests[0]["labelSelector"] == "app=actorserve"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_HOST"):
        KubeAPI(config)


# ------------------------------------------------------------------------------ the router


def test_ready_pods_join_and_get_traffic_deleted_ones_leave(kube: FakeKubeAPI, pods) -> None:  # noqa: ANN001
    port = pods.port
    a, b = pods("a", "127.0.0.2"), pods("b", "127.0.0.3")
    url_a, url_b = f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}"
    kube.set_pod("a", "127.0.0.2")
    kube.set_pod("b", "127.0.0.3", ready=False)  # starting: not ready yet
    kube.set_pod("other", "127.0.0.4", labels={"app": "something-else"})
    config = RouterConfig(backends=[], policy="round_robin", api_key=KEY,
                          health_check_interval=0.2, discovery=discovery(kube, port))  # fmt: skip
    with router_for(config) as router:
        wait_for("pod a to join", lambda: backends(router) == {url_a: True})
        assert {complete(router) for _ in range(4)} == {"a"}

        kube.set_pod("b", "127.0.0.3")  # ready now
        wait_for("pod b to join", lambda: backends(router) == {url_a: True, url_b: True})
        assert {complete(router) for _ in range(4)} == {"a", "b"}
        assert len(b.bodies) >= 2

        kube.delete_pod("a")
        wait_for("pod a to leave", lambda: backends(router) == {url_b: True})
        before = len(a.bodies)
        assert {complete(router) for _ in range(4)} == {"b"}
        assert len(a.bodies) == before

        kube.set_pod("b", "127.0.0.3", deleting=True)  # terminating: leaves before its drain
        wait_for("terminating pod b to leave", lambda: backends(router) == {})
        assert httpx.get(f"{router}/health").status_code == 503

        kube.set_pod("c", "127.0.0.2")  # a new pod at a's old address
        wait_for("pod c to join", lambda: backends(router) == {url_a: True})
        assert complete(router) == "a"  # (the replica serving there is named a)
    # The watch asked only for the selected pods, from the list's version on.
    watches = [r for r in kube.requests if r.get("watch")]
    assert watches and all(r["labelSelector"] == "app=actorserve" for r in watches)
    assert all(r["resourceVersion"] for r in watches)


@pytest.mark.parametrize("gone_status", [False, True], ids=["error-event", "http-410"])
def test_a_gone_watch_lists_again_and_catches_up(
    kube: FakeKubeAPI, pods, gone_status: bool
) -> None:  # noqa: ANN001
    """410 Gone (as an ERROR event in the stream, or as the answer's status): the watcher
    lists again, and what changed while nobody watched is applied: a pod gone, one added."""
    port = pods.port
    pods("a", "127.0.0.2")
    pods("b", "127.0.0.3")
    url_a, url_b = f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}"
    kube.set_pod("a", "127.0.0.2")
    kube.gone_status = gone_status
    config = RouterConfig(backends=[], api_key=KEY, health_check_interval=0.2,
                          discovery=discovery(kube, port))  # fmt: skip
    with router_for(config) as router:
        wait_for("pod a to join", lambda: backends(router) == {url_a: True})
        lists = kube.lists()
        # The API server restarts and forgets: the events in between are never streamed.
        kube.drop_watches()
        kube.delete_pod("a")
        kube.set_pod("b", "127.0.0.3")
        kube.compact()
        wait_for("the list after 410", lambda: kube.lists() > lists)
        wait_for("b in, a out", lambda: backends(router) == {url_b: True})
        assert complete(router) == "b"


def test_an_api_that_fails_is_retried_with_backoff(kube: FakeKubeAPI, pods) -> None:  # noqa: ANN001
    port = pods.port
    pods("a", "127.0.0.2")
    url_a = f"http://127.0.0.2:{port}"
    kube.fail = 3  # the first list and two retries answer 500
    config = RouterConfig(backends=[], api_key=KEY, health_check_interval=0.2,
                          discovery=discovery(kube, port))  # fmt: skip
    kube.set_pod("a", "127.0.0.2")
    with router_for(config) as router:
        wait_for("pod a to join after the API recovers", lambda: backends(router) == {url_a: True})
        assert kube.lists() >= 4
        assert complete(router) == "a"
        # A broken watch (the API server went away) is watched again, no list needed.
        lists = kube.lists()
        kube.drop_watches()
        kube.set_pod("a", "127.0.0.2", ready=False)
        wait_for("pod a to leave", lambda: backends(router) == {})
        assert kube.lists() == lists


def test_discovered_and_static_backends_live_together(kube: FakeKubeAPI, pods) -> None:  # noqa: ANN001
    port = pods.port
    pods("a", "127.0.0.2")
    static = FakeReplica("s")
    try:
        config = RouterConfig(backends=[static.url], api_key=KEY, health_check_interval=0.2,
                              discovery=discovery(kube, port))  # fmt: skip
        with router_for(config) as router:
            wait_for("the static backend", lambda: backends(router) == {static.url: True})
            kube.set_pod("a", "127.0.0.2")
            url_a = f"http://127.0.0.2:{port}"
            wait_for("pod a", lambda: backends(router) == {static.url: True, url_a: True})
            kube.delete_pod("a")
            wait_for("pod a to leave", lambda: backends(router) == {static.url: True})
    finally:
        static.stop()


def test_the_pd_proxy_discovers_each_side_by_its_selector(kube: FakeKubeAPI, pods) -> None:  # noqa: ANN001
    port = pods.port
    pods("p", "127.0.0.2")
    pods("d", "127.0.0.3")

    def side(role: str) -> RouterConfig:
        found = discovery(kube, port)
        found.selector = {"app": "actorserve", "role": role}
        return RouterConfig(backends=[], role=role, health_check_interval=0.2, discovery=found)

    server = ServerThread(build_pd_app(side("prefill"), side("decode")))
    try:

        def health() -> dict[str, Any]:
            return dict(httpx.get(f"{server.url}/health").json())

        assert httpx.get(f"{server.url}/health").status_code == 503
        kube.set_pod("p", "127.0.0.2", labels={"app": "actorserve", "role": "prefill"})
        kube.set_pod("d", "127.0.0.3", labels={"app": "actorserve", "role": "decode"})
        wait_for("both sides", lambda: health().get("status") == "ok")
        assert (health()["healthy_prefill"], health()["healthy_decode"]) == (1, 1)
        kube.delete_pod("d")
        wait_for("decode to leave", lambda: httpx.get(f"{server.url}/health").status_code == 503)
    finally:
        server.stop()


# ------------------------------------------------------------------------------ the command


def test_the_router_command_discovers_pods(kube: FakeKubeAPI, pods) -> None:  # noqa: ANN001
    """``actorserve router --service-discovery --selector ...`` as a user starts it (against
    the fake through --service-discovery-api-url), and its start-up errors."""
    port = pods.port
    pods("a", "127.0.0.2")
    kube.set_pod("a", "127.0.0.2")
    router_port = free_port()
    cmd = [sys.executable, "-m", "launch.cli", "router", "--service-discovery",
           "--selector", "app=actorserve", "--service-discovery-port", str(port),
           "--service-discovery-namespace", kube.namespace,
           "--service-discovery-api-url", kube.url, "--port", str(router_port)]  # fmt: skip
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{router_port}"

            def up() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(f"{url}/health").status_code == 200
                assert proc.poll() is None, "the router exited"
                return False

            wait_for("the router with pod a", up, 60)
            assert complete(url) == "a"
        finally:
            proc.terminate()
            assert proc.wait(30) == 0
            out.seek(0)
            log = out.read().decode()
    assert "discovering pods app=actorserve in serving" in log
    assert f"pod serving/a ready at http://127.0.0.2:{port}" in log

    def error(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=REPO,
                           capture_output=True, text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin"})  # fmt: skip
        assert r.returncode == 2, r.stderr
        return r.stderr.strip().splitlines()[-1]

    assert "KUBERNETES_SERVICE_HOST" in error("router", "--service-discovery", "--selector", "a=b")
    assert "--selector" in error("router", "--service-discovery")
    assert "needs --service-discovery" in error("router", "--selector", "a=b")
    assert "--decode" in error("pd-proxy", "--prefill", "http://127.0.0.1:1")
    assert "--prefill-selector" in error(
        "pd-proxy", "--service-discovery", "--service-discovery-api-url", kube.url,
        "--decode-selector", "role=decode",
    )  # fmt: skip
