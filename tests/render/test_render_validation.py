"""Bad input: one clear message per error, naming the flag; good input comes back normalized."""

from __future__ import annotations

import dataclasses

import pytest

from ddpk.errors import EXIT_BAD_INPUT, BadInput
from ddpk.quantity import parse_quantity
from ddpk.render import TARGETS, render
from ddpk.spec import JobSpec, parse_env_pairs, parse_toleration, validate

pytestmark = pytest.mark.unit

BASE = JobSpec(name="job")


def spec(**changes) -> JobSpec:
    return dataclasses.replace(BASE, **changes)


BAD = [
    # names: DNS-1123 labels that can also name the Service
    ("uppercase name", dict(name="Train"), "--name", "DNS-1123"),
    ("name with underscore", dict(name="my_job"), "--name", "DNS-1123"),
    ("name ending in dash", dict(name="job-"), "--name", "DNS-1123"),
    ("name starting with a digit", dict(name="1job"), "--name", "letter"),
    ("empty name", dict(name=""), "--name", "DNS-1123"),
    ("name over 63", dict(name="a" * 64), "--name", "limit is 63"),
    # the last index's hostname must fit too: 61 + "-9" = 63 fits, 61 + "-10" does not
    ("hostname of index 10 over 63", dict(name="a" * 61, replicas=11), "--name", "hostname"),
    ("hostname of index 0 over 63", dict(name="a" * 62), "--name", "hostname"),
    ("bad namespace", dict(namespace="Team A"), "--namespace", "DNS-1123"),
    # topology
    ("zero replicas", dict(replicas=0), "--replicas", "at least 1"),
    ("negative replicas", dict(replicas=-2), "--replicas", "at least 1"),
    ("a million replicas", dict(replicas=10**6), "--replicas", "at most 100000"),
    ("replicas not a number", dict(replicas="two"), "--replicas", "not an integer"),
    ("nproc zero", dict(nproc_per_node="0"), "--nproc-per-node", "'auto'"),
    ("nproc word", dict(nproc_per_node="gpu"), "--nproc-per-node", "'auto'"),
    ("nproc negative", dict(nproc_per_node=-1), "--nproc-per-node", "'auto'"),
    ("negative gpus", dict(gpus_per_replica=-1), "--gpus", "at least 0"),
    # quantities
    ("cpu not a quantity", dict(cpu_request="two"), "--cpu", "Kubernetes quantity"),
    ("memory with a bad suffix", dict(memory_request="4GB"), "--memory", "Kubernetes quantity"),
    ("memory limit lowercase suffix", dict(memory_limit="4gi"), "--memory-limit", "Kubernetes quantity"),
    ("cpu limit zero", dict(cpu_limit="0"), "--cpu-limit", "greater than zero"),
    ("cpu limit below request", dict(cpu_request="2", cpu_limit="1500m"), "--cpu-limit", "below the request"),
    ("memory limit below request", dict(memory_request="4Gi", memory_limit="4G"), "--memory-limit", "below"),
    ("shm with spaces", dict(shm_size="2 Gi"), "--shm-size", "Kubernetes quantity"),
    # environment
    ("reserved MASTER_ADDR", dict(env={"MASTER_ADDR": "x"}), "--env", "reserved"),
    ("reserved MASTER_PORT", dict(env={"MASTER_PORT": "1"}), "--env", "reserved"),
    ("reserved RANK", dict(env={"RANK": "0"}), "--env", "reserved"),
    ("reserved WORLD_SIZE", dict(env={"WORLD_SIZE": "2"}), "--env", "reserved"),
    ("reserved LOCAL_RANK", dict(env={"LOCAL_RANK": "0"}), "--env", "reserved"),
    ("reserved JOB_COMPLETION_INDEX", dict(env={"JOB_COMPLETION_INDEX": "0"}), "--env", "reserved"),
    ("reserved DDPK_ prefix", dict(env={"DDPK_NNODES": "4"}), "--env", "reserved"),
    ("env name with a dash", dict(env={"MY-VAR": "1"}), "--env", "not a valid environment variable name"),
    ("env name starting with a digit", dict(env={"1X": "1"}), "--env", "not a valid"),
    ("secret name uppercase", dict(env_from_secrets=["HF"]), "--env-from-secret", "DNS-1123"),
    # volumes
    ("pvc name with spaces", dict(data_pvc="my data"), "--data-pvc", "DNS-1123"),
    ("checkpoint pvc uppercase", dict(checkpoint_pvc="Ckpt"), "--checkpoint-pvc", "DNS-1123"),
    ("relative mount", dict(data_mount="data"), "--data-mount", "absolute"),
    ("mount over /dev/shm", dict(checkpoint_mount="/dev/shm"), "--checkpoint-mount", "already mounted"),
    ("same mount twice", dict(data_pvc="d", data_mount="/checkpoints"), "--data-mount", "different"),
    # placement
    ("toleration without effect", dict(tolerations=["gpu"]), "--toleration", "key[=value]:Effect"),
    ("toleration with unknown effect", dict(tolerations=["gpu:Sometimes"]), "--toleration", "NoSchedule"),
    ("toleration with empty key", dict(tolerations=["=v:NoSchedule"]), "--toleration", "label key"),
    ("node selector bad value", dict(node_selector={"zone": "a b"}), "--node-selector", "label value"),
    ("queue uppercase", dict(queue="Team"), "--queue", "DNS-1123"),
    ("priority class underscore", dict(priority_class="high_prio"), "--priority-class", "DNS-1123"),
    ("image with whitespace", dict(image="ddpk latest"), "--image", "image reference"),
    ("pull policy", dict(image_pull_policy="always"), "--image-pull-policy", "IfNotPresent"),
    # lifecycle
    ("port zero", dict(port=0), "--port", "at least 1"),
    ("port too high", dict(port=65536), "--port", "at most 65535"),
    ("negative max restarts", dict(max_restarts=-1), "--max-restarts", "at least 0"),
    ("backoff over int32", dict(replicas=1000, max_restarts=10**7), "--max-restarts", "at most"),
    ("zero deadline", dict(active_deadline_s=0), "--active-deadline", "at least 1"),
    ("negative ttl", dict(ttl_after_finished_s=-1), "--ttl", "at least 0"),
    ("zero rendezvous timeout", dict(rdzv_timeout_s=0), "--rdzv-timeout", "at least 1"),
]


@pytest.mark.parametrize("case, changes, field, words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_field(case, changes, field, words):
    with pytest.raises(BadInput) as caught:
        validate(spec(**changes))
    error = caught.value
    assert error.field == field
    assert words in error.message
    assert str(error).startswith(f"{field}: ")
    assert "\n" not in str(error)
    assert error.exit_code == EXIT_BAD_INPUT


@pytest.mark.parametrize("target", TARGETS)
def test_render_refuses_what_validate_refuses(target):
    with pytest.raises(BadInput) as caught:
        render(spec(replicas=0), target)
    assert caught.value.field == "--replicas"


@pytest.mark.parametrize(
    "target, name, replicas",
    [
        # <name>-master-0 / <name>-worker-<i>: "-worker-" is longer than "-"
        ("pytorchjob", "a" * 55, 3),
        # <name>-node-0-<i>
        ("jobset", "a" * 55, 2),
    ],
)
def test_each_target_checks_its_own_hostnames(target, name, replicas):
    validate(spec(name=name, replicas=replicas))
    with pytest.raises(BadInput) as caught:
        render(spec(name=name, replicas=replicas), target)
    assert caught.value.field == "--name"
    assert "hostname" in caught.value.message


def test_longest_fitting_name_renders_everywhere_it_fits():
    # 61 characters and index 9: "<name>-9" is exactly 63.
    render(spec(name="a" * 61, replicas=10), "indexedjob")


def test_slurm_takes_paths_not_claims_and_no_secrets():
    with pytest.raises(BadInput) as caught:
        render(spec(checkpoint_pvc="ckpt"), "slurm")
    assert caught.value.field == "--checkpoint-pvc"
    with pytest.raises(BadInput) as caught:
        render(spec(env_from_secrets=["hf-token"]), "slurm")
    assert caught.value.field == "--env-from-secret"


def test_unknown_target():
    with pytest.raises(BadInput) as caught:
        render(BASE, "helm")
    assert caught.value.field == "--target"


def test_validate_normalizes():
    out = validate(spec(replicas="3", nproc_per_node=4, data_mount="/data/", port="29501"))
    assert (out.replicas, out.nproc_per_node, out.data_mount, out.port) == (3, "4", "/data", 29501)
    assert validate(spec(nproc_per_node=" auto ")).nproc_per_node == "auto"


def test_an_unset_port_stays_unset_and_renders_as_the_default():
    out = validate(spec())
    assert out.port is None and out.master_port == 29500
    assert validate(spec(port=29501)).master_port == 29501


def test_validate_does_not_share_mutable_fields():
    original = spec(env={"A": "1"})
    out = validate(original)
    out.env["B"] = "2"
    assert original.env == {"A": "1"}


@pytest.mark.parametrize(
    "text, value",
    [("500m", "0.5"), ("2", "2"), ("4Gi", str(4 * 2**30)), ("1.5G", "1500000000"), ("1e3", "1000"),
     ("100Mi", str(100 * 2**20)), (".5", "0.5"), ("+1k", "1000"), ("250u", "0.00025")],
)
def test_quantities_parse_like_kubernetes(text, value):
    from decimal import Decimal

    assert parse_quantity(text, "--memory") == Decimal(value)


@pytest.mark.parametrize("text", ["", "Gi", "4 Gi", "4GB", "4gi", "1.2.3", "-1", "0", "1e", "0x10", "4Gi "])
def test_bad_quantities(text):
    with pytest.raises(BadInput) as caught:
        parse_quantity(text, "--memory")
    assert caught.value.field == "--memory"


def test_env_pairs():
    assert parse_env_pairs(["A=1", "B=x=y", "C="], "--env") == {"A": "1", "B": "x=y", "C": ""}
    assert parse_env_pairs(None, "--env") == {}
    for bad, words in (["A"], "KEY=VALUE"), (["=1"], "KEY=VALUE"), (["A=1", "A=2"], "twice"):
        with pytest.raises(BadInput) as caught:
            parse_env_pairs(bad, "--node-selector")
        assert caught.value.field == "--node-selector"
        assert words in caught.value.message


def test_tolerations():
    assert parse_toleration("nvidia.com/gpu:NoSchedule") == {
        "key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"
    }
    assert parse_toleration("dedicated=train:NoExecute") == {
        "key": "dedicated", "operator": "Equal", "value": "train", "effect": "NoExecute"
    }
    with pytest.raises(BadInput) as caught:
        parse_toleration("dedicated=train")
    assert caught.value.field == "--toleration"
