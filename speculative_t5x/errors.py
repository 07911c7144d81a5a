"""The error a job reports to its user as one line (lowest floor: every level may raise it)."""

from typing import Any


class InferError(ValueError):
  """A problem with a job's input, config or environment, reported as one line `error: ...`."""


def must_be(name: str, allowed: str, got: Any) -> str:
  """The one wording of a setting's bad value, for flags and gin settings alike:
  "<name> must be <allowed>, got <got>" (got as repr, so that '3' and 3 read differently)."""
  return f'{name} must be {allowed}, got {got!r}'
