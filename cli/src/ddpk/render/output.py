"""Manifests as YAML text or files: the only part of ddpk.render that touches the filesystem."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


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

    Each file is written whole to a temporary name and then renamed, so a failure never
    leaves half a manifest behind.
    """
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(objs, str):
        items = [(script_name, objs)]
    else:
        items = [(file_name(obj), to_yaml([obj])) for obj in objs]
    written = []
    for name, text in items:
        target = directory / name
        tmp = target.with_name(f".{name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, target)
        written.append(target)
    return written
