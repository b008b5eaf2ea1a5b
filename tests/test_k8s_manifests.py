"""deploy/kubernetes/ (issue 36): every layout renders, validates against the Kubernetes
schemas offline, and runs flags the CLI accepts.

- Each layout (``aggregated``, the default; ``pd``; ``multinode``; ``autoscaling``) is
  rendered by deploy/kubernetes/render.py, and where kubectl is installed the render is
  compared with ``kubectl kustomize`` (what ``kubectl apply -k`` applies).
- Every object is validated, strictly (no unknown field), against the schemas of each
  Kubernetes version in ``VERSIONS`` (kubernetes-validate ships them: no network). The
  LeaderWorkerSet is a CRD without a schema there: its leader and worker templates are
  validated as core ``PodTemplate``s, and its own fields are checked here by hand.
- Every container's command line (``$(VAR)`` filled in from its env, the downward API's pod
  IP and the variables LWS sets) parses with the CLI's own parser, and what the servers
  check before they start is checked too: ``serve``'s configuration (the JSON of
  ``--kv-transfer-config`` and ``--kv-events-config`` included), the router's and the PD
  proxy's discovery flags, whose selectors must select exactly the pods they front.
- Probes, termination grace and scrape annotations agree with the flags.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from launch.cli import _discovery, build_parser

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"
LAYOUTS = ["aggregated", "pd", "multinode", "autoscaling"]
VERSIONS = ["1.29", "1.30", "1.31", "1.32", "1.33", "1.34", "1.35"]
LWS_ENV = {"LWS_LEADER_ADDRESS": "actorserve-0.actorserve.ns", "LWS_GROUP_SIZE": "2",
           "LWS_WORKER_INDEX": "1"}  # fmt: skip
POD_IP = "10.0.0.5"

_spec = importlib.util.spec_from_file_location("k8s_render", K8S / "render.py")
assert _spec is not None and _spec.loader is not None
render_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_module)


def render(layout: str) -> list[dict[str, Any]]:
    return list(render_module.render(K8S / layout))


def pod_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates an object runs (a Deployment's one, an LWS's leader and worker)."""
    if obj["kind"] == "Deployment":
        return [obj["spec"]["template"]]
    if obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return []


def all_templates(layout: str) -> list[dict[str, Any]]:
    return [t for obj in render(layout) for t in pod_templates(obj)]


def command_line(container: dict[str, Any], lws: bool) -> list[str]:
    """The container's argv after ``actorserve``, with ``$(VAR)`` expanded as the kubelet
    expands it; a variable nobody defines fails the test (the kubelet would pass it as is)."""
    values = dict(LWS_ENV) if lws else {}
    for env in container.get("env", []):
        if "value" in env:
            values[env["name"]] = env["value"]
        elif env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            values[env["name"]] = POD_IP

    def expand(arg: str) -> str:
        def one(m: re.Match[str]) -> str:
            assert m.group(1) in values, f"$({m.group(1)}) is not defined for {container['name']}"
            return values[m.group(1)]

        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg)

    assert container["command"] == ["actorserve"]
    return [expand(a) for a in container["args"]]


def parsed(container: dict[str, Any], lws: bool = False) -> argparse.Namespace:
    return build_parser().parse_args(command_line(container, lws))


def flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name:
            return args[i + 1]
    return None


# ------------------------------------------------------------------------------ rendering


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_renderer_gives_what_kubectl_kustomize_gives(layout: str) -> None:
    ours = render(layout)
    assert ours, layout
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: rendered by render.py only")
    out = subprocess.run([kubectl, "kustomize", str(K8S / layout)], capture_output=True,
                         text=True, timeout=60, check=True).stdout  # fmt: skip
    assert ours == [d for d in yaml.safe_load_all(out) if d]


def test_the_renderer_refuses_kustomize_fields_it_does_not_render(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(ValueError, match="namePrefix"):
        render_module.render(tmp_path)


# ------------------------------------------------------------------------------ schemas


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_object_validates_against_the_kubernetes_schemas(layout: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for obj in render(layout):
        if obj["kind"] == "LeaderWorkerSet":
            docs = [{"apiVersion": "v1", "kind": "PodTemplate",
                     "metadata": {"name": f"{obj['metadata']['name']}-{i}"}, "template": t}
                    for i, t in enumerate(pod_templates(obj))]  # fmt: skip
        else:
            docs = [obj]
        for doc in docs:
            for version in VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)


def test_the_leaderworkerset_has_the_fields_lws_v1_requires() -> None:
    """The CRD's own fields (its schema is not shipped with the core ones)."""
    (lws,) = [o for o in render("multinode") if o["kind"] == "LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert set(spec) <= {"replicas", "leaderWorkerTemplate", "startupPolicy", "rolloutStrategy",
                         "networkConfig"}  # fmt: skip
    assert spec["startupPolicy"] in ("LeaderCreated", "LeaderReady")
    lwt = spec["leaderWorkerTemplate"]
    assert set(lwt) <= {"leaderTemplate", "workerTemplate", "size", "restartPolicy",
                        "subGroupPolicy", "resizePolicy"}  # fmt: skip
    assert lwt["restartPolicy"] in ("RecreateGroupOnPodRestart", "None")
    assert lwt["size"] == int(LWS_ENV["LWS_GROUP_SIZE"]) >= 2


# ------------------------------------------------------------------------------ flags


def _serve_checks(args: argparse.Namespace) -> None:
    """What ``actorserve serve`` checks from its flags before it loads anything."""
    from launch.serve import _check_headless, _check_restart, kv_events_settings
    from services.config import Endpoints
    from services.config.serve import ServeConfig

    config = ServeConfig.from_cli(args)
    _check_headless(config.engine.parallel, config.headless)
    _check_restart(config, config.headless)
    kv_events_settings(Endpoints(), config.kv_events_endpoint, config.kv_events_config)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_container_runs_flags_the_cli_accepts(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    objects = render(layout)
    for obj in objects:
        for template in pod_templates(obj):
            for container in template["spec"]["containers"]:
                args = parsed(container, lws=obj["kind"] == "LeaderWorkerSet")
                if args.command == "serve":
                    _serve_checks(args)
                    assert args.host == "0.0.0.0" or args.headless
                else:
                    assert args.command in ("router", "pd-proxy")
                    assert args.host == "0.0.0.0"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_front_selects_exactly_the_serving_pods(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router's --selector (the PD proxy's --prefill-selector, --decode-selector)
    selects the serving pods (a Deployment's, an LWS's leaders), on the port they serve,
    and nothing else: not the router, not the headless workers."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    templates = all_templates(layout)
    (front,) = [t for t in templates
                if t["spec"]["containers"][0]["args"][0] in ("router", "pd-proxy")]  # fmt: skip
    args = parsed(front["spec"]["containers"][0])
    if args.command == "router":
        sides = {"replica": _discovery(args, {"--selector": args.selector})["--selector"]}
    else:
        found = _discovery(args, {"--prefill-selector": args.prefill_selector,
                                  "--decode-selector": args.decode_selector})  # fmt: skip
        sides = {"prefill": found["--prefill-selector"], "decode": found["--decode-selector"]}
    for role, config in sides.items():
        assert config is not None
        chosen = [t for t in templates
                  if config.selector.items() <= t["metadata"]["labels"].items()]  # fmt: skip
        assert chosen, f"{layout}: {role} selects no pod"
        for t in chosen:
            container = t["spec"]["containers"][0]
            serve = command_line(container, lws=True)
            assert serve[0] == "serve" and "--headless" not in serve
            assert t["metadata"]["labels"]["app.kubernetes.io/component"] == role
            assert int(flag(serve, "--port") or 8000) == config.port
            assert config.port in {p["containerPort"] for p in container["ports"]}


@pytest.mark.parametrize("layout", ["pd"])
def test_pd_pods_give_their_own_ip_as_kv_ip(layout: str) -> None:
    import json

    roles = {}
    for t in all_templates(layout):
        container = t["spec"]["containers"][0]
        line = command_line(container, lws=False)
        if line[0] != "serve":
            continue
        kv = json.loads(flag(line, "--kv-transfer-config") or "{}")
        roles[kv["kv_role"]] = kv
        assert kv["kv_connector"] == "p2p" and kv["kv_ip"] == POD_IP
        assert kv["kv_port"] in {p["containerPort"] for p in container["ports"]}
    assert set(roles) == {"kv_producer", "kv_consumer"}


# ------------------------------------------------------------------------------ operations


@pytest.mark.parametrize("layout", LAYOUTS)
def test_probes_grace_and_scraping_agree_with_the_flags(layout: str) -> None:
    for t in all_templates(layout):
        spec = t["spec"]
        container = spec["containers"][0]
        line = command_line(container, lws=True)
        if "--headless" in line:
            continue  # (no HTTP: it goes when its leader goes)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        port = int(flag(line, "--port") or (8000 if line[0] == "serve" else 8080))
        assert ports["http"] == port
        # Readiness is /health: 503 while draining or restarting takes the pod out.
        assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert "tcpSocket" in container["livenessProbe"]  # never killed for a 503
        shutdown = float(flag(line, "--shutdown-timeout") or 30)
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
        sleep = float(pre_stop["command"][1]) if pre_stop else 0.0
        assert spec["terminationGracePeriodSeconds"] >= sleep + shutdown + 15
        annotations = t["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == port
        assert annotations["prometheus.io/path"] == "/metrics"
        if line[0] == "serve":  # KV events where llm-d looks: every interface, kv@<ip>@<model>
            import json

            events = json.loads(flag(line, "--kv-events-config") or "{}")
            assert events["endpoint"] == "tcp://*:5556"
            assert events["topic"] == f"kv@{POD_IP}@{flag(line, '--served-model-name')}"
            assert ports["kv-events"] == 5556


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_router_may_watch_pods_and_its_service_reaches_it(layout: str) -> None:
    objects = render(layout)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for o in objects:
        by_kind.setdefault(o["kind"], []).append(o)
    (role,) = by_kind["Role"]
    assert {"get", "list", "watch"} <= set(role["rules"][0]["verbs"])
    assert role["rules"][0]["resources"] == ["pods"]
    (binding,) = by_kind["RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    accounts = {s["name"] for s in binding["subjects"] if s["kind"] == "ServiceAccount"}
    (service,) = by_kind["Service"]
    fronts = [t for t in all_templates(layout)
              if service["spec"]["selector"].items() <= t["metadata"]["labels"].items()]  # fmt: skip
    assert len(fronts) == 1
    assert fronts[0]["spec"]["serviceAccountName"] in accounts
    for hpa in by_kind.get("HorizontalPodAutoscaler", []):
        target = hpa["spec"]["scaleTargetRef"]
        assert any(d["metadata"]["name"] == target["name"] for d in by_kind[target["kind"]])
        (metric,) = hpa["spec"]["metrics"]
        assert metric["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    if layout == "autoscaling":  # the adapter's rule makes that name from vllm:'s series
        values = yaml.safe_load(
            (K8S / "autoscaling" / "prometheus-adapter-values.yaml").read_text()
        )
        (rule,) = values["rules"]["custom"]
        assert rule["seriesQuery"].startswith("vllm:num_requests_waiting{")
        assert rule["name"]["as"] == "vllm_num_requests_waiting"
