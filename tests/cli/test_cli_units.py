"""The CLI's pure parts: config precedence, log merging and resuming, gang decisions, status mapping."""

from __future__ import annotations

import pytest

from ddpk.config import find_config, parse_config
from ddpk.errors import BadInput
from ddpk.logs import LogLine, Resume, follow_resumable, format_line, format_timestamp, iter_lines, parse_duration, parse_timestamp
from ddpk.schedulers import docker as dock
from ddpk.schedulers import kubernetes as kube
from ddpk.schedulers.container import trainer_container
from ddpk.schedulers.local import local_replicas
from ddpk.schedulers.local_supervisor import decide, exit_code
from ddpk.spec import JobSpec

pytestmark = pytest.mark.unit


# --- config ------------------------------------------------------------------


def test_config_keys_are_jobspec_fields_plus_scheduler():
    data = parse_config("scheduler = 'docker'\nreplicas = 4\nenv = { A = '1' }\ntrainer_args = ['--epochs', '2']\n", "f.toml")
    assert data == {"scheduler": "docker", "replicas": 4, "env": {"A": "1"}, "trainer_args": ["--epochs", "2"]}
    with pytest.raises(BadInput, match="f.toml: replica"):
        parse_config("replica = 4\n", "f.toml")


def test_config_file_in_working_dir_wins_over_user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    user = tmp_path / "xdg" / "ddpk" / "ddpk.toml"
    user.parent.mkdir(parents=True)
    user.write_text("replicas = 2\n")
    work = tmp_path / "work"
    work.mkdir()
    assert find_config(None, work) == user
    (work / "ddpk.toml").write_text("replicas = 3\n")
    assert find_config(None, work) == work / "ddpk.toml"


def test_flags_override_config_which_overrides_defaults(cli, ddpk_home):
    (ddpk_home.parent / "ddpk.toml").write_text(
        "scheduler = 'kubernetes'\nreplicas = 3\nport = 29600\nenv = { A = '1' }\n")
    out = cli("submit", "--dry-run", "--name", "prec", "--replicas", "2", "-e", "B=2").out
    assert out.splitlines()[0].startswith("prec -> kubernetes")
    assert "completions: 2" in out and "containerPort: 29600" in out
    assert "name: A\n" in out and "name: B\n" in out


def test_submit_generates_a_name_and_says_where_the_job_goes(cli, ddpk_home):
    first = cli("submit", "--dry-run", "--replicas", "2").out.splitlines()[0]
    name = first.split()[0]
    assert name.startswith("ddpk-") and len(name) == 10
    assert "-> local" in first


# --- logs ----------------------------------------------------------------------


def test_timestamps_round_trip_at_nanosecond_precision():
    ns = parse_timestamp("2025-01-02T03:04:05.123456789Z")
    assert format_timestamp(ns) == "2025-01-02T03:04:05.123456789Z"
    assert parse_timestamp("2025-01-02T03:04:05.1Z") == ns - 23456789
    assert parse_timestamp("2025-01-02T04:04:05+01:00") == parse_timestamp("2025-01-02T03:04:05Z")


def test_resume_drops_exactly_the_lines_already_shown():
    r = Resume()
    t1, t2 = "2025-01-01T00:00:01.5Z", "2025-01-01T00:00:02Z"
    assert [r.accept(t) for t in (t1, t2, t2)] == [True, True, True]
    r.restart()  # the reconnect starts at second 1 and repeats everything
    assert [r.accept(t) for t in (t1, t2, t2, t2)] == [False, False, False, True]


def test_follow_resumable_reconnects_without_duplicates_or_losses():
    lines = [f"2025-01-01T00:00:{i // 3:02d}.{i % 3}Z line {i}" for i in range(12)]
    connections = []

    def open_stream(since):
        connections.append(since)
        start = 0 if since is None else next(i for i, ln in enumerate(lines) if ln.split()[0][:19] >= since[:19])
        for i in range(start, len(lines)):
            if len(connections) < 3 and i == 4 * len(connections):
                raise ConnectionResetError("dropped")
            yield lines[i]

    got = [text for _, text in follow_resumable(open_stream, lambda: len(connections) >= 3, (ConnectionResetError,), retry_s=0)]
    assert got == [f"line {i}" for i in range(12)]
    assert len(connections) == 3


def test_iter_lines_holds_back_a_partial_line():
    assert list(iter_lines([b"a\nb", b"c\n", b"d"])) == ["a", "bc", "d"]


def test_prefix_is_plain_off_a_terminal_and_coloured_on_one():
    line = LogLine(1, "hello", "2025-01-01T00:00:00Z")
    assert format_line(line) == "[rank 1] hello"
    assert format_line(line, timestamps=True) == "[rank 1] 2025-01-01T00:00:00Z hello"
    assert format_line(line, colour=True).startswith("\x1b[")


def test_durations():
    assert parse_duration("10m") == 600
    assert parse_duration("1h30m") == 5400
    with pytest.raises(BadInput, match="--since"):
        parse_duration("ten minutes")


# --- local gang decisions ----------------------------------------------------------


@pytest.mark.parametrize(
    ("codes", "restarts", "action"),
    [
        ([None, None], 0, "wait"),
        ([0, None], 0, "wait"),
        ([0, 0], 0, "succeed"),
        ([137, None], 0, "restart"),
        ([None, 1], 2, "restart"),
        ([1, None], 3, "fail"),
        ([None, 2], 0, "fail"),
        ([1, 2], 0, "fail"),
    ],
)
def test_gang_decision(codes, restarts, action):
    assert decide(codes, restarts, 3)[0] == action


def test_user_error_and_spent_restarts_say_why():
    assert "user error" in decide([2, None], 0, 3)[1]
    assert "max_restarts=3 spent" in decide([None, 137], 3, 3)[1]
    both = decide([1, 137], 0, 3)[1]
    assert "replica 0 failed with exit code 1" in both and "replica 1 failed with exit code 137 (SIGKILL)" in both
    assert exit_code(-9) == 137


def test_local_replicas_run_the_rendered_command_on_host_paths():
    spec = JobSpec(name="loc", replicas=2, trainer_args=["--checkpoint-dir", "/checkpoints/sub"])
    command = ["ddpk-launch", "--rdzv-timeout", "600", "--", "--checkpoint-dir", "/checkpoints/sub"]
    env = {"MASTER_ADDR": "loc-0.loc", "MASTER_PORT": "29500", "DDPK_CHECKPOINT_DIR": "/checkpoints",
           "DDPK_METRICS_FILE": "/checkpoints/metrics.jsonl"}
    reps = local_replicas(spec, command, env, "/venv/bin/ddpk-launch", {"/checkpoints": "/run/loc/ck"})
    assert [r["env"]["JOB_COMPLETION_INDEX"] for r in reps] == ["0", "1"]
    assert reps[0]["argv"] == ["/venv/bin/ddpk-launch", "--rdzv-timeout", "600", "--", "--checkpoint-dir", "/run/loc/ck/sub"]
    assert reps[1]["env"]["MASTER_ADDR"] == "127.0.0.1"
    assert reps[1]["env"]["DDPK_METRICS_FILE"] == "/run/loc/ck/metrics.jsonl"
    assert "MASTER_PORT" not in reps[1]["env"]


def test_replicas_on_this_machine_split_its_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    _, env = trainer_container(JobSpec(name="cores", replicas=2), "--scheduler local")
    assert env["OMP_NUM_THREADS"] == "4"
    _, env = trainer_container(JobSpec(name="cores", replicas=16), "--scheduler local")
    assert env["OMP_NUM_THREADS"] == "1"
    _, env = trainer_container(JobSpec(name="cores", replicas=2, env={"OMP_NUM_THREADS": "3"}), "--scheduler docker")
    assert env["OMP_NUM_THREADS"] == "3"


# --- docker plan -------------------------------------------------------------------


def test_docker_containers_look_like_the_pods():
    spec = JobSpec(name="dj", replicas=2, max_restarts=4, shm_size="1Gi", data_pvc="/srv/data")
    plan = dock.container_plans(spec, ["ddpk-launch", "--rdzv-timeout", "600", "--"], {"MASTER_ADDR": "dj-0.dj"})
    c1 = plan["containers"][1]
    assert (c1["name"], c1["hostname"], c1["aliases"]) == ("dj-1", "dj-1", ["dj-1.dj"])
    assert c1["entrypoint"] == ["ddpk-launch"] and c1["environment"]["JOB_COMPLETION_INDEX"] == "1"
    # The supervisor restarts the gang; the engine must not restart a replica on its own.
    assert c1["restart_policy"] == {"Name": "no"}
    assert c1["shm_size"] == 2**30
    assert c1["mounts"] == [
        {"type": "volume", "source": "dj-checkpoints", "target": "/checkpoints", "read_only": False},
        {"type": "bind", "source": "/srv/data", "target": "/data", "read_only": True},
    ]
    assert plan["volumes"] == ["dj-checkpoints"]


def docker_attrs(i, status, code=0):
    return {"Name": f"/dj-{i}", "Config": {"Labels": {dock.INDEX_LABEL: str(i)}},
            "State": {"Status": status, "ExitCode": code, "StartedAt": "2025-01-01T00:00:00Z",
                      "FinishedAt": "0001-01-01T00:00:00Z"}}


def supervisor_state(phase, reason=None, restarts=0, exit_codes=(None, None)):
    return {"name": "dj", "phase": phase, "reason": reason, "supervisor_pid": 4242, "restarts": restarts,
            "start_time": "2025-01-01T00:00:00Z", "completion_time": None,
            "replicas": [{"index": i, "state": "Running", "pid": None, "restarts": restarts, "exit_code": c}
                         for i, c in enumerate(exit_codes)]}


def test_docker_phase_and_restarts_come_from_the_supervisor():
    restarting = supervisor_state("Running", "restart 1/3: replica 1 failed with exit code 137 (SIGKILL)", 1)
    # Mid-restart: the killed container is down, but the supervisor is about to start the gang again.
    st = dock.job_state("dj", [docker_attrs(0, "running"), docker_attrs(1, "exited", 137)], restarting, True)
    assert st.phase == "Running" and "replica 1" in st.reason
    assert [(r.state, r.restarts, r.exit_code) for r in st.replicas] == [("Running", 1, None), ("Failed", 1, 137)]

    failed = supervisor_state("Failed", "replica 0 failed with exit code 2: a user error, not retried")
    st = dock.job_state("dj", [docker_attrs(0, "exited", 2), docker_attrs(1, "exited", 137)], failed, False)
    assert st.phase == "Failed" and "user error" in st.reason

    # A running container remembers the code of its last finished run through the supervisor.
    st = dock.job_state("dj", [docker_attrs(0, "running"), docker_attrs(1, "running")],
                        supervisor_state("Running", restarts=1, exit_codes=(1, 137)), True)
    assert [r.exit_code for r in st.replicas] == [1, 137]


def test_a_docker_job_whose_supervisor_is_gone_fails_instead_of_hanging():
    st = dock.job_state("dj", [docker_attrs(0, "running"), docker_attrs(1, "exited", 137)],
                        supervisor_state("Running"), False)
    assert st.phase == "Failed" and "supervisor (pid 4242) is gone" in st.reason
    done = dock.job_state("dj", [docker_attrs(0, "exited"), docker_attrs(1, "exited")],
                          supervisor_state("Succeeded"), False)
    assert done.phase == "Succeeded" and done.reason is None


def test_docker_phase_from_the_containers_alone_without_supervisor_state():
    assert dock.job_state("dj", [docker_attrs(0, "running"), docker_attrs(1, "running")], None, False).phase == "Running"
    assert dock.job_state("dj", [docker_attrs(0, "exited"), docker_attrs(1, "exited")], None, False).phase == "Succeeded"
    failed = dock.job_state("dj", [docker_attrs(0, "running"), docker_attrs(1, "exited", 137)], None, False)
    assert failed.phase == "Failed" and "code 137" in failed.reason
    user = dock.job_state("dj", [docker_attrs(0, "exited", 137), docker_attrs(1, "exited", 2)], None, False)
    assert "replica 1" in user.reason and "user error" in user.reason


# --- kubernetes status -----------------------------------------------------------------


def job(conditions=(), completions=2):
    return {"metadata": {"name": "kj", "uid": "u"}, "spec": {"completions": completions},
            "status": {"conditions": [dict(c, status="True") for c in conditions]}}


def pod(index, phase, created="2025-01-01T00:00:00Z", **status):
    return {"metadata": {"name": f"kj-{index}-{created[-3:-1]}", "creationTimestamp": created,
                         "labels": {kube.INDEX_KEY: str(index)}},
            "status": {"phase": phase, **status}}


@pytest.mark.parametrize(
    ("conditions", "phase"),
    [
        ([{"type": "Complete"}], "Succeeded"),
        ([{"type": "SuccessCriteriaMet"}], "Succeeded"),
        ([{"type": "FailureTarget", "reason": "PodFailurePolicy"}], "Failed"),
        ([{"type": "Failed", "reason": "BackoffLimitExceeded"}], "Failed"),
        ([{"type": "Suspended"}], "Pending"),
        ([], "Running"),
    ],
)
def test_job_conditions_decide_the_phase(conditions, phase):
    assert kube.job_status(job(conditions), [pod(0, "Running")]).phase == phase


def test_unschedulable_pods_explain_a_pending_job():
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}
    st = kube.job_status(job(), [pod(0, "Pending", conditions=[unschedulable])])
    assert st.phase == "Pending"
    assert "Insufficient nvidia.com/gpu" in st.reason and "Insufficient nvidia.com/gpu" in st.replicas[0].detail


def test_replaced_pods_count_as_restarts():
    failed = pod(1, "Failed", "2025-01-01T00:00:01Z")
    again = pod(1, "Running", "2025-01-01T00:00:09Z")
    st = kube.job_status(job(), [pod(0, "Running"), failed, again])
    assert [r.restarts for r in st.replicas] == [0, 1]
    assert st.replicas[1].detail == again["metadata"]["name"]


def test_object_paths():
    assert kube.object_path("v1", "Service", "ns", "a") == "/api/v1/namespaces/ns/services/a"
    assert kube.object_path("batch/v1", "Job", "ns") == "/apis/batch/v1/namespaces/ns/jobs"
    with pytest.raises(BadInput):
        kube.object_path("kubeflow.org/v1", "PyTorchJob", "ns", "a")
