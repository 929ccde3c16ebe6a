"""Datasets and the per-rank batch stream.

Small-image sets (synthetic, cifar10, fake) live on the training device as
uint8 tensors; each batch is gathered by index, augmented and normalised there
as a whole (no per-sample Python work, no float copy of the set). imagefolder
goes through torchvision and a DataLoader with workers.

Shards follow torch's DistributedSampler exactly (shuffle with seed + epoch,
pad by wrapping, take every world_size-th index), so the order of a resumed
epoch is a pure function of (seed, epoch, rank, position). Evaluation splits
the test set without padding, so every test sample counts exactly once.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import math
import os
import pickle
import struct
import tarfile
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from .errors import UserError

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR_MD5 = "c58f30108f718f92721af3b95e74349a"
SYNTHETIC_SEED = 20240611  # the synthetic set is one fixed set; --seed changes init and order only
NOISE = 3.0  # pixel noise relative to the pattern: hard enough that one epoch is not all it takes


def shard_indices(n: int, rank: int, world: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """This rank's sample order for one epoch, as torch.utils.data.DistributedSampler(drop_last=False) gives it."""
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g)
    else:
        order = torch.arange(n)
    total = math.ceil(n / world) * world
    if total > n:
        repeats = math.ceil((total - n) / n)
        order = torch.cat([order] + [order] * repeats)[:total]
    return order[rank:total:world]


def eval_indices(n: int, rank: int, world: int) -> torch.Tensor:
    """Each test sample on exactly one rank: no padding, so shards may differ by one."""
    return torch.arange(n)[rank::world]  # empty, not an error, when there are more ranks than samples


@dataclass
class DeviceImages:
    """A split held on the device: uint8 images [N, 3, H, W] and int64 labels [N]."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.labels.numel()


@dataclass
class Dataset:
    name: str
    train: object  # DeviceImages, or a torchvision dataset for imagefolder
    test: object
    num_classes: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    augment: bool


# ----------------------------------------------------------------------------- synthetic and fake


def synthetic(train_size: int = 10000, test_size: int = 2000) -> tuple[DeviceImages, DeviceImages]:
    """Ten classes, each a smooth random colour pattern, seen shifted, rescaled and through noise.

    Learnable by a small CNN in a few epochs, but not by a linear read-out of any single pixel.
    """
    g = torch.Generator().manual_seed(SYNTHETIC_SEED)
    protos = F.interpolate(torch.randn(10, 3, 4, 4, generator=g), size=(40, 40), mode="bicubic", align_corners=False)
    protos = protos / protos.flatten(1).std(dim=1).view(10, 1, 1, 1)

    windows = protos.unfold(2, 32, 1).unfold(3, 32, 1)  # [10, 3, 9, 9, 32, 32]: every 32x32 shift

    def draw(n: int) -> DeviceImages:
        labels = torch.randint(0, 10, (n,), generator=g)
        dy, dx = torch.randint(0, 9, (n,), generator=g), torch.randint(0, 9, (n,), generator=g)
        imgs = windows[labels, :, dy, dx]
        contrast = 0.6 + 0.8 * torch.rand(n, 1, 1, 1, generator=g)
        brightness = 0.5 * torch.randn(n, 1, 1, 1, generator=g)
        noise = torch.randn(imgs.shape, generator=g)
        imgs.mul_(contrast).add_(brightness).add_(noise, alpha=NOISE).mul_(40).add_(128)
        return DeviceImages(imgs.round_().clamp_(0, 255).to(torch.uint8), labels)

    return draw(train_size), draw(test_size)


def fake(train_size: int = 10000, test_size: int = 1000) -> tuple[DeviceImages, DeviceImages]:
    """Random pixels and labels: for measuring throughput, nothing to learn."""
    g = torch.Generator().manual_seed(SYNTHETIC_SEED)

    def draw(n: int) -> DeviceImages:
        return DeviceImages(torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8),
                            torch.randint(0, 10, (n,), generator=g))

    return draw(train_size), draw(test_size)


# ----------------------------------------------------------------------------- cifar10


class _CifarUnpickler(pickle.Unpickler):
    """The batches are pickled numpy arrays; any other global is refused, so a data file cannot run code.

    With ``headers_only``, numpy's ``_reconstruct`` builds an ``_ArrayHeader`` instead of an array:
    for a batch whose pixel string was cut out, it keeps the shape, dtype and order to check."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def __init__(self, file: Any, headers_only: bool = False):
        super().__init__(file, encoding="bytes")
        self.headers_only = headers_only

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name}")
        if self.headers_only and name == "_reconstruct":
            return _ArrayHeader
        return super().find_class(module, name)


class _ArrayHeader:
    """What a pickled ndarray says about itself: BUILD hands it (version, shape, dtype, fortran, bytes)."""

    def __init__(self, *_args: Any):
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


def cifar_folder(data_dir: str) -> str | None:
    """--data-dir may be the batches folder itself or its parent."""
    for candidate in (data_dir, os.path.join(data_dir, CIFAR_FOLDER)):
        if os.path.isfile(os.path.join(candidate, "test_batch")):
            return candidate
    return None


_RAW_STRINGS = {"BINSTRING", "BINBYTES", "BINBYTES8", "BYTEARRAY8"}  # the payload is the bytes themselves
_opcodes: dict[int, tuple[str, str, int, str]] = {}


def _opcode_table() -> dict[int, tuple[str, str, int, str]]:
    """opcode byte -> (name, how its argument is laid out, a size, a struct format), from pickletools."""
    if not _opcodes:
        import pickletools as pt

        prefixes = {pt.TAKEN_FROM_ARGUMENT1: (1, "<B"), pt.TAKEN_FROM_ARGUMENT4: (4, "<i"),
                    pt.TAKEN_FROM_ARGUMENT4U: (4, "<I"), pt.TAKEN_FROM_ARGUMENT8U: (8, "<Q")}
        for code, op in pt.code2op.items():
            arg = op.arg
            if arg is None:
                entry = (op.name, "none", 0, "")
            elif arg.n >= 0:
                entry = (op.name, "fixed", arg.n, "")
            elif arg.n == pt.UP_TO_NEWLINE:  # GLOBAL and INST take two lines (module, name)
                entry = (op.name, "lines", 2 if arg.name == "stringnl_noescape_pair" else 1, "")
            else:
                entry = (op.name, "prefixed", *prefixes[arg.n])
            _opcodes[ord(code)] = entry
    return _opcodes


def _largest_raw_string(buf: Any) -> tuple[int, int, int] | None:
    """Walk the pickle in ``buf`` opcode by opcode, stepping over string payloads without reading
    them: (offset of the length prefix, its width, payload length) of the largest raw byte string,
    or None when there is none or it sits inside a protocol-4 frame."""
    ops = _opcode_table()
    pos, end, best, frames = 0, len(buf), None, []
    while True:
        if pos >= end:
            raise EOFError("pickle data was truncated")
        entry = ops.get(buf[pos])
        if entry is None:
            raise pickle.UnpicklingError(f"invalid opcode {buf[pos]:#04x} at byte {pos}")
        name, kind, size, fmt = entry
        pos += 1
        if name == "STOP":
            break
        if kind == "fixed":
            if name == "FRAME" and pos + 8 <= end:
                frames.append((pos + 8, pos + 8 + int.from_bytes(buf[pos:pos + 8], "little")))
            pos += size
        elif kind == "prefixed":
            if pos + size > end:
                raise EOFError("pickle data was truncated")
            (n,) = struct.unpack_from(fmt, buf, pos)
            if n < 0:
                raise pickle.UnpicklingError(f"negative length at byte {pos}")
            if name in _RAW_STRINGS and (best is None or n > best[2]):
                best = (pos, size, n)
            pos += size + n
        elif kind == "lines":
            for _ in range(size):
                newline = buf.find(b"\n", pos)
                if newline < 0:
                    raise EOFError("pickle data was truncated")
                pos = newline + 1
    if best is None or any(lo <= best[0] < hi for lo, hi in frames):
        return None
    return best


@dataclass
class _Batch:
    """One checked batch file: its labels, and where its pixels are (N rows of 3072 bytes each)."""

    path: str
    labels: torch.Tensor
    pixels_at: int | None  # byte offset of the raw pixel string in the file, read straight into place
    array: Any = None  # else the unpickled (N, 3072) uint8 array

    def __len__(self) -> int:
        return self.labels.numel()


def _scan_batch(path: str) -> _Batch:
    """Check a batch and find its pixels without reading them.

    The real files (Python 2 pickles) hold the pixels as one raw string. The pickle is walked,
    that string's location kept, and the rest unpickled with numpy's array constructor replaced
    by a header check; the pixels are later read once, straight into the set's tensor. A batch in
    any other layout (bytes pickled by Python 3 at protocol 2, say) is unpickled whole."""
    import mmap

    import numpy as np

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        found = _largest_raw_string(buf)
        skeleton = None if found is None else buf[:found[0]] + bytes(found[1]) + buf[sum(found):]
    if skeleton is not None:
        batch = _CifarUnpickler(io.BytesIO(skeleton), headers_only=True).load()
        header = batch[b"data"]
        state = header.state if isinstance(header, _ArrayHeader) else None
        if (isinstance(state, tuple) and len(state) == 5 and state[4] == b"" and not state[3]
                and np.dtype(state[2]) == np.uint8 and tuple(state[1]) == (found[2] // 3072, 3072)
                and found[2] % 3072 == 0):
            return _Batch(path, _labels(batch[b"labels"], found[2] // 3072), found[0] + found[1])
    with open(path, "rb") as f:
        batch = _CifarUnpickler(f).load()
    data = np.asarray(batch[b"data"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise ValueError(f"expected uint8 data of shape (N, 3072), got {data.dtype} {data.shape}")
    return _Batch(path, _labels(batch[b"labels"], data.shape[0]), None, data)


def _labels(labels: Any, n: int) -> torch.Tensor:
    out = torch.tensor(list(labels), dtype=torch.int64)
    if out.numel() != n:
        raise ValueError(f"{out.numel()} labels for {n} images")
    if out.numel() and (out.min() < 0 or out.max() > 9):
        raise ValueError("labels outside 0..9")
    return out


def _read_cifar_batch(path: str) -> _Batch:
    """A batch checked and located; any damage is a one-line --data-dir error."""
    try:
        return _scan_batch(path)
    except FileNotFoundError:
        raise UserError(f"--data-dir: missing CIFAR-10 batch {path}") from None
    except OSError as err:
        raise UserError(f"--data-dir: cannot read CIFAR-10 batch {path}: {err}") from None
    except Exception as err:  # damaged pickle bytes raise almost any type: Overflow, Memory, Unicode, Recursion...
        raise UserError(f"--data-dir: corrupt or truncated CIFAR-10 batch {path}: {type(err).__name__}: {err}") from None


def _stack_batches(batches: list[_Batch]) -> torch.Tensor:
    """One uint8 tensor [N, 3, 32, 32] holding every batch's images, in order.

    Raw pixel strings are read from the file straight into their rows; an unpickled array is
    copied in and freed at once. Nothing the size of a batch is allocated besides the tensor,
    whose pages become resident only as they are filled: the set is held once at the peak."""
    import numpy as np

    out = torch.empty((sum(len(b) for b in batches), 3, 32, 32), dtype=torch.uint8)
    rows, offset = out.numpy().reshape(len(out), 3072), 0
    while batches:
        batch = batches.pop(0)  # this list holds the last reference to an unpickled array
        dest = rows[offset:offset + len(batch)]
        if batch.pixels_at is None:
            np.copyto(dest, batch.array)
        else:
            _read_into(batch.path, batch.pixels_at, memoryview(dest).cast("B"))
        offset += len(batch)
    return out


def _read_into(path: str, at: int, dest: memoryview) -> None:
    try:
        with open(path, "rb", buffering=0) as f:
            f.seek(at)
            done = 0
            while done < len(dest):
                got = f.readinto(dest[done:])
                if not got:
                    raise UserError(f"--data-dir: CIFAR-10 batch {path} ended inside its pixels (changed while read?)")
                done += got
    except OSError as err:
        raise UserError(f"--data-dir: cannot read CIFAR-10 batch {path}: {err}") from None


def download_cifar(data_dir: str) -> None:
    """Fetch and unpack CIFAR-10 once per folder; concurrent ranks wait on a lock."""
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, ".ddpk-download.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cifar_folder(data_dir):
            return
        try:
            import torchvision
        except ImportError:
            torchvision = None
        if torchvision is not None:
            torchvision.datasets.CIFAR10(root=data_dir, train=True, download=True)
            return
        with urllib.request.urlopen(CIFAR_URL, timeout=60) as response:
            blob = response.read()
        if hashlib.md5(blob).hexdigest() != CIFAR_MD5:
            raise OSError(f"checksum mismatch for {CIFAR_URL}")
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
            tar.extractall(data_dir, filter="data")


def cifar10(data_dir: str) -> tuple[DeviceImages, DeviceImages]:
    folder = cifar_folder(data_dir)
    if folder is None:
        raise UserError(f"--data-dir: no CIFAR-10 batches ({CIFAR_FOLDER}/test_batch) under {data_dir}; add --download to fetch")
    train = [_read_cifar_batch(os.path.join(folder, f"data_batch_{i}")) for i in range(1, 6)]
    test = [_read_cifar_batch(os.path.join(folder, "test_batch"))]
    train_labels, test_labels = torch.cat([b.labels for b in train]), test[0].labels
    return (DeviceImages(_stack_batches(train), train_labels),
            DeviceImages(_stack_batches(test), test_labels))


# ----------------------------------------------------------------------------- imagefolder


def imagefolder(data_dir: str, image_size: int):
    try:
        import torchvision
        from torchvision import transforms as T
    except ImportError:
        raise UserError("--dataset imagefolder: needs torchvision, which is not installed") from None
    splits = {}
    for split, names in (("train", ("train",)), ("test", ("val", "test"))):
        root = next((os.path.join(data_dir, n) for n in names if os.path.isdir(os.path.join(data_dir, n))), None)
        if root is None:
            raise UserError(f"--data-dir: {data_dir} has no {' or '.join(names)}/ folder of class folders")
        splits[split] = root
    normalize = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train_tf = T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    test_tf = T.Compose([T.Resize(int(image_size * 8 / 7)), T.CenterCrop(image_size), T.ToTensor(), normalize])
    try:
        train = torchvision.datasets.ImageFolder(splits["train"], transform=train_tf)
        test = torchvision.datasets.ImageFolder(splits["test"], transform=test_tf)
    except (FileNotFoundError, RuntimeError) as err:
        raise UserError(f"--data-dir: {err}") from None
    if train.classes != test.classes:
        raise UserError(f"--data-dir: train/ and {os.path.basename(splits['test'])}/ have different class folders")
    return train, test, len(train.classes)


# ----------------------------------------------------------------------------- loading


def load(name: str, data_dir: str | None, download: bool, image_size: int, device: torch.device) -> Dataset:
    """Read and place a dataset; bad or missing files raise UserError before any rank rendezvouses."""
    if name == "imagefolder":
        train, test, classes = imagefolder(data_dir, image_size)
        return Dataset(name, train, test, classes, IMAGENET_MEAN, IMAGENET_STD, augment=True)
    if name == "cifar10":
        if download and cifar_folder(data_dir) is None:
            download_cifar(data_dir)
        train, test = cifar10(data_dir)
        mean, std, augment = CIFAR_MEAN, CIFAR_STD, True
    elif name == "synthetic":
        train, test = synthetic()
        mean, std, augment = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), False
    else:
        train, test = fake()
        mean, std, augment = (0.5, 0.5, 0.5), (0.29, 0.29, 0.29), False
    place = lambda s: DeviceImages(s.images.to(device), s.labels.to(device))  # noqa: E731
    return Dataset(name, place(train), place(test), 10, mean, std, augment)


def _normalise(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, channels_last: bool) -> torch.Tensor:
    x = images.float().div_(255).sub_(mean).div_(std)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def augment_batch(images: torch.Tensor, g: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random crop with zero padding and horizontal flip, for the whole uint8 batch at once."""
    n, _, h, w = images.shape
    padded = F.pad(images, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=g, device=images.device)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=g, device=images.device)
    rows = (dy[:, None] + torch.arange(h, device=images.device))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=images.device))[:, None, None, :]
    batch = torch.arange(n, device=images.device)[:, None, None, None]
    chans = torch.arange(images.shape[1], device=images.device)[None, :, None, None]
    out = padded[batch, chans, rows, cols]
    flip = torch.rand(n, generator=g, device=images.device) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(3), out)


class Batches:
    """One rank's stream of (inputs, labels) micro-batches on the device."""

    def __init__(self, ds: Dataset, batch_size: int, rank: int, world: int, seed: int, device: torch.device,
                 channels_last: bool, workers: int = 0):
        self.ds, self.batch_size, self.rank, self.world, self.seed = ds, batch_size, rank, world, seed
        self.device, self.channels_last, self.workers = device, channels_last, workers
        self.mean = torch.tensor(ds.mean, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(ds.std, device=device).view(1, 3, 1, 1)
        self.on_device = isinstance(ds.train, DeviceImages)
        # Augmentation draws from a generator reseeded per micro-batch from (seed, rank, epoch, index):
        # per-rank streams that a mid-epoch resume reproduces with no saved state.
        self.aug_gen = torch.Generator(device=device) if self.on_device and ds.augment else None

    def micro_batches_per_epoch(self) -> int:
        return math.ceil(math.ceil(len(self.ds.train) / self.world) / self.batch_size)

    def train(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Micro-batches of `epoch`, beginning at micro-batch `start` (a resumed position)."""
        order = shard_indices(len(self.ds.train), self.rank, self.world, self.seed, epoch)
        if not self.on_device:
            yield from self._loader(order[start * self.batch_size :], shuffle_aug=True)
            return
        order = order.to(self.device)
        for i in range(start, self.micro_batches_per_epoch()):
            idx = order[i * self.batch_size : (i + 1) * self.batch_size]
            images = self.ds.train.images[idx]
            if self.aug_gen is not None:
                self.aug_gen.manual_seed(((self.seed * 1_000_003 + self.rank) * 10_007 + epoch) * 1_000_003 + i)
                images = augment_batch(images, self.aug_gen)
            yield _normalise(images, self.mean, self.std, self.channels_last), self.ds.train.labels[idx]

    def test(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = eval_indices(len(self.ds.test), self.rank, self.world)
        if not self.on_device:
            yield from self._loader(order, shuffle_aug=False)
            return
        order = order.to(self.device)
        step = 2 * self.batch_size
        for i in range(0, order.numel(), step):
            idx = order[i : i + step]
            yield _normalise(self.ds.test.images[idx], self.mean, self.std, self.channels_last), self.ds.test.labels[idx]

    def _loader(self, order: torch.Tensor, shuffle_aug: bool):
        loader = torch.utils.data.DataLoader(
            self.ds.train if shuffle_aug else self.ds.test,
            batch_size=self.batch_size,
            sampler=order.tolist(),
            num_workers=self.workers,
            pin_memory=self.device.type == "cuda",
        )
        for images, labels in loader:
            images = images.to(self.device, non_blocking=True)
            if self.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            yield images, labels.to(self.device, non_blocking=True)
