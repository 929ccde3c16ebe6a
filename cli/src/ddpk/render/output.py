"""Manifests as YAML text or files: the only part of ddpk.render that touches the filesystem."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ddpk.errors import BadInput


def to_yaml(objs: list[dict[str, Any]]) -> str:
    """One YAML document per object, in order, keys in the renderer's order."""
    import yaml  # pyyaml is imported only when YAML is wanted.

    return yaml.safe_dump_all(objs, sort_keys=False, default_flow_style=False, explicit_start=True)


def file_name(obj: dict[str, Any]) -> str:
    return f"{obj['metadata']['name']}-{obj['kind'].lower()}.yaml"


def write_dir(
    objs: list[dict[str, Any]] | str, path: str | os.PathLike[str], script_name: str = "job.sbatch"
) -> list[Path]:
    """One file per object in ``path`` (created if missing); an sbatch script goes to ``script_name``.

    Every file is first written whole to a temporary name; only when all are written are
    they renamed into place, so a failure leaves no manifest behind, whole or half.
    """
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise BadInput("--output-dir", f"{path} exists and is not a folder")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput("--output-dir", f"cannot create {path}: {exc.strerror or exc}") from None
    if isinstance(objs, str):
        items = [(script_name, objs)]
    else:
        items = [(file_name(obj), to_yaml([obj])) for obj in objs]
    staged = []
    try:
        for name, text in items:
            tmp = directory / f".{name}.tmp"
            staged.append(tmp)
            tmp.write_text(text)
    except OSError as exc:
        for tmp in staged:
            if tmp.is_file():
                tmp.unlink()
        raise BadInput("--output-dir", f"cannot write to {path}: {exc.strerror or exc}") from None
    written = []
    for tmp, (name, _) in zip(staged, items, strict=True):
        target = directory / name
        os.replace(tmp, target)
        written.append(target)
    return written
