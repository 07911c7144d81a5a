"""Decoding loops: T5X's temperature sampling, exact speculative sampling and the Big Little Decoder.

(Work in progress: the loops land here.)
"""

from typing import Any, Callable, Mapping, Tuple, Union

import flax
import jax.numpy as jnp

Array = jnp.ndarray


@flax.struct.dataclass
class DecodingState:
  """The argument of `tokens_to_logits`, field for field T5X's `decoding.DecodingState`.

  cur_index: [batch] int32, the position of `cur_token[:, 0]` in each row.
  sequences: [batch, length] int32, the tokens so far (position 0 is the BOS slot).
  cur_token: [batch, k] int32, the tokens to feed at positions cur_index + 0..k-1 (k = 1 in T5X).
  cache:     the model's cache (a `network.DecoderCache`, or T5X's flax 'cache' collection).
  """
  cur_index: Array
  sequences: Array
  cur_token: Array
  cache: Any


# tokens_to_logits(DecodingState) -> (logits [batch, k, vocab] (or [batch, vocab] when k == 1,
# as T5X returns), new_cache). A callable over a `DecoderCache` writes at `cur_index`, so the loop
# moves rows back by passing an earlier index.
TokensToLogits = Callable[[DecodingState], Tuple[Array, Any]]
