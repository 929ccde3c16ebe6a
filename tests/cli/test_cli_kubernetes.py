"""The kubernetes scheduler against a local HTTP server speaking the API's documented shapes."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest
import yaml

from conftest import ddpk_exe
from fake_apiserver import FakeApiServer, write_kubeconfig

pytestmark = pytest.mark.integration

K = ("-s", "kubernetes")


@pytest.fixture
def api(tmp_path, monkeypatch, ddpk_home):
    server = FakeApiServer(forbidden_namespaces=("locked",)).start()
    monkeypatch.setenv("KUBECONFIG", server.kubeconfig(tmp_path / "kubeconfig"))
    yield server
    server.stop()


def submit(cli, *args):
    return cli("submit", *K, "--name", "kj", "--replicas", "2", *args)


def test_submit_is_server_side_apply_of_service_then_job(cli, api):
    result = submit(cli, "--", "--epochs", "1")
    assert result.code == 0, result.err
    assert result.out.splitlines()[0] == "kj -> kubernetes (namespace default)"
    patches = api.requests_to("PATCH", "/")
    assert [p["path"] for p in patches] == [
        "/api/v1/namespaces/default/services/kj",
        "/apis/batch/v1/namespaces/default/jobs/kj",
    ]
    for p in patches:
        assert p["headers"]["Content-Type"] == "application/apply-patch+yaml"
        assert p["query"] == {"fieldManager": "ddpk", "force": "true"}
    job = yaml.safe_load(patches[1]["body"])
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 2
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-2:] == ["--epochs", "1"]
    assert api.get("jobs", "default", "kj")["metadata"]["managedFields"][0]["manager"] == "ddpk"


def test_server_validation_dry_runs_every_object_before_applying_any(cli, api):
    assert submit(cli, "--validate", "server").code == 0
    dry = [p["query"].get("dryRun") for p in api.requests_to("PATCH", "/")]
    assert dry == ["All", "All", None, None]


def test_a_bad_job_sends_no_request(cli, api):
    result = submit(cli, "--toleration", "gpu:Sometimes")
    assert result.code == 2 and "--toleration" in result.err
    assert api.requests == []


def test_a_name_clash_names_the_job_and_replace_deletes_it_first(cli, api):
    assert submit(cli).code == 0
    api.add_pod("kj", 0)
    clash = submit(cli)
    assert clash.code == 2 and "job kj already exists" in clash.err
    old_uid = api.get("jobs", "default", "kj")["metadata"]["uid"]
    assert submit(cli, "--replace").code == 0
    deletes = api.requests_to("DELETE", "/jobs/kj")
    assert deletes[0]["query"]["propagationPolicy"] == "Background"
    assert api.get("jobs", "default", "kj")["metadata"]["uid"] != old_uid


def test_list_selects_on_ddpk_labels(cli, api):
    assert submit(cli).code == 0
    other = cli("render", "--name", "not-ours")  # applied by someone else, without ddpk's labels
    job = next(o for o in yaml.safe_load_all(other.out) if o["kind"] == "Job")
    job["metadata"]["labels"] = {"team": "x"}
    api.objects[("jobs", "default", "not-ours")] = job
    result = cli("list", *K, "-o", "json")
    assert result.code == 0
    assert [j["name"] for j in yaml.safe_load(result.out)] == ["kj"]
    selectors = {r["query"].get("labelSelector") for r in api.requests_to("GET", "/namespaces/default/")}
    assert "app.kubernetes.io/managed-by=ddpk" in selectors


def test_status_explains_an_unschedulable_pod(cli, api):
    assert submit(cli, "--gpus", "8").code == 0
    api.add_pod("kj", 0, phase="Pending", conditions=[{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}])
    result = cli("status", "kj", *K)
    assert result.code == 0
    assert "phase:     Pending" in result.out
    assert "Insufficient nvidia.com/gpu" in result.out


@pytest.mark.parametrize(
    ("kind", "reason", "code"),
    [("Complete", "", 0), ("Failed", "BackoffLimitExceeded", 1), ("Failed", "PodFailurePolicy", 1)],
)
def test_job_conditions_become_exit_codes(cli, api, kind, reason, code):
    assert submit(cli).code == 0
    api.set_job_condition("kj", kind, reason, "as the Job controller says")
    result = cli("wait", "kj", *K, "--timeout", "30s")
    assert result.code == code
    if code:
        assert reason in result.err


def test_logs_follow_survives_a_dropped_stream_and_new_pods_then_exits_with_the_result(cli, api):
    assert submit(cli).code == 0
    rank0 = api.add_pod("kj", 0)
    rank1 = api.add_pod("kj", 1)
    for i in range(4):
        api.log(rank0, f"r0 line {i}")
    api.log(rank1, "r1 first")
    api.drop_next_follow(rank0, after_lines=2)
    follower = subprocess.Popen([ddpk_exe(), "logs", "-f", "kj", *K], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, "NO_COLOR": "1"})
    try:
        # The first stream of rank 0 broke mid-line; wait for the reconnect that resumes it.
        api.wait_for(lambda: len([r for r in api.requests if r["path"].endswith(f"{rank0}/log")]) >= 2)
        resumed = [r for r in api.requests if r["path"].endswith(f"{rank0}/log")][1]
        assert resumed["query"]["follow"] == "true" and resumed["query"]["timestamps"] == "true"
        assert "sinceTime" in resumed["query"]
        api.log(rank0, "r0 line 4")
        # Replica 1 fails and the Job controller replaces its pod.
        api.set_pod_phase(rank1, "Failed", exit_code=137)
        rank1b = api.add_pod("kj", 1)
        api.log(rank1b, "r1 after restart")
        api.wait_for(lambda: any(r["path"].endswith(f"{rank1b}/log") for r in api.requests))
        api.log(rank0, "r0 line 5")
        api.set_pod_phase(rank0, "Succeeded")
        api.set_pod_phase(rank1b, "Succeeded")
        api.set_job_condition("kj", "Complete")
        out, err = follower.communicate(timeout=60)
    finally:
        follower.kill()
    assert follower.returncode == 0, err
    lines = out.splitlines()
    assert [ln for ln in lines if ln.startswith("[rank 0]")] == [f"[rank 0] r0 line {i}" for i in range(6)]
    assert [ln for ln in lines if ln.startswith("[rank 1]")] == ["[rank 1] r1 first", "[rank 1] r1 after restart"]


def test_logs_follow_of_a_failed_job_exits_1(cli, api):
    assert submit(cli).code == 0
    rank0 = api.add_pod("kj", 0)
    api.log(rank0, "bad things")
    api.set_pod_phase(rank0, "Failed", exit_code=2)
    api.set_job_condition("kj", "Failed", "PodFailurePolicy", "Container trainer failed with exit code 2")
    result = cli("logs", "-f", "kj", *K)
    assert result.code == 1
    assert "[rank 0] bad things" in result.out
    assert "PodFailurePolicy" in result.err


def test_rank_out_of_range_is_bad_input(cli, api):
    assert submit(cli).code == 0
    result = cli("logs", "kj", *K, "--rank", "2")
    assert result.code == 2 and "--rank" in result.err


def test_delete_propagates_in_the_background(cli, api):
    assert submit(cli).code == 0
    api.add_pod("kj", 0)
    assert cli("delete", "kj", *K).code == 0
    deletes = api.requests_to("DELETE", "/")
    assert {d["path"] for d in deletes} == {"/apis/batch/v1/namespaces/default/jobs/kj",
                                             "/api/v1/namespaces/default/services/kj"}
    assert all(d["query"]["propagationPolicy"] == "Background" for d in deletes)
    assert api.get("jobs", "default", "kj") is None
    assert not [k for k in api.objects if k[0] == "pods"]


def test_forbidden_is_one_clear_line_and_exit_3(cli, api):
    result = cli("list", *K, "-n", "locked")
    assert result.code == 3
    assert result.err.strip().count("\n") == 0
    assert 'cannot list resource "jobs"' in result.err and "forbidden" in result.err
    submitted = cli("submit", *K, "-n", "locked", "--name", "kj")
    assert submitted.code == 3 and "forbidden" in submitted.err


def test_unreachable_server_is_exit_3(cli, tmp_path, monkeypatch, ddpk_home):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{port}"))
    result = cli("list", *K)
    assert result.code == 3
    assert "cannot reach the Kubernetes API" in result.err and result.err.strip().count("\n") == 0
