"""Random parameters without compiling `init` (which takes ~20 s on a busy 2-core CPU).

Shapes come from `jax.eval_shape(network.init_params)` (tracing only); values are drawn in
numpy at the scale of T5X's initialisers, which is all the infer/sharding tests need.
"""

import functools

import jax
import numpy as np
from flax import traverse_util

from speculative_t5x import network


def random_params(config: network.T5Config, seed: int = 0):
  """A params tree of `config`'s shapes: kernels N(0, 1/fan_in), embeddings N(0, 1), scales 1."""
  shapes, _ = jax.eval_shape(functools.partial(network.init_params, config))
  rng = np.random.default_rng(seed)
  flat = {}
  for path, leaf in traverse_util.flatten_dict(shapes).items():
    if path[-1] == 'scale':
      value = np.ones(leaf.shape, np.float32)
    elif path[-1] in ('embedding', 'rel_embedding'):
      value = rng.normal(0.0, 1.0, leaf.shape).astype(np.float32)
    else:
      value = rng.normal(0.0, leaf.shape[0] ** -0.5, leaf.shape).astype(np.float32)
    flat[path] = value
  return traverse_util.unflatten_dict(flat)
