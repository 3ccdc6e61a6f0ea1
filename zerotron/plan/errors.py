"""The one exception of the planner."""

from __future__ import annotations


class PlanError(ValueError):
    """A plan that cannot be made; the one-line message says what to change."""
