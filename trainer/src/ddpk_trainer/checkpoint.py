"""Crash-safe checkpoints: written whole or not at all, found newest-first on resume.

A checkpoint is `ckpt-<global step>.pt`. It is written to a temporary file in
the same folder, flushed and fsynced, renamed over with os.replace (atomic on
POSIX), and the folder is fsynced so the rename survives a power cut. A reader
therefore sees either the old set of files or the new one; temporaries never
match the checkpoint name and are swept on the next start.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from typing import Any

import torch

PREFIX, SUFFIX = "ckpt-", ".pt"
TEMP_SUFFIX = ".tmp"
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
REQUIRED_KEYS = ("format", "model", "optimizer", "scheduler", "epoch", "step_in_epoch", "global_step")
FORMAT = 1


class CheckpointError(Exception):
    """A checkpoint file that cannot be used (truncated, foreign, wrong format)."""


def checkpoint_name(global_step: int) -> str:
    return f"{PREFIX}{global_step:09d}{SUFFIX}"


def list_checkpoints(directory: str) -> list[str]:
    """Checkpoint paths, newest (highest step) first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    steps = sorted(((int(m.group(1)), n) for n in names if (m := _NAME.match(n))), reverse=True)
    return [os.path.join(directory, n) for _, n in steps]


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(state: dict[str, Any], directory: str, global_step: int, keep: int) -> str:
    """Write atomically, then drop all but the newest `keep` checkpoints."""
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, checkpoint_name(global_step))
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", suffix=TEMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)
    for old in list_checkpoints(directory)[keep:]:
        try:
            os.unlink(old)
        except FileNotFoundError:
            pass
    return final


def sweep_temporaries(directory: str) -> None:
    """Remove temporaries left by a writer that was killed mid-save (only rank 0 writes, so none is live)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(".ckpt-") and name.endswith(TEMP_SUFFIX):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def load(path: str) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for a damaged zip/pickle
        first_line = (str(err).splitlines() or [""])[0]
        raise CheckpointError(f"{path}: cannot be read ({type(err).__name__}: {first_line})") from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED_KEYS):
        raise CheckpointError(f"{path}: not a ddpk checkpoint")
    if state["format"] != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {state['format']}, expected {FORMAT}")
    return state


def load_latest(directory: str) -> tuple[dict[str, Any] | None, str | None]:
    """The newest checkpoint that loads. Damaged ones are skipped with a warning and renamed
    aside, so newer saves are not pruned in their favour."""
    for path in list_checkpoints(directory):
        try:
            return load(path), path
        except CheckpointError as err:
            print(f"ddpk-train: warning: skipping damaged checkpoint {err}", file=sys.stderr, flush=True)
            try:
                os.replace(path, path + ".damaged")
            except OSError:
                pass
    return None, None
