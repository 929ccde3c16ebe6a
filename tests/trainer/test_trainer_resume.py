"""Exact resume after SIGKILL, and checkpoints that survive a writer killed mid-save."""

import multiprocessing
import os
import random
import re
import signal
import time

import pytest
import torch

from ddpk_trainer import checkpoint
from trainer_helpers import clean_env, run, script, start, write_cifar

pytestmark = pytest.mark.integration

PER_BATCH = 200  # 1000 CIFAR-format training images: 16 steps per epoch on 2 ranks x 32
STEPS_PER_EPOCH = 16
EPOCHS = 5


def _train_args(data_dir, ckpt_dir):
    # cifar10 brings per-rank random crops and flips, so the resumed augmentation stream is checked too.
    return ["--", "--dataset", "cifar10", "--data-dir", str(data_dir), "--model", "convnet", "--batch-size", "32",
            "--epochs", str(EPOCHS), "--lr", "0.05", "--checkpoint-dir", str(ckpt_dir), "--checkpoint-every", "5",
            "--keep-checkpoints", "50", "--seed", "3"]


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _final_model(ckpt_dir):
    state = checkpoint.load(checkpoint.list_checkpoints(str(ckpt_dir))[0])
    assert state["global_step"] == EPOCHS * STEPS_PER_EPOCH
    return state["model"]


def test_sigkill_after_a_mid_epoch_checkpoint_then_resume_auto_is_exact(tmp_path):
    data_dir = tmp_path / "data"
    write_cifar(str(data_dir), per_batch=PER_BATCH)
    launch = [script("ddpk-launch"), "--nproc-per-node", "2"]

    straight = run(launch + _train_args(data_dir, tmp_path / "straight"), clean_env())
    assert straight.returncode == 0, straight.stdout + straight.stderr

    # The victim: killed (launcher and ranks) as soon as a mid-epoch checkpoint of epoch 2 exists.
    victim_dir = tmp_path / "victim"
    victim = start(launch + _train_args(data_dir, victim_dir), clean_env())
    target = victim_dir / checkpoint.checkpoint_name(20)
    deadline = time.monotonic() + 180
    while not target.exists():
        assert victim.poll() is None and time.monotonic() < deadline, victim.communicate()[0]
        time.sleep(0.005)
    ranks = _children(victim.pid)
    victim.kill()  # SIGKILL to the launcher: its ranks must not outlive it
    victim.communicate()
    deadline = time.monotonic() + 10
    while any(_alive(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(r) for r in ranks), "ranks outlived a SIGKILLed launcher"
    last = checkpoint.load_latest(str(victim_dir))[0]["global_step"]
    assert last < EPOCHS * STEPS_PER_EPOCH, "the victim finished before it was killed"

    resumed = run(launch + _train_args(data_dir, victim_dir), clean_env())
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    m = re.search(r"resumed from \S+ at epoch (\d+) step_in_epoch (\d+) global_step (\d+)", resumed.stdout)
    assert m, resumed.stdout
    epoch, step_in_epoch, global_step = map(int, m.groups())
    assert global_step == last and step_in_epoch > 0 and global_step == epoch * STEPS_PER_EPOCH + step_in_epoch

    a, b = _final_model(tmp_path / "straight"), _final_model(victim_dir)
    for name, value in a.items():
        assert (b[name].double() - value.double()).abs().max().item() <= 1e-6, name


def _save_forever(directory, first_step, payload):
    # The writer: saves checkpoints back to back until it is killed.
    step = first_step
    while True:
        state = {"format": checkpoint.FORMAT, "model": {"w": payload, "mark": torch.tensor([step])},
                 "optimizer": {}, "scheduler": {}, "epoch": 0, "step_in_epoch": step, "global_step": step}
        checkpoint.save(state, directory, step, keep=2)
        step += 1


def test_writer_killed_at_random_points_always_leaves_a_whole_checkpoint(tmp_path):
    directory = str(tmp_path)
    payload = torch.arange(2_000_000, dtype=torch.float32)  # 8 MB: a save takes long enough to be hit mid-write
    _first_checkpoint(directory, payload)
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(0)
    mid_write_kills = 0
    for _ in range(30):
        state, _ = checkpoint.load_latest(directory)
        writer = ctx.Process(target=_save_forever, args=(directory, state["global_step"] + 1, payload))
        writer.start()
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        mid_write_kills += any(n.endswith(checkpoint.TEMP_SUFFIX) for n in os.listdir(directory))

        state, path = checkpoint.load_latest(directory)  # what --resume auto does
        assert state is not None
        assert int(state["model"]["mark"]) == state["global_step"] and path.endswith(
            checkpoint.checkpoint_name(state["global_step"]))
        assert torch.equal(state["model"]["w"], payload)
        assert not any(n.endswith(".damaged") for n in os.listdir(directory))
        checkpoint.sweep_temporaries(directory)
    assert mid_write_kills > 0, "no kill landed during a write; the test proved nothing"


def _first_checkpoint(directory, payload):
    state = {"format": checkpoint.FORMAT, "model": {"w": payload, "mark": torch.tensor([0])}, "optimizer": {},
             "scheduler": {}, "epoch": 0, "step_in_epoch": 0, "global_step": 0}
    checkpoint.save(state, directory, 0, keep=2)
