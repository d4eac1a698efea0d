"""The one base of every error KVScope reports to a user.

Each module raises a specific subclass whose message names the input and the fix (``ScenarioError``,
``NotebookError``, ``ProbeError``, ``ModelLoadError``, ``RopeUnsupported``, ``SkillFileError``,
``AttributionError``, ``StrategyError``); the CLI and the app catch :class:`KVScopeError` alone. It is a
``ValueError``: every refusal is about a value the caller passed.
"""

from __future__ import annotations


class KVScopeError(ValueError):
    """Bad input or a refusal, with a message for the user; nothing was changed."""


class Unreachable(KVScopeError):
    """A service the user named does not answer at all (nothing listens there): final at once, not retried, and a
    situation to report rather than a failure of the input's form."""


class NotebookError(KVScopeError):
    """An operation that cannot apply to a notebook; the message says which input and why."""
