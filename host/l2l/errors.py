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
