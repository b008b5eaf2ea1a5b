"""Render one of these kustomizations without kubectl: what ``kubectl kustomize DIR`` prints.

    .venv/bin/python deploy/kubernetes/render.py deploy/kubernetes/aggregated

The layouts use only two of Kustomize's fields, ``resources`` (YAML files and other
kustomization folders) and ``images`` (``name`` -> ``newName``/``newTag``), and this
renders exactly those, refusing any other field: the tests (tests/test_k8s_manifests.py)
validate what it renders against the Kubernetes schemas, and compare it with ``kubectl
kustomize`` where kubectl is installed. Objects come out in the order Kustomize's legacy
sort gives the kinds used here (its default), each once (a second copy is an error, as it
is for Kustomize).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

KNOWN = {"apiVersion", "kind", "resources", "images"}
# Kustomize's legacy order (kustomize/api/resid/gvk.go), the kinds these layouts use.
ORDER = ["Namespace", "ServiceAccount", "Role", "RoleBinding", "Service", "Deployment",
         "HorizontalPodAutoscaler"]  # fmt: skip


def render(folder: str | Path) -> list[dict[str, Any]]:
    """The objects of the kustomization in ``folder``, images set, in Kustomize's order."""
    objects = _load(Path(folder))
    seen: set[tuple[str, str, str]] = set()
    for obj in objects:
        key = (obj["apiVersion"], obj["kind"], obj["metadata"]["name"])
        if key in seen:
            raise ValueError(f"{folder}: {key} is there twice")
        seen.add(key)
    rank = {kind: i for i, kind in enumerate(ORDER)}
    # Kinds it does not know go last, by kind then name (Kustomize's legacy sort too).
    return sorted(objects, key=lambda o: (rank.get(o["kind"], len(ORDER)), o["kind"] if
                                          o["kind"] not in rank else "", o["metadata"]["name"]))  # fmt: skip


def _load(folder: Path) -> list[dict[str, Any]]:
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - KNOWN
    if unknown:
        raise ValueError(f"{folder}/kustomization.yaml: render.py does not do {sorted(unknown)}")
    objects: list[dict[str, Any]] = []
    for item in spec.get("resources", []):
        path = (folder / item).resolve()
        if path.is_dir():
            objects += _load(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for image in spec.get("images", []):
        for obj in objects:
            _set_image(obj, image)
    return objects


def _set_image(node: Any, image: dict[str, str]) -> None:
    """Every container (and init container) whose image is ``image["name"]`` (any tag)."""
    if isinstance(node, dict):
        for key in ("containers", "initContainers"):
            for container in node.get(key) or []:
                name = str(container.get("image", ""))
                base = name.split("@")[0].rsplit(":", 1)[0] if ":" in name.split("/")[-1] else name
                if base == image["name"]:
                    tag = image.get("newTag") or (name[len(base) + 1 :] if name != base else "")
                    new = image.get("newName", base)
                    container["image"] = f"{new}:{tag}" if tag else new
        for value in node.values():
            _set_image(value, image)
    elif isinstance(node, list):
        for value in node:
            _set_image(value, image)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: render.py KUSTOMIZATION_FOLDER", file=sys.stderr)
        return 2
    print(yaml.safe_dump_all(render(argv[0]), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
