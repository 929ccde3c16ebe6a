"""CIFAR-10 python-pickle batches of random images, byte-for-byte in the real layout.

The real files are Python 2 pickles (protocol 2) whose strings, numpy buffer included,
are Python 2 `str` objects. Readers open them with `encoding="bytes"` (keys come back
as b"data") or `encoding="latin1"` (keys come back as "data"), so the bench writes
them the same way and either reader sees what it would see on the real download.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np

IMAGE_BYTES = 3 * 32 * 32
LABEL_NAMES = [b"airplane", b"automobile", b"bird", b"cat", b"deer",
               b"dog", b"frog", b"horse", b"ship", b"truck"]


class _Py2Pickler(pickle._Pickler):  # the pure-Python pickler: its dispatch table can be extended
    """Writes every `bytes` object as a Python 2 `str` (BINSTRING), as the real files hold them."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_py2_str(self, obj: bytes) -> None:
        n = len(obj)
        if n < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", n) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str


def _dump(obj: dict, path: Path) -> None:
    with path.open("wb") as f:
        _Py2Pickler(f, protocol=2).dump(obj)


def _batch(rng: np.random.Generator, n: int, label: bytes, first: int) -> dict:
    return {
        b"batch_label": label,
        b"labels": rng.integers(0, 10, size=n).tolist(),
        b"data": rng.integers(0, 256, size=(n, IMAGE_BYTES), dtype=np.uint8),
        b"filenames": [b"bench_%06d.png" % (first + i) for i in range(n)],
    }


def write_cifar10(root: Path, n_train: int, n_test: int, seed: int = 0) -> Path:
    """Write `cifar-10-batches-py/` under `root` (five train batches, one test batch, meta)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    # Five train batches as in the real set; a count that does not split evenly puts the rest in the first ones.
    sizes = [n_train // 5 + (i < n_train % 5) for i in range(5)]
    first = 0
    for i, n in enumerate(sizes):
        _dump(_batch(rng, n, b"training batch %d of 5" % (i + 1), first), folder / f"data_batch_{i + 1}")
        first += n
    _dump(_batch(rng, n_test, b"testing batch 1 of 1", n_train), folder / "test_batch")
    _dump({b"num_cases_per_batch": sizes[0], b"label_names": LABEL_NAMES,
           b"num_vis": IMAGE_BYTES}, folder / "batches.meta")
    return folder
