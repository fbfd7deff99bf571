"""Errors of the judge's command line (never of the implementations it judges)."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """Bad usage or environment (a bad IMPL path, a hostile file, no CUDA): one line, exit 2."""
