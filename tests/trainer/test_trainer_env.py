"""Topology resolution: which environment wins, and what it resolves to."""

import pytest

from ddpk_trainer.env import Topology, expand_nodelist, resolve
from ddpk_trainer.errors import UserError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
        ("a[1-2],b[08-10]", ["a1", "a2", "b08", "b09", "b10"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x[3],y", ["x3", "y"]),
        ("h-1.example,h-2.example", ["h-1.example", "h-2.example"]),
        ("", []),
    ],
)
def test_slurm_nodelist_expands(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["gpu[01-03", "gpu01]", "gpu[a-b]", "gpu[5-3]", "gpu[]"])
def test_slurm_nodelist_rejects_malformed(nodelist):
    with pytest.raises(UserError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(nodelist)


@pytest.mark.parametrize(
    "env, nproc, expected",
    [
        (
            {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
             "MASTER_ADDR": "m", "MASTER_PORT": "1234", "JOB_COMPLETION_INDEX": "0"},
            None,
            Topology("torchrun", 1, 2, 2, "m", 1234),
        ),
        (
            {"JOB_COMPLETION_INDEX": "2", "DDPK_NNODES": "3", "MASTER_ADDR": "job-0.job", "MASTER_PORT": "29501"},
            "4",
            Topology("indexed-job", 2, 3, 4, "job-0.job", 29501),
        ),
        (
            {"JOB_COMPLETION_INDEX": "0", "DDPK_NNODES": "2", "MASTER_ADDR": "job-0.job"},
            "auto",
            Topology("indexed-job", 0, 2, None, "job-0.job", 29500),
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "pj-master-0", "MASTER_PORT": "23456"},
            "2",
            Topology("pytorchjob", 1, 2, 2, "pj-master-0", 23456),
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "8", "PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "4",
             "PET_MASTER_ADDR": "pj-master-0", "PET_MASTER_PORT": "23456", "MASTER_ADDR": "other"},
            "1",
            Topology("pytorchjob", 1, 2, 4, "pj-master-0", 23456),
        ),
        (
            {"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_NODEID": "1", "SLURM_LOCALID": "0",
             "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_JOB_NUM_NODES": "3"},
            "2",
            Topology("slurm", 1, 3, 2, "gpu01", 29500),
        ),
        (
            {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NODEID": "1", "SLURM_LOCALID": "1",
             "SLURM_JOB_NODELIST": "gpu[01-02]", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000"},
            None,
            Topology("slurm", 5, 8, 1, "10.0.0.1", 4000),
        ),
        ({}, "2", Topology("single", 0, 1, 2, "127.0.0.1", 0)),
        ({"MASTER_PORT": "29999"}, None, Topology("single", 0, 1, None, "127.0.0.1", 29999)),
    ],
    ids=["torchrun-wins", "indexed-job", "indexed-job-auto", "pytorchjob", "pytorchjob-pet", "slurm-task-per-node",
         "slurm-task-per-rank", "single", "single-port"],
)
def test_resolve_picks_first_matching_environment(env, nproc, expected):
    assert resolve(env, nproc) == expected


@pytest.mark.parametrize(
    "env, nproc, names",
    [
        ({"JOB_COMPLETION_INDEX": "2", "DDPK_NNODES": "2"}, None, "JOB_COMPLETION_INDEX"),
        ({"JOB_COMPLETION_INDEX": "x"}, None, "JOB_COMPLETION_INDEX"),
        ({"JOB_COMPLETION_INDEX": "0", "DDPK_NNODES": "0"}, None, "DDPK_NNODES"),
        ({"JOB_COMPLETION_INDEX": "0", "MASTER_PORT": "70000"}, None, "MASTER_PORT"),
        ({"JOB_COMPLETION_INDEX": "0"}, "zero", "--nproc-per-node"),
        ({}, "0", "--nproc-per-node"),
        ({"PET_NNODES": "1:4", "RANK": "0", "WORLD_SIZE": "1"}, None, "PET_NNODES"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a[1-2"}, None, "SLURM_JOB_NODELIST"),
    ],
)
def test_resolve_names_the_bad_variable(env, nproc, names):
    with pytest.raises(UserError, match=names):
        resolve(env, nproc)


def test_describe_states_source_and_world():
    line = Topology("indexed-job", 1, 2, 3, "m", 5).describe()
    assert line == "environment=indexed-job node_rank=1 nnodes=2 nproc_per_node=3 world_size=6 master=m:5"
