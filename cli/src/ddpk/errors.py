"""The one place where failures become exit codes.

0 ok, 1 the job failed, 2 bad input, 3 cluster or engine unreachable,
130 interrupted. Everything the CLI raises for a user-facing reason is a
``DdpkError``; the CLI entry point prints its one-line message (no traceback
unless ``--debug``) and exits with its code.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130


class DdpkError(Exception):
    """A failure with a one-line message meant for the user."""

    exit_code = EXIT_JOB_FAILED


class BadInput(DdpkError):
    """The user's input is wrong. ``field`` names the flag or config key."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class Unreachable(DdpkError):
    """The cluster, the Docker engine or the network did not answer."""

    exit_code = EXIT_UNREACHABLE


class JobFailed(DdpkError):
    """The job ran and failed."""

    exit_code = EXIT_JOB_FAILED
