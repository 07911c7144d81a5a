"""speculative_t5x: exact speculative decoding and the Big Little Decoder for T5X-style T5 models."""

import importlib
from types import ModuleType

__version__ = '0.1.0'


class MissingExtraError(ImportError):
  """An optional dependency is absent; the message is one line naming the extra to install."""


def require(module: str, extra: str, purpose: str) -> ModuleType:
  """Imports `module`, or raises MissingExtraError: '<purpose> need: pip install ...[<extra>]'.

  The core install (jax, flax, gin, orbax, sentencepiece) never needs this; seqio/TensorFlow,
  sacrebleu, torch/transformers and CTranslate2 are extras (setup.py's extras_require).
  """
  try:
    return importlib.import_module(module)
  except ImportError:
    raise MissingExtraError(
        f"{purpose} need: pip install 'speculative_t5x[{extra}]' (from a clone: pip install -e "
        f"'.[{extra}]'); {module} is not installed") from None
