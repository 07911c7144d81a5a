"""The network: T5X's parameter tree and outputs, and the multi-token per-row cache."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization
from flax.traverse_util import flatten_dict

from speculative_t5x import checkpoints
from speculative_t5x import data
from speculative_t5x import network
from conftest import apply, ragged_tokens, tiny_config, random_model, start_decoding


def test_t5_1_1_small_parameter_count_and_axes():
  cfg = network.T5Config(vocab_size=32128, emb_dim=512, num_heads=6, head_dim=64,
                         num_encoder_layers=8, num_decoder_layers=8, mlp_dim=1024,
                         mlp_activations=('gelu', 'linear'))
  shapes = jax.eval_shape(lambda: network.init_params(cfg))
  params, axes = shapes
  flat = flatten_dict(params, sep='/')
  assert sum(x.size for x in flat.values()) == 76_961_152  # T5X's T5.1.1-small count
  flat_axes = flatten_dict(axes, sep='/')
  assert set(flat_axes) == {k + '_axes' for k in flat}
  assert flat_axes['token_embedder/embedding_axes'].names == ('vocab', 'embed')
  assert flat_axes['decoder/logits_dense/kernel_axes'].names == ('embed', 'vocab')
  assert flat_axes['decoder/layers_3/mlp/wo/kernel_axes'].names == ('mlp', 'embed')
  assert flat_axes['encoder/relpos_bias/rel_embedding_axes'].names == ('heads', 'relpos_buckets')


def test_t5_1_0_layout_uses_embedding_for_logits():
  cfg = tiny_config(mlp_activations=('relu',), logits_via_embedding=True)
  params, _ = network.init_params(cfg)
  flat = flatten_dict(params, sep='/')
  assert 'decoder/logits_dense/kernel' not in flat
  assert flat['encoder/layers_0/mlp/wi/kernel'].shape == (16, 32)
  network.validate_params(params, cfg)
  # T5 1.1's tree (two wi kernels, own logits kernel) is not this config's.
  t5_1_1_params, _ = jax.eval_shape(lambda: network.init_params(tiny_config()))
  with pytest.raises(ValueError, match=r"^checkpoint does not match T5Config: parameter "
                     r"'decoder/layers_0/mlp/wi/kernel' is missing from the checkpoint "
                     r"\(3 missing, 7 unexpected, 0 mis-shaped in all\) \[t5_1_1\]$"):
    network.validate_params(t5_1_1_params, cfg, 't5_1_1')


def _tiny_t5x(t5x_data):
  raw = serialization.msgpack_restore((t5x_data / 'test_t5_tiny.checkpoint_0').read_bytes())
  ref = np.load(t5x_data / 'test_t5_tiny_reference.npz')
  cfg = network.T5Config(**json.loads(str(ref['config'])))
  return network.Transformer(cfg), raw['optimizer']['target'], ref


def test_matches_t5x_reference_outputs(t5x_data):
  module, params, ref = _tiny_t5x(t5x_data)
  logits = apply(module, {'params': params}, ref['encoder_input_tokens'],
                 ref['decoder_input_tokens'], ref['decoder_target_tokens'])
  err = np.abs(np.asarray(logits[:2, :6]) - ref['logits_first2']).max()
  assert err < 1e-4, err
  log_probs = np.asarray(jax.nn.log_softmax(logits))
  at_targets = np.take_along_axis(log_probs, ref['decoder_target_tokens'][..., None], -1)[..., 0]
  np.testing.assert_allclose(at_targets, ref['log_softmax_at_targets'], atol=1e-4)
  np.testing.assert_allclose((at_targets * ref['decoder_loss_weights']).sum(-1),
                             ref['score_batch'], rtol=1e-5)


def test_cached_greedy_loop_matches_t5x(t5x_data):
  module, params, ref = _tiny_t5x(t5x_data)
  enc = jnp.asarray(ref['encoder_input_tokens'])
  cache, tokens_to_logits = start_decoding(module, params, enc, 10)
  step = lambda tok, cache: apply(module, {'params': params}, tok, cache,
                                  method=network.Transformer.decode_step)
  token, out = jnp.zeros((4, 1), jnp.int32), []
  for _ in range(10):
    logits, cache = step(token, cache)
    token = jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32)
    out.append(token)
  np.testing.assert_array_equal(np.concatenate(out, 1), ref['greedy_decodes'])


CACHE_CONFIGS = [
    dict(),
    dict(num_heads=3, head_dim=5, emb_dim=12, num_decoder_layers=3),  # heads*head_dim != emb
    dict(mlp_activations=('relu',), logits_via_embedding=True, num_heads=4, head_dim=4),
]


@pytest.mark.parametrize('overrides', CACHE_CONFIGS)
@pytest.mark.parametrize('batch', [1, 4])
def test_chunked_cache_equals_full_forward(overrides, batch):
  cfg = tiny_config(**overrides)
  module, params = random_model(cfg, seed=batch)
  rng = np.random.default_rng(batch)
  length = 11
  enc = ragged_tokens(jax.random.PRNGKey(1), batch, 7, cfg.vocab_size)
  targets = ragged_tokens(jax.random.PRNGKey(2), batch, length, cfg.vocab_size, min_length=4)
  dec_in = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), targets[:, :-1]], axis=1)
  full = apply(module, {'params': params}, enc, dec_in, targets)
  cache, _ = start_decoding(module, params, enc, length)
  step = lambda tok, cache, n: apply(module, {'params': params}, tok, cache, n,
                                     method=network.Transformer.decode_step)
  fed = np.zeros(batch, np.int64)
  got = np.zeros(full.shape, np.float32)
  while (fed < length).any():
    # Each row feeds its own chunk size this step; shorter rows pad their chunk with junk.
    sizes = np.minimum(rng.integers(1, 5, batch), length - fed)
    k = int(sizes.max())
    chunk = np.full((batch, k), 7, np.int32)
    for b in range(batch):
      chunk[b, :sizes[b]] = np.asarray(dec_in[b, fed[b]:fed[b] + sizes[b]])
    logits, cache = step(jnp.asarray(chunk), cache, jnp.asarray(sizes, jnp.int32))
    for b in range(batch):
      got[b, fed[b]:fed[b] + sizes[b]] = np.asarray(logits[b, :sizes[b]])
    fed += sizes
  np.testing.assert_array_equal(np.asarray(cache.index), np.full(batch, length))
  valid = np.asarray(targets > 0)
  err = np.abs(got - np.asarray(full))[valid].max()
  assert err < 1e-5, err


@pytest.mark.parametrize('overrides', [CACHE_CONFIGS[0], CACHE_CONFIGS[2]])
def test_logits_at_selects_one_token_per_row(overrides):
  """decode_step(logits_at=...) gives each row's chosen token's logits and the same cache."""
  cfg = tiny_config(**overrides)
  module, params = random_model(cfg, seed=5)
  batch = 3
  enc = ragged_tokens(jax.random.PRNGKey(8), batch, 6, cfg.vocab_size)
  cache, _ = start_decoding(module, params, enc, 10)
  cache = cache.with_index(jnp.array([0, 2, 4], jnp.int32))
  tokens = jax.random.randint(jax.random.PRNGKey(9), (batch, 3), 2, cfg.vocab_size)
  at = jnp.array([2, 0, 1], jnp.int32)
  step = lambda **kw: apply(module, {'params': params}, tokens, cache,
                            method=network.Transformer.decode_step, **kw)
  all_logits, all_cache = step()
  one, one_cache = step(logits_at=at)
  assert one.shape == (batch, 1, cfg.vocab_size)
  np.testing.assert_allclose(one[:, 0], all_logits[np.arange(batch), at], atol=1e-6)
  for a, b in zip(jax.tree_util.tree_leaves(all_cache), jax.tree_util.tree_leaves(one_cache)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('overrides', CACHE_CONFIGS[:2])
def test_rollback_equals_fresh_run(overrides):
  cfg = tiny_config(**overrides)
  module, params = random_model(cfg, seed=3)
  batch, length = 3, 12
  enc = ragged_tokens(jax.random.PRNGKey(4), batch, 6, cfg.vocab_size)
  step = lambda tok, cache: apply(module, {'params': params}, tok, cache,
                                  method=network.Transformer.decode_step)
  prefix = jax.random.randint(jax.random.PRNGKey(5), (batch, 3), 2, cfg.vocab_size)
  advance = jax.random.randint(jax.random.PRNGKey(6), (batch, 5), 2, cfg.vocab_size)
  new = jax.random.randint(jax.random.PRNGKey(7), (batch, 4), 2, cfg.vocab_size)
  back = jnp.array([5, 2, 0])  # per-row rollback j <= k = 5

  cache, _ = start_decoding(module, params, enc, length)
  _, cache = step(prefix, cache)
  _, cache = step(advance, cache)
  cache = cache.with_index(cache.index - back)
  rolled, _ = step(new, cache)

  for b in range(batch):
    kept = int(5 - back[b])
    fresh_cache, _ = start_decoding(module, params, enc[b:b + 1], length)
    tokens = jnp.concatenate([prefix[b:b + 1], advance[b:b + 1, :kept], new[b:b + 1]], axis=1)
    fresh, _ = apply(module, {'params': params}, tokens, fresh_cache,
                     method=network.Transformer.decode_step)
    np.testing.assert_allclose(np.asarray(rolled[b]), np.asarray(fresh[0, -4:]), atol=1e-5)


@pytest.mark.parametrize('overrides', CACHE_CONFIGS)
def test_stacked_projections_equal_separate_ones(overrides):
  """decode_variables' stacked q/k/v, cross k/v and wi kernels: the encoder, the cache and a
  3-token step give the values of the separate projections (one matmul instead of several)."""
  cfg = tiny_config(**overrides)
  module, params = random_model(cfg, seed=7)
  enc = ragged_tokens(jax.random.PRNGKey(3), 2, 6, cfg.vocab_size)
  tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 3), 2, cfg.vocab_size)

  def run(fuse):
    variables = {'params': params,
                 network.DECODE_COLLECTION: network.decode_variables(cfg, params, fuse)}
    encoded = apply(module, variables, enc, method=network.Transformer.encode)
    cache = apply(module, variables, encoded, enc, 8, method=network.Transformer.init_cache)
    logits, cache = apply(module, variables, tokens, cache.with_index(jnp.array([0, 2])),
                          method=network.Transformer.decode_step)
    return encoded, logits, cache

  fused = network.decode_variables(cfg, params, fuse=True)['decoder']['layers_0']
  assert fused['self_attention']['qkv_kernel'].shape == (cfg.emb_dim, 3,
                                                         cfg.num_heads * cfg.head_dim)
  assert ('mlp' in fused) == (len(cfg.mlp_activations) > 1)
  for got, want in zip(jax.tree_util.tree_leaves(run(True)), jax.tree_util.tree_leaves(run(False))):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('tied', [True, False])
def test_a_cut_vocabulary_masks_the_other_tokens(tied):
  """decode_variables(vocabulary_ids=...): the logits of those tokens unchanged, every other
  token at MASK_BIAS (a draft that never proposes them)."""
  cfg = tiny_config(logits_via_embedding=tied)
  module, params = random_model(cfg, seed=9)
  enc = ragged_tokens(jax.random.PRNGKey(5), 2, 6, cfg.vocab_size)
  cache, _ = start_decoding(module, params, enc, 8)
  tokens = jax.random.randint(jax.random.PRNGKey(6), (2, 2), 2, cfg.vocab_size)
  ids = np.array([0, 1, 5, 17, 40])

  def logits(vocabulary_ids):
    variables = {'params': params, network.DECODE_COLLECTION: network.decode_variables(
        cfg, params, fuse=False, vocabulary_ids=vocabulary_ids)}
    return np.asarray(apply(module, variables, tokens, cache,
                            method=network.Transformer.decode_step)[0])

  full, cut = logits(None), logits(ids)
  np.testing.assert_allclose(cut[..., ids], full[..., ids], atol=1e-5)
  others = np.setdiff1d(np.arange(cfg.vocab_size), ids)
  assert (cut[..., others] == network.MASK_BIAS).all()


def test_the_embedded_draft_has_its_vocabulary():
  ids = checkpoints.load_draft_vocabulary(data.EMBEDDED_DRAFT)
  assert ids is not None and 3000 < ids.size < 8000 and {0, 1, 2} <= set(ids.tolist())
  assert checkpoints.load_draft_vocabulary(data.EMBEDDED_TARGET) is None


def test_float32_logits_option():
  """float32_logits: a bf16 network's final norm and logits in float32 (tied embedding or
  logits_dense; the teacher-forced pass and the cached step with the decode-time logits_kernel),
  equal to the float32 computation from its last layer's output; off, the logits are unchanged;
  the layers before are untouched either way."""
  enc = ragged_tokens(jax.random.PRNGKey(12), 2, 6, 64)
  dec = ragged_tokens(jax.random.PRNGKey(13), 2, 5, 64, min_length=5)

  def run(config, params, decode_step):
    """(logits, {module: its captured output}) of the teacher-forced pass or one 5-token step."""
    # Op by op, not conftest.apply: under jit XLA keeps a bf16 network's intermediates in
    # float32 where it fuses them (xla_allow_excess_precision), so the captured bf16 output of
    # the last layer would not be exactly what the final norm read.
    module = network.Transformer(config)
    if decode_step:
      cache, _ = start_decoding(module, params, enc, 8)
      variables = {'params': params,
                   network.DECODE_COLLECTION: network.decode_variables(config, params)}
      (logits, _), state = module.apply(variables, dec, cache, capture_intermediates=True,
                                        mutable=['intermediates'],
                                        method=network.Transformer.decode_step)
    else:
      logits, state = module.apply({'params': params}, enc, dec, dec, capture_intermediates=True,
                                   mutable=['intermediates'])
    captured = state['intermediates']['decoder']
    last = captured[f'layers_{config.num_decoder_layers - 1}']['__call__'][0][0]
    return logits, last, captured['decoder_norm']['__call__'][0]

  for tied in (True, False):
    cfg = tiny_config(logits_via_embedding=tied, dtype=jnp.bfloat16)
    params, _ = network.init_params(cfg, jax.random.PRNGKey(11))
    if tied:
      kernel = params['token_embedder']['embedding'].T / np.sqrt(cfg.emb_dim)
    else:
      kernel = params['decoder']['logits_dense']['kernel']
    for decode_step in (False, True):
      off, last, y = run(cfg, params, decode_step)
      on, on_last, _ = run(dataclasses.replace(cfg, float32_logits=True), params, decode_step)
      np.testing.assert_array_equal(last, on_last)
      assert on.dtype == jnp.float32 and off.dtype == (jnp.bfloat16 if tied else jnp.float32)
      if tied:
        expected_off = (jnp.dot(y, params['token_embedder']['embedding'].astype(y.dtype).T) /
                        jnp.sqrt(cfg.emb_dim).astype(y.dtype))
      else:
        expected_off = jnp.dot(y.astype(jnp.float32), kernel)
      np.testing.assert_array_equal(np.asarray(off, np.float32),
                                    np.asarray(expected_off, np.float32))
      x = np.asarray(last, np.float64)
      y32 = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * np.asarray(
          params['decoder']['decoder_norm']['scale'], np.float64)
      expected_on = y32 @ np.asarray(kernel, np.float64)
      assert np.abs(np.asarray(on) - expected_on).max() <= 1e-5 * np.abs(expected_on).max()

  # Stored configs (weights files, config.json) without the field load with it off.
  stored = checkpoints.config_to_dict(dataclasses.replace(cfg, float32_logits=True))
  assert network.T5Config(**stored).float32_logits
  del stored['float32_logits']
  assert network.T5Config(**stored) == cfg


def test_core_modules_do_not_import_tensorflow():
  import subprocess
  import sys
  code = ('import sys; import speculative_t5x.network, speculative_t5x.decoding, '
          'speculative_t5x.models, speculative_t5x.beam_search, speculative_t5x.checkpoints; '
          'print(sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "seqio")))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == '[]', out.stdout
