"""The project's errors."""

from __future__ import annotations


class ComparisonError(ValueError):
    """Two runs cannot be compared: shapes, pairing or prompts disagree."""
