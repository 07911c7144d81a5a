"""The error a job reports to its user as one line (lowest floor: every level may raise it)."""


class InferError(ValueError):
  """A problem with a job's input, config or environment, reported as one line `error: ...`."""
