"""Exit codes of ddpk-train and ddpk-launch.

EXIT_USER_ERROR marks input that no restart can fix (bad flag, missing data,
unwritable checkpoint dir). Rendered manifests map it to "fail the job, do not
retry" (Indexed Job podFailurePolicy); any other non-zero code is retryable.
"""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input to the trainer or launcher; printed as one line, exit 2."""
