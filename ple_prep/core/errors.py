"""Exceptions. The CLI maps BadInput to exit 2 and CheckFailed to exit 1."""


class PlePrepError(Exception):
    """Base of every error ple-prep raises on purpose."""


class BadInput(PlePrepError, ValueError):
    """The input cannot be used: a malformed, inconsistent or unsupported file, or a wrong option."""


class CheckFailed(PlePrepError):
    """A check ran and found a difference (verify)."""
