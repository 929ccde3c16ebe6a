"""Pure pieces of the trainer and launcher: sharding, schedules, augmentation, CIFAR reading, checkpoints."""

import os

import pytest
import torch
from torch.utils.data import DistributedSampler

from ddpk_trainer import checkpoint, data, distributed, launch, train
from ddpk_trainer.env import Topology
from ddpk_trainer.errors import UserError
from trainer_helpers import write_cifar

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n, world", [(10, 1), (10, 2), (10, 3), (7, 4), (3, 5), (100, 8)])
@pytest.mark.parametrize("epoch", [0, 3])
def test_shards_match_torch_distributed_sampler(n, world, epoch):
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=11)
        sampler.set_epoch(epoch)
        assert data.shard_indices(n, rank, world, seed=11, epoch=epoch).tolist() == list(sampler)


def test_shards_change_with_epoch_and_cover_the_set():
    a = data.shard_indices(20, 0, 2, seed=0, epoch=0)
    b = data.shard_indices(20, 0, 2, seed=0, epoch=1)
    assert a.tolist() != b.tolist()
    both = torch.cat([data.shard_indices(20, r, 2, 0, 0) for r in range(2)])
    assert sorted(both.tolist()) == list(range(20))


@pytest.mark.parametrize("n, world", [(10, 3), (2000, 2), (5, 8)])
def test_eval_counts_each_sample_exactly_once(n, world):
    seen = torch.cat([data.eval_indices(n, r, world) for r in range(world)])
    assert sorted(seen.tolist()) == list(range(n))


def test_lr_schedules():
    assert train.lr_factor(0, 100, 10, "cosine") == pytest.approx(0.1)
    assert train.lr_factor(9, 100, 10, "cosine") == pytest.approx(1.0)
    assert train.lr_factor(10, 100, 10, "cosine") == pytest.approx(1.0)
    assert train.lr_factor(55, 100, 10, "cosine") == pytest.approx(0.5)
    assert train.lr_factor(100, 100, 0, "cosine") == pytest.approx(0.0)
    assert [train.lr_factor(s, 100, 0, "step") for s in (0, 49, 50, 74, 75)] == pytest.approx([1, 1, 0.1, 0.1, 0.01])
    assert train.lr_factor(99, 100, 0, "constant") == 1.0


def test_augment_keeps_shape_dtype_and_is_seeded():
    images = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    g = torch.Generator()
    out1 = data.augment_batch(images, g.manual_seed(5))
    out2 = data.augment_batch(images, g.manual_seed(5))
    assert out1.dtype == torch.uint8 and out1.shape == images.shape
    assert torch.equal(out1, out2)
    assert not torch.equal(out1, data.augment_batch(images, g.manual_seed(6)))


def test_augment_is_a_shifted_or_flipped_copy():
    out = data.augment_batch(torch.full((64, 3, 32, 32), 7, dtype=torch.uint8), torch.Generator().manual_seed(0))
    # Inside the image every pixel stays 7; padding brings in zeros only at the borders.
    assert set(out.unique().tolist()) <= {0, 7}
    assert (out[:, :, 4:28, 4:28] == 7).all()
    assert (out == 0).any()


def test_synthetic_is_fixed_and_balanced():
    train_a, test_a = data.synthetic(500, 100)
    train_b, _ = data.synthetic(500, 100)
    assert torch.equal(train_a.images, train_b.images)
    assert train_a.images.dtype == torch.uint8 and train_a.images.shape == (500, 3, 32, 32)
    assert set(train_a.labels.tolist()) == set(range(10)) and len(test_a) == 100


STYLES = ["py2", "protocol2", "protocol4"]
# py2 (the download's layout) and protocol4 keep the pixels as one raw string, read in place;
# protocol2 from Python 3 turns bytes into _codecs.encode calls, which only a full unpickle reads.
IN_PLACE = {"py2": True, "protocol2": False, "protocol4": True}  # protocol4: a string outside the frames


@pytest.mark.parametrize("style", STYLES)
def test_cifar_reader_reads_every_pickle_layout(tmp_path, style):
    # 24 images make a 72 KiB pixel string: protocol 4 writes one over 64 KiB outside its frames.
    folder = write_cifar(str(tmp_path), per_batch=24, style=style)
    for root in (str(tmp_path), folder):  # the folder itself or its parent
        tr, te = data.cifar10(root)
        assert tr.images.shape == (120, 3, 32, 32) and tr.images.dtype == torch.uint8
        assert te.images.shape == (24, 3, 32, 32) and tr.labels.dtype == torch.int64
    assert (data._read_cifar_batch(os.path.join(folder, "test_batch")).pixels_at is not None) == IN_PLACE[style]


@pytest.mark.parametrize("style", STYLES)
def test_cifar_reader_keeps_pixels_labels_and_order(tmp_path, style):
    folder = write_cifar(str(tmp_path), per_batch=3, style=style)
    import pickle

    raws = []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(os.path.join(folder, name), "rb") as f:
            raws.append(pickle.load(f, encoding="bytes"))
    tr, te = data.cifar10(str(tmp_path))
    # CIFAR rows are 1024 red, then 1024 green, then 1024 blue values, each row-major 32x32.
    assert te.images[1, 2, 5, 7].item() == raws[-1][b"data"][1, 2048 + 5 * 32 + 7]
    assert torch.equal(tr.images.reshape(15, 3072), torch.from_numpy(__import__("numpy").concatenate(
        [r[b"data"] for r in raws[:5]])))
    assert tr.labels.tolist() == sum((r[b"labels"] for r in raws[:5]), [])
    assert te.labels.tolist() == raws[-1][b"labels"]


def test_cifar_reader_holds_no_batch_sized_copy(tmp_path):
    # The download's layout is read straight into the set's tensor: Python and numpy allocate
    # nothing near a batch's 2,000 x 3,072 bytes on the way (tracemalloc sees both, not torch).
    import tracemalloc

    write_cifar(str(tmp_path), per_batch=2000)
    tracemalloc.start()
    try:
        tr, te = data.cifar10(str(tmp_path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(tr) == 10000 and len(te) == 2000
    assert peak < 2000 * 3072 / 4, f"a {peak / 1e6:.1f} MB transient while reading 6.1 MB batches"


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("damage", ["truncate", "truncate-in-pixels", "garbage", "empty", "foreign-global"])
def test_cifar_reader_rejects_a_damaged_batch(tmp_path, damage, style):
    folder = write_cifar(str(tmp_path), per_batch=12, style=style)
    path = os.path.join(folder, "data_batch_3")
    blob = open(path, "rb").read()
    if damage == "truncate":
        blob = blob[: len(blob) // 2]
    elif damage == "truncate-in-pixels":
        blob = blob[: len(blob) - 12 * 3072 // 2 - 200]
    elif damage == "garbage":
        blob = b"\x00not a pickle" * 10
    elif damage == "empty":
        blob = b""
    else:
        import pickle

        blob = pickle.dumps({b"data": os.system, b"labels": []}, protocol=2)
    open(path, "wb").write(blob)
    with pytest.raises(UserError, match="data_batch_3"):
        data.cifar10(str(tmp_path))


@pytest.mark.parametrize("style", STYLES)
def test_cifar_reader_rejects_any_damage_with_a_user_error(tmp_path, style):
    # Random bytes, random cuts and random byte flips of a real batch make the unpickler raise
    # many different types (OverflowError, UnicodeDecodeError, MemoryError...); every one must
    # become the one-line UserError, never a traceback. Seeded, so a failure reproduces.
    import random

    folder = write_cifar(str(tmp_path), per_batch=4, style=style)
    good = open(os.path.join(folder, "test_batch"), "rb").read()
    path = os.path.join(str(tmp_path), "damaged_batch")
    rng = random.Random(20261129)
    kinds = set()
    for i in range(450):
        if i % 3 == 0:
            blob = rng.randbytes(rng.randint(1, 4096))
        elif i % 3 == 1:
            blob = good[: rng.randint(0, len(good) - 1)]
        else:
            flipped = bytearray(good)
            for _ in range(rng.randint(1, 8)):
                flipped[rng.randrange(min(len(good), 400))] = rng.randrange(256)  # the header, not pixels
            blob = bytes(flipped)
        open(path, "wb").write(blob)
        try:
            batch = data._read_cifar_batch(path)
            data._stack_batches([batch])
        except UserError as err:
            assert "damaged_batch" in str(err)
            kinds.add(str(err).split(": ")[2] if str(err).count(": ") >= 2 else "")
        else:
            assert i % 3 == 2, f"damage {i} was read as a valid batch"
    assert len(kinds) > 3  # the damage really reached different failure paths


def test_cifar_reader_names_a_missing_folder(tmp_path):
    with pytest.raises(UserError, match="--data-dir"):
        data.cifar10(str(tmp_path))


def _state(step: int) -> dict:
    return {"format": checkpoint.FORMAT, "model": {"w": torch.full((4,), float(step))}, "optimizer": {},
            "scheduler": {}, "epoch": 0, "step_in_epoch": step, "global_step": step}


def test_checkpoints_keep_the_newest_and_leave_no_temporaries(tmp_path):
    for step in (5, 10, 15, 20):
        checkpoint.save(_state(step), str(tmp_path), step, keep=2)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == [
        "ckpt-000000020.pt", "ckpt-000000015.pt"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000015.pt", "ckpt-000000020.pt"]


def test_resume_auto_skips_a_damaged_newest_checkpoint(tmp_path, capsys):
    for step in (1, 2):
        checkpoint.save(_state(step), str(tmp_path), step, keep=5)
    newest = checkpoint.list_checkpoints(str(tmp_path))[0]
    blob = open(newest, "rb").read()
    open(newest, "wb").write(blob[: len(blob) // 3])
    state, path = checkpoint.load_latest(str(tmp_path))
    assert state["global_step"] == 1 and path.endswith("ckpt-000000001.pt")
    assert "skipping damaged checkpoint" in capsys.readouterr().err
    # Set aside, so later saves are not pruned in favour of it.
    assert os.path.exists(newest + ".damaged") and not os.path.exists(newest)


def test_load_refuses_a_foreign_file(tmp_path):
    torch.save({"weights": torch.zeros(1)}, tmp_path / "ckpt-000000003.pt")
    with pytest.raises(checkpoint.CheckpointError, match="not a ddpk checkpoint"):
        checkpoint.load(str(tmp_path / "ckpt-000000003.pt"))
    assert checkpoint.load_latest(str(tmp_path)) == (None, None)


def test_sweep_removes_only_temporaries(tmp_path):
    checkpoint.save(_state(1), str(tmp_path), 1, keep=5)
    (tmp_path / ".ckpt-abc.tmp").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("keep")
    checkpoint.sweep_temporaries(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000001.pt", "notes.txt"]


def test_rank_env_follows_torchrun_semantics():
    topo = Topology("indexed-job", 1, 3, 2, "m-0.m", 29500)
    env = launch.rank_env({"KEEP": "1"}, topo, local_rank=1, threads=4)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                 "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "KEEP")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "MASTER_ADDR": "m-0.m", "MASTER_PORT": "29500", "OMP_NUM_THREADS": "4", "KEEP": "1"}
    assert "OMP_NUM_THREADS" not in launch.rank_env({}, topo, 0, threads=None)


@pytest.mark.parametrize("cores, ranks, gpus, requested, preset, expected", [
    (16, 4, 0, None, None, 4), (2, 4, 0, None, None, 1), (7, 2, 0, None, None, 3), (16, 2, 2, None, None, None),
    (16, 2, 0, 3, None, 3), (16, 2, 0, None, "1", None), (16, 2, 0, 5, "1", 5)])
def test_threads_per_rank(cores, ranks, gpus, requested, preset, expected):
    assert launch.threads_per_rank(cores, ranks, gpus, requested, preset) == expected


@pytest.mark.parametrize("cpu_max, cores", [("max 100000", None), ("200000 100000", 2), ("150000 100000", 1),
                                             ("50000 100000", 1), ("garbage", None)])
def test_cgroup_cpu_limit_caps_the_cores(cpu_max, cores):
    assert launch.quota_cores(cpu_max) == cores


@pytest.mark.parametrize("visible, expected", [("", 0), ("-1", 0), ("0", 1), ("0,1,3", 3), ("GPU-abc,GPU-def", 2)])
def test_visible_gpus_reads_cuda_visible_devices(visible, expected):
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": visible}) == expected


def test_launcher_args_split_at_double_dash():
    args = launch.parse_args(["--rdzv-timeout", "5", "--", "--epochs", "1", "--num-threads", "2"], {})
    assert args.rdzv_timeout == 5 and args.num_threads is None and args.nproc_per_node == "auto"
    assert args.trainer_args == ["--epochs", "1", "--num-threads", "2"]
    assert launch.parse_args([], {"DDPK_NPROC_PER_NODE": "3"}).nproc_per_node == "3"


@pytest.mark.parametrize("argv, flag", [
    (["--rdzv-timeout", "0"], "--rdzv-timeout"), (["--num-threads", "0"], "--num-threads"),
    (["--nproc-per-node", "many"], "--nproc-per-node")])
def test_launcher_rejects_bad_flags(argv, flag):
    with pytest.raises(UserError, match=flag):
        launch.parse_args(argv, {})


GLOO_RESET = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:25315: "
              "Connection reset by peer. This is typically caused by a remote worker hanging")


@pytest.mark.parametrize("err, group_is_up, expected", [
    (RuntimeError(GLOO_RESET), True, True),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:1"),
     True, True),
    (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation"), True, True),
    (RuntimeError("NCCL communicator was aborted on rank 1."), True, True),
    (RuntimeError("Application timeout caused pair closure"), True, True),  # gloo, from DDP's buffer broadcast
    (RuntimeError(GLOO_RESET), False, False),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (16x10 and 12x10)"), True, False),
    (ValueError("Connection reset by peer"), True, False),
    (torch.distributed.DistBackendError("anything"), False, True),
])
def test_collective_failure_from_a_peer_is_told_apart_from_a_bug(err, group_is_up, expected):
    assert distributed.collective_failed(err, group_is_up) is expected
