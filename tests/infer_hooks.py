"""A chunk hook for the kill-and-resume test: the job kills itself right after the chunk named
by $KILL_AFTER_CHUNK is committed, so the test knows exactly what is on disk (no race with a
watcher). An environment variable, not a gin parameter: the killed and the resumed run must
have the same config, or the resumed run would refuse the killed run's chunks."""

import os
import signal

import gin


@gin.configurable
def kill_after_chunk(chunk: int) -> None:
  if str(chunk) == os.environ.get('KILL_AFTER_CHUNK'):
    os.kill(os.getpid(), signal.SIGKILL)


class Stopped(Exception):
  """Raised by `stop_after_chunk`: an in-process job stopped at a known chunk."""


@gin.configurable
def stop_after_chunk(chunk: int) -> None:
  """As kill_after_chunk, for jobs run in the test's own process ($STOP_AFTER_CHUNK)."""
  if str(chunk) == os.environ.get('STOP_AFTER_CHUNK'):
    raise Stopped(chunk)
