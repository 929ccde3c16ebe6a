"""Gradient parity: two DDP ranks with SyncBN equal one process on the same global batches.

With DistributedSampler semantics, rank r's step-s batch is perm[r::2][s*B:(s+1)*B],
so the two ranks' batches together are perm[2sB:2(s+1)B], exactly one process's
step-s batch of size 2B. DDP averages the ranks' mean-loss gradients, and SyncBN
normalises with the statistics of the union, so in fp32 the parameters after k
steps agree up to summation order: we require |a - b| <= 1e-5 + 1e-4 |b|.
Without SyncBN each rank normalises with its own half-batch statistics and the
runs part; that control shows the comparison can fail.
"""

import sys

import pytest
import torch

from ddpk_trainer import checkpoint
from trainer_helpers import clean_env, run

pytestmark = pytest.mark.integration

STEPS = 6
COMMON = ["--model", "convnet", "--dataset", "synthetic", "--max-steps", str(STEPS), "--lr", "0.05",
          "--seed", "7", "--resume", "none", "--amp", "none"]


def _final_state(ckpt_dir) -> dict:
    (latest, *_) = checkpoint.list_checkpoints(str(ckpt_dir))
    state = checkpoint.load(latest)
    assert state["global_step"] == STEPS
    return state["model"]


def _two_ranks(ckpt_dir, *extra):
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  "-m", "ddpk_trainer", *COMMON, "--batch-size", "16", "--checkpoint-dir", str(ckpt_dir), *extra],
                 clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world_size=2" in result.stdout
    return _final_state(ckpt_dir)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("single")
    result = run([sys.executable, "-m", "ddpk_trainer", *COMMON, "--batch-size", "32", "--checkpoint-dir", str(ckpt)],
                 clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world_size=1" in result.stdout
    return _final_state(ckpt)


def test_two_ranks_with_sync_bn_match_one_process(tmp_path, one_process):
    two = _two_ranks(tmp_path, "--sync-bn")
    assert two.keys() == one_process.keys()
    for name, single in one_process.items():
        if single.is_floating_point():
            torch.testing.assert_close(two[name], single, rtol=1e-4, atol=1e-5, msg=name)
        else:
            assert torch.equal(two[name], single), name
    # The parameters did move: parity is not two copies of the initial weights.
    assert not torch.equal(one_process["0.weight"], _initial_first_conv())


def test_without_sync_bn_the_ranks_part_from_one_process(tmp_path, one_process):
    two = _two_ranks(tmp_path)
    diffs = [(two[k] - v).abs().max().item() for k, v in one_process.items() if v.is_floating_point()]
    assert max(diffs) > 1e-4


def _initial_first_conv() -> torch.Tensor:
    from ddpk_trainer import models

    torch.manual_seed(7)
    return models.build("convnet", 10).state_dict()["0.weight"]
