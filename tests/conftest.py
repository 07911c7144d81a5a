"""Shared test fixtures: tiny random T5 models and the path of ../shared/data."""

import functools
import os
import pathlib
import shutil
import tempfile
from typing import List

# The tests check what programs compute, not how fast they run, and XLA:CPU's backend (LLVM)
# optimisation is most of the compile time of the many small programs here: level 0 took
# tests/test_fast_path.py from 321 s to 191 s and two chi-square tests from 119 s to 70 s
# (2-core CPU). XLA:CPU's newer fusion emitters cost as much again: without them the decode
# loops of tests/test_fast_path.py compiled in 8.5-10 s instead of 16-23 s. Set before JAX
# starts; subprocesses inherit them; a flag the user set wins.
FUSION_EMITTERS_OFF = '--xla_cpu_use_fusion_emitters=false'
for _flag in ('--xla_backend_optimization_level=0', FUSION_EMITTERS_OFF):
  if _flag.split('=')[0] not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# One persistent compilation cache per test run, shared by the xdist workers (this file is
# loaded by pytest's main process before it starts them, and they inherit the variable) and by
# the processes tests start: many tests compile the same programs (the embedded pair's loops at
# the same shapes, the tiny models' decoders), and what one process compiled another loads. Only
# programs that take a second or more to compile are stored (JAX's threshold). A cache the user
# set is used as it is and kept; this one is removed when the run ends (pytest_sessionfinish).
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(prefix='speculative_t5x_tests_jax_')
  _RUN_CACHE = os.environ['JAX_COMPILATION_CACHE_DIR']
else:
  _RUN_CACHE = None

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp
import pytest

from speculative_t5x import models
from speculative_t5x import network


def data_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get(
      'SPECULATIVE_T5X_DATA', pathlib.Path(__file__).resolve().parents[1].parent / 'shared' / 'data'))


def shared_files(*relative_paths: str) -> List[pathlib.Path]:
  """The paths under `data_dir()`; skips the calling test, naming those that are absent."""
  paths = [data_dir() / path for path in relative_paths]
  missing = [str(path) for path in paths if not path.exists()]
  if missing:
    pytest.skip(f'shared data not found: {", ".join(missing)} (set SPECULATIVE_T5X_DATA to the '
                'shared data folder).')
  return paths


@pytest.fixture(scope='session')
def t5x_data() -> pathlib.Path:
  """../shared/data/t5x, with T5X's tiny checkpoint and its reference outputs."""
  return shared_files('t5x/test_t5_tiny.checkpoint_0', 't5x/test_t5_tiny_reference.npz')[0].parent


@pytest.fixture
def multi30k() -> pathlib.Path:
  """The data folder holding multi30k/ (train, val, test_2016_flickr)."""
  return shared_files('multi30k/train.de')[0].parents[1]


def tiny_config(**overrides) -> network.T5Config:
  values = dict(vocab_size=64, emb_dim=16, num_heads=2, head_dim=8, num_encoder_layers=1,
                num_decoder_layers=2, mlp_dim=32, mlp_activations=('gelu', 'linear'),
                dropout_rate=0.0)
  values.update(overrides)
  return network.T5Config(**values)


def random_model(config: network.T5Config, seed: int = 0, logit_scale: float = 1.0):
  """A (module, params) pair; logit_scale sharpens/flattens its distributions."""
  params, _ = network.init_params(config, jax.random.PRNGKey(seed))
  if config.feature_width:  # (its init passes the embedding through and ignores the feature)
    kernel = params['decoder']['input_projection']['kernel']
    params['decoder']['input_projection']['kernel'] = jax.random.normal(
        jax.random.PRNGKey(seed + 1), kernel.shape, kernel.dtype) / kernel.shape[0] ** 0.5
  if logit_scale != 1.0:
    params['decoder']['logits_dense']['kernel'] = params['decoder']['logits_dense']['kernel'] * (
        logit_scale)
  return network.Transformer(config), params


@functools.partial(jax.jit, static_argnums=0, static_argnames=('method', 'static_args'))
def _apply(module, variables, traced_args, method, static_args, **kwargs):
  args = list(traced_args)
  for index, value in static_args:
    args.insert(index, value)
  return module.apply(variables, *args, method=method, **kwargs)


def apply(module, variables, *args, method=None, **kwargs):
  """`module.apply(variables, *args, method=method, **kwargs)` as one compiled program, cached
  per config, method and shapes for every test in the process: run op by op, each of a tiny
  model's ~100 operations compiles on its own at every new shape (most of such a test's time).
  Python ints among `args` (lengths) are static; arrays, and every keyword argument, traced."""
  static_args = tuple((i, a) for i, a in enumerate(args) if isinstance(a, int))
  traced_args = tuple(a for a in args if not isinstance(a, int))
  return _apply(module, variables, traced_args, method=method, static_args=static_args, **kwargs)


def start_decoding(module, params, encoder_tokens, max_length):
  """(cache, tokens_to_logits) for a model on encoder_tokens [batch, enc_length]."""
  encoded = apply(module, {'params': params}, encoder_tokens, method=network.Transformer.encode)
  cache = apply(module, {'params': params}, encoded, encoder_tokens, max_length,
                method=network.Transformer.init_cache)
  return cache, models.make_tokens_to_logits(module, params)


def ragged_tokens(rng, batch: int, length: int, vocab: int, min_length: int = 1):
  """Random tokens in [2, vocab) with per-row lengths, zero-padded: [batch, length] int32."""
  k1, k2 = jax.random.split(rng)
  tokens = jax.random.randint(k1, (batch, length), 2, vocab)
  lengths = jax.random.randint(k2, (batch,), min_length, length + 1)
  return jnp.where(jnp.arange(length)[None] < lengths[:, None], tokens, 0).astype(jnp.int32)


def run_command(main, define_flags, name: str, args, capsys):
  """(exit status, stderr) of the command `name` ARGS through its `main` (after
  `define_flags`), in this process: its flags, its gin parsing, its error handling."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  import gin  # pylint: disable=g-import-not-at-top
  from speculative_t5x import gin_utils  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  define_flags()
  flags.FLAGS.unparse_flags()
  argv = gin_utils.rewrite_gin_args([name, *args])
  flags.FLAGS(argv)
  try:
    main(argv)
    status = 0
  except SystemExit as e:
    status = e.code
  finally:
    gin.clear_config()
  return status, capsys.readouterr().err


def pytest_sessionfinish(session: pytest.Session) -> None:  # pylint: disable=unused-argument
  """The process that made the run's compilation cache removes it (the workers inherit it)."""
  if _RUN_CACHE is not None:
    shutil.rmtree(_RUN_CACHE, ignore_errors=True)
