"""Typed errors of the orchestrator."""

from __future__ import annotations

from stalwart.core.errors import StalwartError


class InvalidTransition(StalwartError):
    """The controller tried a state change that the transition table does not allow (a bug)."""
