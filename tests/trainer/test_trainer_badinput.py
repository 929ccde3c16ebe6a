"""Bad input to the trainer: exit 2, one line naming the flag or file, nothing created.

The trainer's main() runs in this process: every rejection happens before the
rendezvous, so no process group or child process is involved.
"""

import os

import pytest
import torch

from ddpk_trainer import checkpoint
from ddpk_trainer.errors import EXIT_USER_ERROR
from ddpk_trainer.train import main
from trainer_helpers import clean_env, write_cifar

pytestmark = pytest.mark.unit


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in clean_env().items():
        monkeypatch.setenv(name, value)
    (tmp_path / "a-file").write_text("not a folder")
    write_cifar(str(tmp_path / "cifar"), per_batch=8)
    (tmp_path / "images").mkdir()
    torch.save({"format": checkpoint.FORMAT, "model": {}}, tmp_path / "partial.pt")
    (tmp_path / "garbage.pt").write_bytes(b"PK\x03\x04 this is no zip")
    return tmp_path


def _damage(path, how):
    blob = open(path, "rb").read()
    open(path, "wb").write(blob[: len(blob) // 2] if how == "truncate" else b"\x80\x02garbage")


CASES = [
    # (id, argv, words the line must contain, env)
    ("missing-data-dir", ["--dataset", "cifar10", "--data-dir", "{tmp}/nope"], "--data-dir", {}),
    ("cifar-without-data-dir", ["--dataset", "cifar10"], "--data-dir", {}),
    ("empty-data-dir", ["--dataset", "cifar10", "--data-dir", "{tmp}/images"], "--data-dir", {}),
    ("imagefolder-without-train", ["--dataset", "imagefolder", "--data-dir", "{tmp}/images"], "--data-dir", {}),
    ("unknown-dataset", ["--dataset", "mnist"], "--dataset", {}),
    ("unknown-model", ["--model", "vgg11"], "--model", {}),
    ("unknown-tv-model", ["--model", "tv:no_such_net"], "--model", {}),
    ("negative-batch-size", ["--batch-size", "-4"], "--batch-size", {}),
    ("zero-batch-size", ["--batch-size", "0"], "--batch-size", {}),
    ("zero-epochs", ["--epochs", "0"], "--epochs", {}),
    ("zero-lr", ["--lr", "0"], "--lr", {}),
    ("zero-timeout", ["--timeout", "0"], "--timeout", {}),
    ("zero-grad-accum", ["--grad-accum", "0"], "--grad-accum", {}),
    ("label-smoothing-one", ["--label-smoothing", "1"], "--label-smoothing", {}),
    ("bad-amp", ["--amp", "fp8"], "--amp", {}),
    ("unknown-flag", ["--epoch", "3"], "--epoch", {}),
    ("unwritable-checkpoint-dir", ["--checkpoint-dir", "{tmp}/a-file/ckpt"], "--checkpoint-dir", {}),
    ("checkpoint-dir-is-a-file", ["--checkpoint-dir", "{tmp}/a-file"], "--checkpoint-dir", {}),
    ("unwritable-metrics-file", ["--metrics-file", "{tmp}/a-file/m.jsonl"], "--metrics-file", {}),
    ("corrupt-batch", ["--dataset", "cifar10", "--data-dir", "{tmp}/cifar"], "data_batch_2", {"damage": "corrupt"}),
    ("truncated-batch", ["--dataset", "cifar10", "--data-dir", "{tmp}/cifar"], "data_batch_2", {"damage": "truncate"}),
    ("download-not-cifar", ["--download"], "--download", {}),
    ("checkpoint-every-without-dir", ["--checkpoint-every", "5"], "--checkpoint-every", {}),
    ("nccl-on-cpu", ["--backend", "nccl", "--device", "cpu"], "--backend", {}),
    ("cuda-without-gpu", ["--device", "cuda"], "--device", {}),
    ("dp-with-many-ranks", ["--strategy", "dp"], "--strategy", {"RANK": "0", "WORLD_SIZE": "2"}),
    ("resume-missing-file", ["--resume", "{tmp}/none.pt"], "--resume", {}),
    ("resume-corrupt-checkpoint", ["--resume", "{tmp}/garbage.pt"], "--resume", {}),
    ("resume-foreign-checkpoint", ["--resume", "{tmp}/partial.pt"], "--resume", {}),
    ("rank-outside-world", [], "RANK", {"RANK": "2", "WORLD_SIZE": "2"}),
]


@pytest.mark.parametrize("argv, words, extra", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line_and_creates_nothing(workdir, capsys, monkeypatch, argv, words, extra):
    extra = dict(extra)
    damage = extra.pop("damage", None)
    if damage:
        _damage(workdir / "cifar" / "cifar-10-batches-py" / "data_batch_2", damage)
    for name, value in extra.items():
        monkeypatch.setenv(name, value)
    before = sorted(os.listdir(workdir))
    ckpt = workdir / "ckpt"
    argv = [a.format(tmp=workdir) for a in argv]
    if "--checkpoint-dir" not in argv and "--checkpoint-every" not in argv:
        argv += ["--checkpoint-dir", str(ckpt)]

    code = main(argv)

    out, err = capsys.readouterr()
    assert code == EXIT_USER_ERROR
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ddpk-train: ") and words in lines[0]
    assert "Traceback" not in err and out == ""
    assert sorted(os.listdir(workdir)) == before
