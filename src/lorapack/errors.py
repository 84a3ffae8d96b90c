"""Every user-facing failure is a LorapackError: the CLI prints its message on one line and exits 2."""

from __future__ import annotations


class LorapackError(Exception):
    """Base class: a problem with the user's input or environment, not a bug."""


class SpecError(LorapackError, ValueError):
    """A workload, grid, server spec or API argument is malformed or inconsistent.

    Also a ``ValueError``, so Python callers can catch bad arguments the usual way."""


class ResourceLimitError(SpecError):
    """A run would need more requests, memory or steps than the limits allow (``lorapack.guards``)."""


class ProfileError(LorapackError):
    """A profile is missing, malformed or does not cover the request."""


class LorapackWarning(UserWarning):
    """A result that stands but deserves a word (an extrapolation, requests vLLM would reject); the CLI
    prints it as one ``warning:`` line on stderr."""


class DataError(LorapackError):
    """An input data file (profiling CSV, runs CSV, trace) is missing or malformed."""
