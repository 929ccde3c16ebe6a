"""Every flag's bad values: exit 2, one line naming the flag, no traceback, nothing created."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit

JOB_FLAG_CASES = [
    ("--name", "Bad_Name"),
    ("--name", "1job"),
    ("--name", "a" * 62),
    ("--replicas", "0"),
    ("--replicas", "-3"),
    ("--replicas", "1000000"),
    ("--replicas", "two"),
    ("--nproc-per-node", "0"),
    ("--nproc-per-node", "many"),
    ("--gpus", "-1"),
    ("--image", "has space"),
    ("--image-pull-policy", "Sometimes"),
    ("--cpu", "5x"),
    ("--cpu-limit", "-1"),
    ("--memory", "4GB"),
    ("--memory-limit", "lots"),
    ("--shm-size", "0"),
    ("--env", "NOEQUALS"),
    ("--env", "MASTER_ADDR=10.0.0.1"),
    ("--env", "1X=y"),
    ("--env-from-secret", "Not_A_Secret"),
    ("--data-pvc", "Bad_Volume"),
    ("--data-mount", "relative/path"),
    ("--checkpoint-mount", "/dev/shm"),
    ("--node-selector", "novalue"),
    ("--toleration", "foo"),
    ("--toleration", "key=value:Sometimes"),
    ("--priority-class", "Bad_Class"),
    ("--queue", "Q!"),
    ("--service-account", "Bad_SA"),
    ("--max-restarts", "-1"),
    ("--active-deadline", "0"),
    ("--ttl", "-5"),
    ("--port", "70000"),
    ("--port", "0"),
    ("--rdzv-timeout", "0"),
    ("--namespace", "Bad_NS"),
    ("--scheduler", "slurm-ish"),
    ("--validate", "strict"),
]


def assert_bad(result, flag: str) -> None:
    assert result.code == 2, (result.code, result.out, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert flag in lines[0], lines[0]
    assert "Traceback" not in result.err


@pytest.mark.parametrize(("flag", "value"), JOB_FLAG_CASES)
def test_bad_job_flag_exits_2_naming_it(cli, ddpk_home, flag, value):
    result = cli("submit", "--dry-run", flag, value)
    assert_bad(result, flag)
    assert not ddpk_home.exists()


@pytest.mark.parametrize(("flag", "value"), [(f, v) for f, v in JOB_FLAG_CASES if f not in ("--scheduler", "--validate")])
def test_render_refuses_the_same_values(cli, ddpk_home, flag, value):
    assert_bad(cli("render", flag, value), flag)


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["render", "--target", "helm"], "--target"),
        (["status", "x", "--output", "xml"], "--output"),
        (["list", "-o", "csv"], "--output"),
        (["logs", "x", "--since", "yesterday"], "--since"),
        (["logs", "x", "--tail", "-1"], "--tail"),
        (["wait", "x", "--timeout", "soon"], "--timeout"),
        (["status", "no-such-job"], "JOB"),
        (["logs", "no-such-job"], "JOB"),
        (["delete", "no-such-job"], "JOB"),
        (["wait", "no-such-job"], "JOB"),
        (["submit", "--dry-run", "--config", "missing.toml"], "--config"),
        (["submit", "--dry-run", "-s", "kubernetes", "--kubeconfig", "missing.yaml"], "--kubeconfig"),
        (["submit", "--dry-run", "--bogus-flag"], "--bogus-flag"),
    ],
)
def test_other_bad_input_exits_2_naming_it(cli, ddpk_home, args, flag):
    assert_bad(cli(*args), flag)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("replicas = \n", "ddpk.toml"),
        ("colour = 'blue'\n", "colour"),
        ("replicas = 'two'\n", "replicas"),
        ("replicas = 0\n", "replicas"),
        ("env = ['A=1']\n", "env"),
        ("scheduler = 'nomad'\n", "scheduler"),
        ("shm_size = '1 GiB'\n", "shm_size"),
    ],
)
def test_bad_config_file_exits_2_naming_file_and_key(cli, ddpk_home, text, key):
    (ddpk_home.parent / "ddpk.toml").write_text(text)
    result = cli("submit", "--dry-run")
    assert_bad(result, key)
    assert "ddpk.toml" in result.err


def test_debug_shows_the_traceback(cli, ddpk_home):
    result = cli("submit", "--dry-run", "--replicas", "0", "--debug")
    assert result.code == 2
    assert "Traceback" in result.err


@pytest.mark.parametrize("where", ["afile", "afile/sub"])
def test_render_output_dir_that_is_or_is_under_a_file(cli, ddpk_home, where):
    afile = ddpk_home.parent / "afile"
    afile.write_text("not a folder\n")
    assert_bad(cli("render", "--output-dir", str(ddpk_home.parent / where)), "--output-dir")
    assert afile.read_text() == "not a folder\n"
    assert sorted(p.name for p in ddpk_home.parent.iterdir()) == ["afile"]
