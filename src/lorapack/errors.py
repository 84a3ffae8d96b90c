"""Every user-facing failure is a LorapackError: the CLI prints its message on one line and exits 2."""

from __future__ import annotations


class LorapackError(Exception):
    """Base class: a problem with the user's input or environment, not a bug."""


class SpecError(LorapackError):
    """A workload, grid or server spec is malformed or inconsistent."""


class ProfileError(LorapackError):
    """A profile is missing, malformed or does not cover the request."""


class DataError(LorapackError):
    """An input data file (profiling CSV, runs CSV, trace) is missing or malformed."""
