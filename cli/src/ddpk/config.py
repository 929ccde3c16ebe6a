"""ddpk.toml: defaults for job options and the scheduler.

Keys are JobSpec field names plus ``scheduler``. The file is ``--config FILE``
when given, else ``./ddpk.toml``, else ``ddpk.toml`` in the user config dir.
Flags override the file; the file overrides JobSpec's defaults. A malformed
file or an unknown key is bad input naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from ddpk.errors import BadInput
from ddpk.spec import JobSpec

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

FILENAME = "ddpk.toml"

# JobSpec's annotations are strings (postponed evaluation); each maps to a check.
_CHECKS: dict[str, tuple[str, Any]] = {
    "str": ("a string", lambda v: isinstance(v, str)),
    "str | None": ("a string", lambda v: isinstance(v, str)),
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "int | None": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "list[str]": ("an array of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "dict[str, str]": (
        "a table of strings",
        lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
    ),
}


def _field_types() -> dict[str, str]:
    types = {f.name: str(f.type) for f in dataclasses.fields(JobSpec)}
    types["scheduler"] = "str"
    return types


def user_config_path() -> Path:
    import typer

    return Path(typer.get_app_dir("ddpk")) / FILENAME


def find_config(explicit: str | None, cwd: Path | None = None) -> Path | None:
    """The config file to read, or None when there is none."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            raise BadInput("--config", f"{explicit}: no such file")
        return path
    local = (cwd or Path.cwd()) / FILENAME
    if local.is_file():
        return local
    user = user_config_path()
    return user if user.is_file() else None


def parse_config(text: str, path: str) -> dict[str, Any]:
    """Check a config file's content; every problem names the file and the key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(path, f"not valid TOML: {exc}") from None
    types = _field_types()
    for key, value in data.items():
        if key not in types:
            raise BadInput(f"{path}: {key}", f"unknown key (known: scheduler and the JobSpec fields: {', '.join(sorted(types))})")
        what, ok = _CHECKS[types[key]]
        if not ok(value):
            raise BadInput(f"{path}: {key}", f"expected {what}, got {value!r}")
    return data


def load_config(explicit: str | None = None, cwd: Path | None = None) -> tuple[dict[str, Any], Path | None]:
    """The checked settings and the file they came from ({} and None without a file)."""
    path = find_config(explicit, cwd)
    if path is None:
        return {}, None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(str(path), f"cannot read: {exc}") from None
    return parse_config(text, str(path)), path
