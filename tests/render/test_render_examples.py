"""The committed k8s/ examples are exactly what the renderer produces today (`make manifests` regenerates them)."""

from __future__ import annotations

import pytest
import yaml
from render_cases import REPO

from ddpk.examples import examples
from ddpk.render.rbac import RULES

pytestmark = pytest.mark.unit

K8S = REPO / "k8s"
GENERATED = examples()


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_committed_file_matches_the_renderer(name):
    path = K8S / name
    assert path.exists(), f"k8s/{name} is missing: run `make manifests`"
    assert path.read_text() == GENERATED[name], f"k8s/{name} drifted from the renderer: run `make manifests`"


def test_kustomization_applies_the_cpu_demo_and_rbac_only():
    kustomization = yaml.safe_load(GENERATED["kustomization.yaml"])
    assert kustomization["resources"] == ["rbac.yaml", "ddpk-demo-indexedjob.yaml"]
    kinds = [obj["kind"] for name in kustomization["resources"] for obj in yaml.safe_load_all(GENERATED[name])]
    assert sorted(kinds) == ["Job", "Role", "RoleBinding", "Service"]
    names = [(obj["kind"], obj["metadata"]["name"]) for name in kustomization["resources"]
             for obj in yaml.safe_load_all(GENERATED[name])]
    assert len(names) == len(set(names))


def test_cpu_demo_runs_the_image_that_make_image_builds():
    makefile = (REPO / "Makefile").read_text()
    image = next(line.split("?=")[1].strip() for line in makefile.splitlines() if line.startswith("IMAGE "))
    job = next(o for o in yaml.safe_load_all(GENERATED["ddpk-demo-indexedjob.yaml"]) if o["kind"] == "Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == image
    # A locally built tag must not be pulled from a registry.
    assert container["imagePullPolicy"] == "IfNotPresent"


def test_rbac_grants_only_what_ddpk_uses():
    granted = {(group, resource, verb) for rule in RULES for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    # The calls of ddpk.schedulers.kubernetes; tests/hardening/test_least_privilege.py checks them on the wire.
    expected = (
        {("batch", "jobs", v) for v in ("get", "list", "create", "patch", "delete")}
        | {("", "services", v) for v in ("create", "patch", "delete")}
        | {("", "pods", "list"), ("", "pods/log", "get")}
    )
    assert granted == expected
    assert all("*" not in rule["verbs"] and "*" not in rule["resources"] for rule in RULES)
