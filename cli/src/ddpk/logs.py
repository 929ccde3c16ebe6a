"""Many log streams as one: ``[rank i]`` prefixes, timestamps, resumable follows.

Every backend turns its streams into ``LogLine`` values; this module merges
them, prints them (coloured prefixes on a TTY, plain text otherwise) and
resumes a dropped stream from its last timestamp without repeating or losing
a line.
"""

from __future__ import annotations

import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TextIO

from ddpk.errors import BadInput


@dataclass(frozen=True)
class LogLine:
    rank: int
    text: str
    ts: str | None = None
    """RFC 3339 timestamp with nanoseconds, as kubelet and dockerd write them."""


# --- timestamps ------------------------------------------------------------

_TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)$")


def parse_timestamp(ts: str) -> int:
    """RFC 3339 (optionally with up to nine fraction digits) to nanoseconds since the epoch."""
    m = _TS.match(ts)
    if not m:
        raise ValueError(f"not an RFC 3339 timestamp: {ts!r}")
    base, frac, zone = m.groups()
    zone = "+00:00" if zone == "Z" else zone
    seconds = int(datetime.fromisoformat(base + zone).timestamp())
    return seconds * 1_000_000_000 + int((frac or "").ljust(9, "0"))


def format_timestamp(ns: int) -> str:
    """Nanoseconds since the epoch to RFC 3339 with nine fraction digits, in UTC."""
    seconds, frac = divmod(ns, 1_000_000_000)
    base = datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{base}.{frac:09d}Z"


def now_timestamp() -> str:
    return format_timestamp(time.time_ns())


def split_timestamp(raw: str) -> tuple[str | None, str]:
    """Split a ``<timestamp> <text>`` line as written with timestamps=true."""
    head, sep, rest = raw.partition(" ")
    if sep and _TS.match(head):
        return head, rest
    return None, raw


_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def parse_duration(value: str, flag: str = "--since") -> float:
    """``90s``, ``10m``, ``1h30m`` to seconds (the kubectl/stern form)."""
    m = _DURATION.match(value.strip())
    if not value.strip() or not m or not any(m.groups()):
        raise BadInput(flag, f"{value!r} is not a duration like 30s, 10m or 1h30m")
    h, mi, s = (int(g or 0) for g in m.groups())
    return float(h * 3600 + mi * 60 + s)


class Resume:
    """Remembers where a stream got to, so a reconnect skips what was already shown.

    A server resumes from a timestamp at second precision at best, so the
    reconnected stream repeats lines; those are dropped by comparing full
    timestamps, and among lines sharing the newest timestamp, by count.
    """

    def __init__(self) -> None:
        self.last_ns: int | None = None
        self.seen_at_last = 0
        self._skip = 0

    def restart(self) -> None:
        """A new connection begins: repeat-lines at the last timestamp will come again."""
        self._skip = self.seen_at_last

    def accept(self, ts: str) -> bool:
        ns = parse_timestamp(ts)
        if self.last_ns is not None and ns < self.last_ns:
            return False
        if self.last_ns is not None and ns == self.last_ns:
            if self._skip > 0:
                self._skip -= 1
                return False
            self.seen_at_last += 1
            return True
        self.last_ns, self.seen_at_last, self._skip = ns, 1, 0
        return True

    @property
    def since(self) -> str | None:
        """The timestamp to resume from."""
        return None if self.last_ns is None else format_timestamp(self.last_ns)


def follow_resumable(
    open_stream: Callable[[str | None], Iterable[str]],
    finished: Callable[[], bool],
    dropped: tuple[type[BaseException], ...],
    retry_s: float = 0.5,
) -> Iterator[tuple[str, str]]:
    """Follow one timestamped stream to its end, reconnecting whenever it drops.

    ``open_stream(since)`` yields raw ``<timestamp> <text>`` lines from ``since``
    (None: from the start). The stream counts as over when it ends (or drops)
    and ``finished()`` says the source will write nothing more.
    """
    resume = Resume()
    while True:
        resume.restart()
        try:
            for raw in open_stream(resume.since):
                ts, text = split_timestamp(raw)
                if ts is None:
                    continue
                if resume.accept(ts):
                    yield ts, text
        except dropped:
            pass
        if finished():
            return
        time.sleep(retry_s)


def iter_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """Decode a byte stream into lines, holding back a partial last line."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", "replace").rstrip("\r")
    if pending:
        yield pending.decode("utf-8", "replace").rstrip("\r")


# --- merging and printing ---------------------------------------------------

_DONE = object()


def merge(streams: Iterable[Iterator[LogLine]]) -> Iterator[LogLine]:
    """Interleave several line iterators as their lines arrive (one thread each).

    An exception in any stream is raised here, after the others are abandoned.
    """
    q: queue.Queue = queue.Queue(maxsize=10_000)
    threads = []

    def pump(it: Iterator[LogLine]) -> None:
        try:
            for line in it:
                q.put(line)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            q.put(exc)
        finally:
            q.put(_DONE)

    for it in streams:
        t = threading.Thread(target=pump, args=(it,), daemon=True)
        t.start()
        threads.append(t)
    running = len(threads)
    while running:
        item = q.get()
        if item is _DONE:
            running -= 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield item


_COLOURS = (36, 33, 32, 35, 34, 31, 96, 93, 92, 95, 94, 91)


def use_colour(stream: TextIO) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set."""
    return "NO_COLOR" not in os.environ and hasattr(stream, "isatty") and stream.isatty()


def format_line(line: LogLine, colour: bool = False, timestamps: bool = False) -> str:
    prefix = f"[rank {line.rank}]"
    if colour:
        prefix = f"\x1b[{_COLOURS[line.rank % len(_COLOURS)]}m{prefix}\x1b[0m"
    if timestamps and line.ts:
        return f"{prefix} {line.ts} {line.text}"
    return f"{prefix} {line.text}"


def print_lines(lines: Iterable[LogLine], timestamps: bool = False, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    colour = use_colour(out)
    for line in lines:
        out.write(format_line(line, colour, timestamps) + "\n")
        out.flush()


def since_cutoff(since_s: float | None) -> int | None:
    """The earliest timestamp (ns) a ``--since`` window admits."""
    return None if since_s is None else time.time_ns() - int(since_s * 1e9)
