"""Every rendered object validates strictly: Kubernetes' OpenAPI schemas for core kinds, CRD schemas for the rest.

Strict means unknown fields are rejected: kubernetes-validate's ``strict=True``
uses its ``-strict`` schema set, where every object carries
``additionalProperties: false``; the CRD schemas get the same treatment here
wherever a CRD does not declare ``x-kubernetes-preserve-unknown-fields``.
"""

from __future__ import annotations

import copy
import functools

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version
from render_cases import CASES, K8S_TARGETS, SCHEMAS

from ddpk.examples import examples
from ddpk.render import render

pytestmark = pytest.mark.unit

NEWEST_MINOR = int(latest_version().split(".")[1])
VERSIONS = [f"1.{minor}" for minor in range(29, NEWEST_MINOR + 1)]
CRD_FILES = {
    "PyTorchJob": "kubeflow.org_pytorchjobs.yaml",
    "JobSet": "jobset.x-k8s.io_jobsets.yaml",
}


def strict_k8s(obj: dict, version: str) -> None:
    kubernetes_validate.validate(obj, version, strict=True)


def _close(schema):
    """additionalProperties: false wherever the CRD lists properties and does not keep unknown fields."""
    if isinstance(schema, dict):
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        for value in schema.values():
            _close(value)
    elif isinstance(schema, list):
        for value in schema:
            _close(value)
    return schema


@functools.cache
def crd_validator(kind: str, api_version: str) -> jsonschema.Draft7Validator:
    path = SCHEMAS / CRD_FILES[kind]
    if not path.exists():
        pytest.skip(f"CRD schema {path} is absent (it lives in shared/ beside the clone)")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = next(doc for doc in yaml.load_all(path.read_text(), Loader=loader) if doc)
    version = api_version.split("/")[1]
    schema = next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version)
    return jsonschema.Draft7Validator(_close(copy.deepcopy(schema)))


def strict_crd(obj: dict) -> None:
    crd_validator(obj["kind"], obj["apiVersion"]).validate(obj)


def embedded_k8s_objects(obj: dict) -> list[dict]:
    """CRD kinds embed core templates; the CRD schema leaves metadata open, so check those against Kubernetes too."""
    out = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}]
    if obj["kind"] == "PyTorchJob":
        for role, replica in obj["spec"]["pytorchReplicaSpecs"].items():
            out.append({"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": f"{obj['metadata']['name']}-{role.lower()}"},
                        "template": replica["template"]})
    if obj["kind"] == "JobSet":
        for rjob in obj["spec"]["replicatedJobs"]:
            template = rjob["template"]
            out.append({"apiVersion": "batch/v1", "kind": "Job",
                        "metadata": {**template["metadata"], "name": f"{obj['metadata']['name']}-{rjob['name']}-0"},
                        "spec": template["spec"]})
    return out


def rendered(case: str, target: str) -> list[dict]:
    return render(CASES[case], target)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("target", K8S_TARGETS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_objects_validate_strictly(case, target, version):
    for obj in rendered(case, target):
        if obj["kind"] in CRD_FILES:
            for inner in embedded_k8s_objects(obj):
                strict_k8s(inner, version)
        else:
            strict_k8s(obj, version)


@pytest.mark.parametrize("target", ["pytorchjob", "jobset"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_operator_kinds_validate_against_their_crds(case, target):
    for obj in rendered(case, target):
        strict_crd(obj)


@pytest.mark.parametrize("version", VERSIONS)
def test_committed_examples_validate_strictly(version):
    for name, text in examples().items():
        if name == "kustomization.yaml":
            continue
        for obj in yaml.safe_load_all(text):
            if obj["kind"] in CRD_FILES:
                strict_crd(obj)
                for inner in embedded_k8s_objects(obj):
                    strict_k8s(inner, version)
            else:
                strict_k8s(obj, version)


def _with_unknown_field(obj: dict) -> dict:
    bad = copy.deepcopy(obj)
    spec = bad["spec"]
    template = (
        spec.get("template")
        or spec.get("pytorchReplicaSpecs", {}).get("Master", {}).get("template")
        or (spec.get("replicatedJobs") or [{}])[0].get("template", {}).get("spec", {}).get("template")
    )
    if template:
        template["spec"]["containers"][0]["gpuCount"] = 1
    else:
        spec["clusterIp"] = "None"
    return bad


@pytest.mark.parametrize("target", K8S_TARGETS)
def test_strict_validation_rejects_unknown_fields(target):
    """The checks above can fail: a misspelt or invented field is caught by each validator."""
    for obj in rendered("two-cpu", target):
        bad = _with_unknown_field(obj)
        if obj["kind"] in CRD_FILES:
            with pytest.raises(jsonschema.ValidationError):
                strict_crd(bad)
            with pytest.raises(jsonschema.ValidationError):
                for inner in embedded_k8s_objects(bad):
                    strict_k8s(inner, VERSIONS[0])
        else:
            with pytest.raises(jsonschema.ValidationError):
                strict_k8s(bad, VERSIONS[0])
