"""Least privilege: what a submitter may do, what a job's pods and containers may do, what a scanner says.

Covered elsewhere, not repeated here: the image's user (10001), entrypoint and the
absence of C compilers (tests/e2e/test_e2e_docker.py); the pod and container
securityContext of every rendered target and secrets rendered by reference only
(tests/render/test_render_contract.py). docs/security.md says what each check means.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SECURITY_DOC = REPO / "docs" / "security.md"
CHECKOV_VERSION = "3.3.30"
CHECKOV_VENV = REPO / ".cache" / "checkov-venv"
SEVERE = {"HIGH", "CRITICAL"}


def program(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is not installed (pip install -e trainer -e cli)"
    return found


def doc_section(title: str) -> str:
    """The text of one ``## title`` section of docs/security.md."""
    text = SECURITY_DOC.read_text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert m, f"docs/security.md has no section '## {title}'"
    return m.group(1)


def table_rows(section: str) -> list[list[str]]:
    """The body rows of the first Markdown table in ``section``, cells stripped."""
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


# --- RBAC: the Role grants exactly what the kubernetes scheduler uses -----------------------

DOC_RBAC = "What a submitter may do"


def documented_permissions() -> set[tuple[str, str, str]]:
    """(API group, resource, verb) from the docs' table; the core group is written `core`."""
    granted = set()
    for group, resource, verbs, *_ in table_rows(doc_section(DOC_RBAC)):
        api_group = "" if ticked(group) == ["core"] else ticked(group)[0]
        for verb in ticked(verbs):
            granted.add((api_group, ticked(resource)[0], verb))
    return granted


def role_permissions(manifests: list[dict]) -> set[tuple[str, str, str]]:
    roles = [m for m in manifests if m["kind"] == "Role"]
    assert len(roles) == 1, [m["kind"] for m in manifests]
    return {(g, r, v) for rule in roles[0]["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


_PATH = re.compile(r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)/namespaces/[^/]+/(?P<resource>[^/]+)"
                   r"(?:/(?P<name>[^/]+))?(?P<sub>/[^/]+)?$")


def permissions_of(request: dict) -> set[tuple[str, str, str]]:
    """What RBAC checks for one API request (Kubernetes' verb mapping)."""
    m = _PATH.match(request["path"])
    assert m, f"an API request ddpk should not make: {request['method']} {request['path']}"
    group, resource = m["group"] or "", m["resource"] + (m["sub"] or "")
    method = request["method"]
    if method == "GET":
        verbs = {"watch"} if request["query"].get("watch") in ("true", "1") else {"get" if m["name"] else "list"}
    elif method == "PATCH":
        # Server-side apply of a missing object creates it, which RBAC authorizes as create.
        applies = request["headers"].get("Content-Type") == "application/apply-patch+yaml"
        verbs = {"patch", "create"} if applies else {"patch"}
    elif method == "DELETE":
        verbs = {"delete" if m["name"] else "deletecollection"}
    else:
        verbs = {{"POST": "create", "PUT": "update"}[method]}
    return {(group, resource, verb) for verb in verbs}


def load_fake_apiserver():
    """The API server double of the CLI tests (tests/cli/fake_apiserver.py), loaded by path."""
    path = REPO / "tests" / "cli" / "fake_apiserver.py"
    spec = importlib.util.spec_from_file_location("ddpk_tests_fake_apiserver", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def api(tmp_path):
    server = load_fake_apiserver().FakeApiServer().start()
    env = {**os.environ, "KUBECONFIG": server.kubeconfig(tmp_path / "kubeconfig"), "NO_COLOR": "1",
           "DDPK_HOME": str(tmp_path / "ddpk-home"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    yield server, env
    server.stop()


def every_kubernetes_command(server, env: dict) -> None:
    """Each ddpk command against the API server, as a submitter uses them over a job's life."""

    def ddpk(*args: str) -> None:
        done = subprocess.run([program("ddpk"), *args, "-s", "kubernetes"], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, f"ddpk {' '.join(args)}: exit {done.returncode}\n{done.stderr}"

    ddpk("submit", "--name", "lp", "--replicas", "2", "--validate", "server", "--env-from-secret", "hf-token")
    pods = [server.add_pod("lp", i) for i in range(2)]
    for pod in pods:
        server.log(pod, "ddpk-train: step 1")
    ddpk("status", "lp")
    ddpk("list")
    ddpk("logs", "lp")
    ddpk("logs", "lp", "--rank", "1", "--tail", "1")
    for pod in pods:
        server.set_pod_phase(pod, "Succeeded")
    server.set_job_condition("lp", "Complete")
    ddpk("logs", "-f", "lp")
    ddpk("wait", "lp", "--timeout", "30s")
    ddpk("submit", "--name", "lp", "--replicas", "2", "--replace")
    ddpk("delete", "lp")


@pytest.mark.integration
def test_the_submitter_role_grants_exactly_what_ddpk_uses(api):
    server, env = api
    every_kubernetes_command(server, env)
    used = set().union(*(permissions_of(r) for r in server.requests))
    documented = documented_permissions()
    granted = role_permissions(list(yaml.safe_load_all((REPO / "k8s" / "rbac.yaml").read_text())))

    assert used <= documented, f"ddpk uses permissions docs/security.md does not list: {sorted(used - documented)}"
    assert documented <= used, f"docs/security.md lists permissions ddpk never uses: {sorted(documented - used)}"
    assert granted >= used, f"k8s/rbac.yaml lacks permissions ddpk needs: {sorted(used - granted)}"
    assert granted <= used, (
        f"k8s/rbac.yaml grants more than ddpk uses: {sorted(granted - used)}; "
        "trim RULES in cli/src/ddpk/render/rbac.py and run make manifests")


@pytest.mark.integration
def test_secrets_reach_the_cluster_only_as_references(api):
    server, env = api
    value = "s3cr3t-value-never-sent"
    env = {**env, "HF_TOKEN": value, "WANDB_API_KEY": value}
    done = subprocess.run([program("ddpk"), "submit", "-s", "kubernetes", "--name", "sec", "--env-from-secret",
                           "hf-token", "--env-from-secret", "wandb"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr

    assert not [r for r in server.requests if "/secrets" in r["path"]], "ddpk touched Secret objects"
    assert all(value not in r["body"] and value not in r["path"] for r in server.requests)
    job = server.get("jobs", "default", "sec")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["envFrom"] == [{"secretRef": {"name": "hf-token"}}, {"secretRef": {"name": "wandb"}}]
    assert all(set(e) == {"name", "value"} for e in container["env"]), "an env entry that is not a plain value"


# --- what a job's containers may do under the docker scheduler --------------------------------


def in_image(image: str, script: str) -> str:
    done = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "sh", image, "-c", script],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.e2e
def test_image_has_no_toolchain_and_its_user_cannot_change_the_installed_code(cpu_image):
    tools = "ld as make cmake ninja gfortran nvcc"
    found = in_image(cpu_image, f"for t in {tools}; do command -v $t || true; done")
    assert found == "", f"build tools in the final image: {found}"
    writable = in_image(cpu_image, "python3 -c 'import ddpk_trainer, os, sys; "
                                   "print(os.access(os.path.dirname(ddpk_trainer.__file__), os.W_OK), "
                                   "os.access(sys.prefix, os.W_OK))'")
    assert writable == "False False", f"the image's user can write to the installed trainer or its prefix: {writable}"


@pytest.mark.e2e
def test_docker_scheduler_containers_run_unprivileged(cpu_image, tmp_path):
    name = f"lp-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "DDPK_HOME": str(tmp_path / "ddpk-home"), "NO_COLOR": "1"}
    submit = [program("ddpk"), "submit", "-s", "docker", "--name", name, "--replicas", "2", "--image", cpu_image,
              "--image-pull-policy", "Never", "--", "--max-steps", "1", "--dataset", "fake"]
    try:
        done = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        # Read the effective capabilities while replica 0 runs (it waits for its peer at least briefly).
        caps = None
        deadline = time.monotonic() + 60
        while caps is None and time.monotonic() < deadline:
            probe = subprocess.run(["docker", "exec", f"{name}-0", "sh", "-c", "id -u; grep CapEff /proc/1/status"],
                                   capture_output=True, text=True, timeout=60)
            if probe.returncode == 0:
                caps = probe.stdout.split()
            time.sleep(0.2)
        for index in range(2):
            inspect = json.loads(subprocess.run(["docker", "inspect", f"{name}-{index}"], capture_output=True,
                                                text=True, check=True, timeout=60).stdout)[0]
            host = inspect["HostConfig"]
            assert host["Privileged"] is False
            assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
            assert "no-new-privileges" in host["SecurityOpt"]
            assert host["ReadonlyRootfs"] is True
            assert host["NetworkMode"] == name, "not on the job's own network"
            assert host["PidMode"] == "" and host["IpcMode"] in ("private", "shareable", "")
            assert not any("docker.sock" in m.get("Source", "") for m in inspect["Mounts"])
            assert inspect["Config"]["User"] in ("", "10001")
        assert caps is not None, "replica 0 ended before its capabilities could be read"
        assert caps[0] == "10001" and caps[-1] == "0000000000000000", f"uid and CapEff of PID 1: {caps}"
    finally:
        subprocess.run([program("ddpk"), "delete", name, "-s", "docker", "--volumes"], env=env, capture_output=True,
                       timeout=120)


# --- a scanner: checkov on the rendered manifests and the Dockerfile -------------------------

DOC_FINDINGS = "Scanner findings that stay"


def checkov() -> str:
    """checkov in its own venv under .cache/ (its pins clash with ours), created on first use."""
    exe = CHECKOV_VENV / "bin" / "checkov"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(CHECKOV_VENV)], check=True, timeout=300)
        done = subprocess.run([str(CHECKOV_VENV / "bin" / "pip"), "install", "-q", f"checkov=={CHECKOV_VERSION}"],
                              capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, f"pip install checkov failed:\n{done.stderr[-3000:]}"
    return str(exe)


def accepted_findings() -> set[str]:
    return {ticked(row[0])[0] for row in table_rows(doc_section(DOC_FINDINGS))}


@pytest.mark.integration
def test_checkov_finds_nothing_severe_and_nothing_unexplained(tmp_path):
    # The committed examples, plus a job using every feature that changes the pod (volumes, secrets, limits).
    full = tmp_path / "full"
    done = subprocess.run(
        [program("ddpk"), "render", "--name", "full", "--namespace", "training", "--replicas", "4",
         "--checkpoint-pvc", "ckpt", "--data-pvc", "data", "--env-from-secret", "hf-token",
         "--cpu", "4", "--cpu-limit", "8", "--memory", "8Gi", "--memory-limit", "16Gi",
         "--service-account", "trainer", "--output-dir", str(full)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    manifests = sorted(str(p) for p in (REPO / "k8s").glob("*.yaml") if p.name != "kustomization.yaml")
    files = manifests + sorted(str(p) for p in full.glob("*.yaml")) + [str(REPO / "docker" / "Dockerfile")]
    scan = subprocess.run(
        [checkov(), "--skip-download", "--quiet", "--compact", "--output", "json",
         "--framework", "kubernetes", "dockerfile", *sum((["-f", f] for f in files), [])],
        capture_output=True, text=True, timeout=600)
    assert scan.returncode in (0, 1), f"checkov failed to run (exit {scan.returncode}):\n{scan.stderr[-3000:]}"
    reports = json.loads(scan.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    assert {r["check_type"] for r in reports} == {"kubernetes", "dockerfile"}, "checkov scanned nothing"
    failed = [c for r in reports for c in r["results"]["failed_checks"]]
    assert all(r["summary"]["parsing_errors"] == 0 for r in reports)

    severe = [(c["check_id"], c["file_path"], c["severity"]) for c in failed if (c.get("severity") or "") in SEVERE]
    assert not severe, f"HIGH or CRITICAL findings: {severe}"
    accepted = accepted_findings()
    unexplained = sorted({(c["check_id"], c["check_name"], c["file_path"]) for c in failed
                          if c["check_id"] not in accepted})
    assert not unexplained, f"findings neither fixed nor listed in docs/security.md: {unexplained}"
    stale = accepted - {c["check_id"] for c in failed}
    assert not stale, f"docs/security.md lists findings checkov no longer reports: {sorted(stale)}"
