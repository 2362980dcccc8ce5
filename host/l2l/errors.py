"""Errors a user can cause, kept apart from programming errors.

The CLI turns a :class:`UserError` into one line on stderr and exit code 2;
everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


class EpsWorkerError(RuntimeError):
    """An update failed on the EPS's background worker."""


class PeerLostError(RuntimeError):
    """Another machine of a distributed run died or stopped answering: one line, exit code 1."""


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (for a :class:`UserError` that quotes a library's error)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
