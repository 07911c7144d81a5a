"""The T5 1.1 encoder-decoder, parameter for parameter T5X's, with a multi-token per-row decoder cache.

The parameter tree, initialisers, logical axis names and arithmetic follow
`t5x/examples/t5/network.py`, so T5X checkpoints load unchanged and T5X's partitioning rules apply.
What differs is the decoder cache. T5X's cache appends one token per call at one index shared by
the whole batch and recomputes cross-attention keys/values every step; speculative decoding needs
to append a chunk of k tokens, each row at its own position, and to move rows back after a
rejection. Here the cache is an explicit `DecoderCache` pytree:

  * self-attention keys `[batch, heads, head_dim, max_length]` and values
    `[batch, heads, max_length, head_dim]` per layer (`KEY_LAYOUT`, `VALUE_LAYOUT`), written by a
    scatter at `index[b] + j`, so rows of one batch sit at different positions;
  * a per-row `index` `[batch]`. Attention masks and relative positions are computed from
    positions, never from what has been written, so moving `index` back (rollback) makes stale
    entries invisible and the next write overwrites them: the result equals never having written;
  * cross-attention keys/values computed once from the encoder output.

Shapes: `batch` rows, `length` token positions, `heads` x `head_dim` per attention, `emb` model
width, `vocab` output classes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from flax.linen import partitioning as nn_partitioning

Array = jnp.ndarray
DType = Any

# T5's relative attention buckets.
RELPOS_NUM_BUCKETS = 32
RELPOS_MAX_DISTANCE = 128
# Additive attention bias for masked positions, as T5X uses.
MASK_BIAS = -1e10

_ACTIVATIONS = {'relu': nn.relu, 'gelu': nn.gelu, 'linear': lambda x: x, 'silu': nn.silu}


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Hyperparameters of a T5 encoder-decoder (T5 1.0, 1.1 and mT5; names as T5X's T5Config).

  T5 1.1: mlp_activations=('gelu', 'linear'), logits_via_embedding=False.
  T5 1.0: mlp_activations=('relu',), logits_via_embedding=True.
  `dtype` is the activation dtype; parameters are always stored in float32.
  float32_attention_logits: attention logits and softmax in float32 (T5X's option).
  float32_logits: the decoder's final layer norm and output projection in float32 whatever
    `dtype` is: the norm's output is not rounded to `dtype` and the projection (`logits_dense`,
    the tied embedding's `Embed.attend` or the decode-time `logits_kernel`) multiplies in
    float32, so greedy argmaxes compare float32 logits, not logits rounded to bf16 (spaced 1/32
    apart in [4, 8), 1/16 in [8, 16): coarser than a near-tie of the top two). It does not
    make bf16 greedy speculative decoding token-identical to bf16 target-only greedy: the k-token
    verify call and the 1-token calls already round the decoder layers' bf16 activations
    differently (`benchmarks.speed --dtype bfloat16` measures both).
  encoded_width: 0 for a model with its own encoder. Else a decoder-only model (a draft that
    reads the target's encoder output, so a speculative decode runs one encoder): it has no
    `encoder` parameters (num_encoder_layers must be 0) and its cross-attention key/value
    projections take inputs of this width, the target's emb_dim.
  feature_width: 0, or a feature draft (EAGLE-style; decoder-only, so encoded_width is set too):
    its decoder's input at position p is `input_projection([token embedding; feature])`, the
    feature being the target decoder's hidden states at p - 1 through `feature_projection`, or,
    at a position the draft proposes beyond what the target has scored, its own top hidden state
    at p - 1. feature_width is a multiple of the target's emb_dim (= encoded_width): the target's
    top hidden state, or (EAGLE-3) also lower layers' outputs (`feature_layers`).
  """
  vocab_size: int
  dtype: DType = jnp.float32
  emb_dim: int = 512
  num_heads: int = 8
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  head_dim: int = 64
  mlp_dim: int = 2048
  mlp_activations: Sequence[str] = ('relu',)
  dropout_rate: float = 0.1
  logits_via_embedding: bool = False
  float32_attention_logits: bool = False
  float32_logits: bool = False
  encoded_width: int = 0
  feature_width: int = 0

  def __post_init__(self):
    # Normalise so configs from gin/JSON (lists, dtype names) hash and compare equal.
    object.__setattr__(self, 'mlp_activations', tuple(self.mlp_activations))
    object.__setattr__(self, 'dtype', jnp.dtype(self.dtype))
    unknown = [a for a in self.mlp_activations if a not in _ACTIVATIONS]
    if unknown:
      raise ValueError(f'Unknown mlp_activations {unknown}; known: {sorted(_ACTIVATIONS)}.')
    if self.encoded_width and self.num_encoder_layers:
      raise ValueError(f'A decoder-only config (encoded_width {self.encoded_width}) has no '
                       f'encoder: set num_encoder_layers to 0, not {self.num_encoder_layers}.')
    if self.feature_width and not self.encoded_width:
      raise ValueError(f'A feature draft (feature_width {self.feature_width}) reads the '
                       "target's encoder output: set encoded_width to the target's emb_dim.")
    if self.feature_width % max(self.encoded_width, 1):
      raise ValueError(f'A feature draft reads whole hidden states of its target: '
                       f'feature_width {self.feature_width} is no multiple of encoded_width '
                       f'{self.encoded_width}.')

  @property
  def feature_layers(self) -> int:
    """How many of its target's layers a feature draft reads (0: not a feature draft)."""
    return self.feature_width // self.encoded_width if self.feature_width else 0

  @property
  def has_encoder(self) -> bool:
    """False for a decoder-only model, which reads another model's encoder output."""
    return not self.encoded_width

  def decode_flops_per_token(self) -> int:
    """Multiply-adds of one decoder token, excluding attention over the cache (for cost ratios)."""
    hd = self.num_heads * self.head_dim
    per_layer = 4 * self.emb_dim * hd + 2 * self.emb_dim * hd + (
        len(self.mlp_activations) + 1) * self.emb_dim * self.mlp_dim
    features = (self.feature_width + 2 * self.emb_dim) * self.emb_dim if self.feature_width else 0
    return self.num_decoder_layers * per_layer + self.emb_dim * self.vocab_size + features


# ------------------------------------------------------------------------------------------------
# Relative position buckets.


def relative_position_bucket(relative_position: np.ndarray, bidirectional: bool,
                             num_buckets: int = RELPOS_NUM_BUCKETS,
                             max_distance: int = RELPOS_MAX_DISTANCE) -> np.ndarray:
  """T5's bucketing of `key_position - query_position` (numpy, int32, same shape).

  Half the buckets are exact small distances, the rest log-spaced up to `max_distance`.
  Unidirectional (decoder) attention only distinguishes keys at or before the query.
  """
  n = -np.asarray(relative_position)
  ret = np.zeros_like(n, dtype=np.int32)
  if bidirectional:
    num_buckets //= 2
    ret += (n < 0).astype(np.int32) * num_buckets
    n = np.abs(n)
  else:
    n = np.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  val_if_large = max_exact + (
      np.log(n.astype(np.float32) / max_exact + np.finfo(np.float32).eps) /
      np.log(max_distance / max_exact) * (num_buckets - max_exact)).astype(np.int32)
  val_if_large = np.minimum(val_if_large, num_buckets - 1)
  return ret + np.where(is_small, n, val_if_large).astype(np.int32)


# Every distance at or beyond max_distance falls in the last bucket, so a table over
# [-max_distance, max_distance] covers all lengths; it is computed once, in numpy, so that
# traced (per-row, dynamic) positions get exactly the buckets T5X computes statically.
_BUCKET_TABLES = {
    bidirectional: relative_position_bucket(
        np.arange(-RELPOS_MAX_DISTANCE, RELPOS_MAX_DISTANCE + 1), bidirectional)
    for bidirectional in (False, True)
}


def _bucket(relative_position: Array, bidirectional: bool) -> Array:
  table = jnp.asarray(_BUCKET_TABLES[bidirectional])
  clipped = jnp.clip(relative_position, -RELPOS_MAX_DISTANCE, RELPOS_MAX_DISTANCE)
  return table[clipped + RELPOS_MAX_DISTANCE]


# ------------------------------------------------------------------------------------------------
# Layers.


def _param(module: nn.Module, name: str, init: Callable, shape: Tuple[int, ...],
           axes: Tuple[str, ...]) -> Array:
  return nn_partitioning.param_with_axes(name, init, shape, jnp.float32, axes=axes)


# The collection of decode-time parameter layouts (`decode_variables`).
DECODE_COLLECTION = 'decode'


def _decode_variable(module: nn.Module, name: str) -> Optional[Array]:
  """The module's decode-time variable `name`, or None when the caller passed none."""
  if module.has_variable(DECODE_COLLECTION, name):
    return module.get_variable(DECODE_COLLECTION, name)
  return None


class Dense(nn.Module):
  """A bias-free projection whose kernel is stored 2-D, `(prod(in_dims), prod(features))`, as T5X.

  Contracts the last `contract_dims` axes of the input; returns `[..., *features]`.
  """
  features: Tuple[int, ...]
  kernel_axes: Tuple[str, str]
  contract_dims: int = 1
  dtype: DType = jnp.float32
  kernel_init: Callable = nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal')

  @nn.compact
  def __call__(self, x: Array) -> Array:
    in_shape = x.shape[-self.contract_dims:]
    in_size, out_size = int(np.prod(in_shape)), int(np.prod(self.features))

    def init(key, shape, dtype):
      # Initialise with the logical (unflattened) fan-in, as T5X's DenseGeneral does.
      return self.kernel_init(key, tuple(in_shape) + tuple(self.features), dtype).reshape(shape)

    kernel = _param(self, 'kernel', init, (in_size, out_size), self.kernel_axes)
    x = x.reshape(x.shape[:-self.contract_dims] + (in_size,)).astype(self.dtype)
    y = jnp.dot(x, kernel.astype(self.dtype))
    return y.reshape(y.shape[:-1] + tuple(self.features))


class RMSNorm(nn.Module):
  """T5's layer norm: no mean subtraction and no bias, statistics in float32."""
  dtype: DType = jnp.float32
  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x: Array) -> Array:
    x = x.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.epsilon)
    scale = _param(self, 'scale', nn.initializers.ones, (x.shape[-1],), ('embed',))
    return y.astype(self.dtype) * scale.astype(self.dtype)


class Embed(nn.Module):
  """Token embedding `(vocab, emb)`, shared by encoder, decoder and (T5 1.0) the logits."""
  num_embeddings: int
  features: int
  dtype: DType = jnp.float32

  def setup(self):
    self.embedding = _param(self, 'embedding', nn.initializers.normal(stddev=1.0),
                            (self.num_embeddings, self.features), ('vocab', 'embed'))

  def __call__(self, tokens: Array) -> Array:
    """[batch, length] int -> [batch, length, emb]. A gather equals T5X's one-hot matmul exactly."""
    return jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)

  def attend(self, query: Array, dtype: Optional[DType] = None) -> Array:
    """[..., emb] -> [..., vocab] logits against the embedding table, computed in `dtype`
    (default: the module's)."""
    dtype = self.dtype if dtype is None else dtype
    return jnp.dot(query.astype(dtype), self.embedding.astype(dtype).T)


class RelativePositionBiases(nn.Module):
  """Per-head attention bias from bucketed relative positions, shared by a stack's layers."""
  num_heads: int
  bidirectional: bool
  dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, query_positions: Array, key_positions: Array) -> Array:
    """[batch, q] and [k] (or per-row [batch, k]) positions -> bias [batch, heads, q, k]."""
    rel_embedding = _param(self, 'rel_embedding',
                           nn.initializers.variance_scaling(1.0, 'fan_avg', 'uniform'),
                           (self.num_heads, RELPOS_NUM_BUCKETS), ('heads', 'relpos_buckets'))
    if key_positions.ndim == 1:
      key_positions = key_positions[None]
    buckets = _bucket(key_positions[:, None, :] - query_positions[:, :, None],
                      self.bidirectional)
    bias = jnp.take(rel_embedding.astype(self.dtype), buckets, axis=1)  # [heads, batch, q, k]
    return jnp.transpose(bias, (1, 0, 2, 3))


# Axis orders of attention keys and values (projections and the decoder cache): the operand
# layouts the two attention matmuls consume directly. With keys [batch, length, heads, head_dim]
# XLA:CPU transposes every layer's whole key and value cache on every decode step (measured: a
# quarter of a batch-1 and a third of a batch-8 target step).
KEY_LAYOUT = ('batch', 'heads', 'kv', 'length')
VALUE_LAYOUT = ('batch', 'heads', 'length', 'kv')


def _stacked_projection(x: Array, kernel: Array, num_heads: int, dtype: DType
                        ) -> Tuple[Array, ...]:
  """x [..., emb] times a stacked kernel [emb, n, heads * head_dim] in one matmul: n arrays
  [..., heads, head_dim]."""
  y = jnp.einsum('...e,esd->...sd', x.astype(dtype), kernel.astype(dtype))
  y = y.reshape(y.shape[:-1] + (num_heads, -1))
  return tuple(y[..., i, :, :] for i in range(kernel.shape[1]))


def to_attention_layout(key: Array, value: Array) -> Tuple[Array, Array]:
  """Keys, values [batch, length, heads, head_dim] -> KEY_LAYOUT, VALUE_LAYOUT."""
  return jnp.transpose(key, (0, 2, 3, 1)), jnp.transpose(value, (0, 2, 1, 3))


def _write_rows(cache: Array, new: Array, positions: Array, axis: int) -> Array:
  """cache [batch, ...] with each row's new entries [batch, q, heads, head_dim] written at its
  own positions [batch, q] along `axis` (positions past the cache are dropped).

  Written per row (a vmap): the batch is then a batching dimension of the scatter, which a
  data-parallel mesh updates shard by shard; indexing the rows instead makes the partitioner
  gather every row's update on every device.
  """
  def one_row(row_cache, row_new, row_positions):  # [..., length, ...], [q, heads, head_dim]
    index = (slice(None),) * (axis - 1) + (row_positions,)
    # One index array among slices keeps its axis in place: the entries in the cache's order.
    entries = jnp.moveaxis(row_new, 0, axis - 1)
    return row_cache.at[index].set(entries.astype(row_cache.dtype), mode='drop')

  return jax.vmap(one_row)(cache, new, positions)


class MultiHeadAttention(nn.Module):
  """Dot-product attention with T5X's projections (no 1/sqrt(d): folded into the query init)."""
  num_heads: int
  head_dim: int
  out_features: int
  dtype: DType = jnp.float32
  dropout_rate: float = 0.0
  float32_logits: bool = False

  def setup(self):
    init = nn.initializers.variance_scaling(1.0, 'fan_in', 'normal')
    depth_scaling = np.sqrt(self.head_dim).astype(np.float32)
    query_init = lambda *args: init(*args) / depth_scaling
    proj = functools.partial(Dense, features=(self.num_heads, self.head_dim),
                             kernel_axes=('embed', 'joined_kv'), dtype=self.dtype)
    self.query = proj(kernel_init=query_init)
    self.key = proj(kernel_init=init)
    self.value = proj(kernel_init=init)
    self.out = Dense(features=(self.out_features,), kernel_axes=('joined_kv', 'embed'),
                     contract_dims=2, dtype=self.dtype, kernel_init=init)
    self.dropout = nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))

  def project_kv(self, inputs_kv: Array) -> Tuple[Array, Array]:
    """[batch, length, emb] -> keys [batch, heads, head_dim, length], values [batch, heads, length, head_dim].

    One matmul against the decode-time `kv_kernel` [emb, 2, heads * head_dim] when given.
    """
    kernel = _decode_variable(self, 'kv_kernel')
    if kernel is None:
      return to_attention_layout(self.key(inputs_kv), self.value(inputs_kv))
    key, value = _stacked_projection(inputs_kv, kernel, self.num_heads, self.dtype)
    return to_attention_layout(key, value)

  def project_qkv(self, inputs: Array) -> Tuple[Array, Array, Array]:
    """[batch, q, emb] -> query, key, value, each [batch, q, heads, head_dim].

    One matmul against the decode-time `qkv_kernel` [emb, 3, heads * head_dim] when the
    variables carry it (`decode_variables`), else the three projections.
    """
    kernel = _decode_variable(self, 'qkv_kernel')
    if kernel is None:
      return self.query(inputs), self.key(inputs), self.value(inputs)
    return _stacked_projection(inputs, kernel, self.num_heads, self.dtype)

  def __call__(self, inputs_q: Array, key: Array, value: Array, bias: Array,
               deterministic: bool = True) -> Array:
    """Attention of [batch, q, emb] queries over keys [batch, heads, head_dim, k] and values
    [batch, heads, k, head_dim] (the layouts of `project_kv` and `DecoderCache`).

    `bias` broadcasts to [batch, heads, q, k] and carries both the mask and position biases.
    Returns [batch, q, emb].
    """
    return self.attend(self.query(inputs_q), key, value, bias, deterministic)

  def attend(self, query: Array, key: Array, value: Array, bias: Array,
             deterministic: bool = True) -> Array:
    """`__call__` for an already projected query [batch, q, heads, head_dim]."""
    # Both products are batched over (batch, heads) with the batch axes leading on every operand
    # and result: XLA:CPU runs other axis orders as a slow generic loop (3-5x on decode shapes).
    query = jnp.transpose(query, (0, 2, 1, 3))  # [batch, heads, q, head_dim]
    if self.float32_logits:
      query, key = query.astype(jnp.float32), key.astype(jnp.float32)
    logits = jnp.einsum('bhqd,bhdk->bhqk', query, key)
    weights = jax.nn.softmax(logits + bias.astype(logits.dtype)).astype(self.dtype)
    weights = self.dropout(weights, deterministic=deterministic)
    out = jnp.einsum('bhqk,bhkd->bhqd', weights, value.astype(self.dtype))
    return self.out(jnp.transpose(out, (0, 2, 1, 3)))


class MlpBlock(nn.Module):
  """T5's feed-forward block; several activations are multiplied (gated GELU for T5 1.1)."""
  intermediate_dim: int
  activations: Tuple[str, ...]
  dtype: DType = jnp.float32
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x: Array, deterministic: bool = True) -> Array:
    """[batch, length, emb] -> [batch, length, emb]."""
    emb = x.shape[-1]
    kernel = _decode_variable(self, 'wi_kernel')  # [emb, activations, mlp]: one matmul
    if kernel is not None:
      fused = jnp.einsum('...e,eam->...am', x.astype(self.dtype), kernel.astype(self.dtype))
    hidden = None
    for i, act in enumerate(self.activations):
      name = 'wi' if len(self.activations) == 1 else f'wi_{i}'
      h = fused[..., i, :] if kernel is not None else Dense(
          (self.intermediate_dim,), ('embed', 'mlp'), dtype=self.dtype, name=name)(x)
      h = _ACTIVATIONS[act](h)
      hidden = h if hidden is None else hidden * h
    hidden = nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))(hidden, deterministic=deterministic)
    return Dense((emb,), ('mlp', 'embed'), dtype=self.dtype, name='wo')(hidden)


def _attention(config: T5Config) -> MultiHeadAttention:
  return MultiHeadAttention(num_heads=config.num_heads, head_dim=config.head_dim,
                            out_features=config.emb_dim, dtype=config.dtype,
                            dropout_rate=config.dropout_rate,
                            float32_logits=config.float32_attention_logits)


class EncoderLayer(nn.Module):
  config: T5Config

  def setup(self):
    cfg = self.config
    self.pre_attention_layer_norm = RMSNorm(cfg.dtype)
    self.attention = _attention(cfg)
    self.pre_mlp_layer_norm = RMSNorm(cfg.dtype)
    self.mlp = MlpBlock(cfg.mlp_dim, cfg.mlp_activations, cfg.dtype, cfg.dropout_rate)
    self.dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))

  def __call__(self, x: Array, bias: Array, deterministic: bool = True) -> Array:
    """[batch, length, emb] with bias [batch, heads, length, length] -> [batch, length, emb]."""
    h = self.pre_attention_layer_norm(x)
    query, key, value = self.attention.project_qkv(h)
    h = self.attention.attend(query, *to_attention_layout(key, value), bias, deterministic)
    x = x + self.dropout(h, deterministic=deterministic)
    h = self.mlp(self.pre_mlp_layer_norm(x), deterministic)
    return x + self.dropout(h, deterministic=deterministic)


class DecoderLayer(nn.Module):
  config: T5Config

  def setup(self):
    cfg = self.config
    self.pre_self_attention_layer_norm = RMSNorm(cfg.dtype)
    self.self_attention = _attention(cfg)
    self.pre_cross_attention_layer_norm = RMSNorm(cfg.dtype)
    self.encoder_decoder_attention = _attention(cfg)
    self.pre_mlp_layer_norm = RMSNorm(cfg.dtype)
    self.mlp = MlpBlock(cfg.mlp_dim, cfg.mlp_activations, cfg.dtype, cfg.dropout_rate)
    self.dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))

  def cross_kv(self, encoded: Array) -> Tuple[Array, Array]:
    """Cross-attention keys/values of the encoder output (KEY_LAYOUT / VALUE_LAYOUT)."""
    return self.encoder_decoder_attention.project_kv(encoded)

  def __call__(self, x: Array, self_bias: Array, cross_kv: Tuple[Array, Array],
               cross_bias: Array, self_cache: Optional[Tuple[Array, Array, Array]] = None,
               deterministic: bool = True) -> Tuple[Array, Optional[Tuple[Array, Array]]]:
    """One decoder layer over x [batch, q, emb].

    Without `self_cache`, self-attention is over x itself (teacher forcing; `self_bias`
    [batch, heads, q, q]). With `self_cache = (cached_key, cached_value, write_positions)`
    (caches in KEY_LAYOUT / VALUE_LAYOUT, positions [batch, q]), this chunk's keys/values
    are first written at `write_positions` (positions past max_length are dropped), then attended
    over the whole cache (`self_bias` [batch, heads, q, max_length]). Returns the layer output and
    the updated (cached_key, cached_value), or None without a cache.
    """
    h = self.pre_self_attention_layer_norm(x)
    new_cache = None
    query, key, value = self.self_attention.project_qkv(h)
    if self_cache is None:
      key, value = to_attention_layout(key, value)
    else:
      cached_key, cached_value, positions = self_cache
      key = _write_rows(cached_key, key, positions, KEY_LAYOUT.index('length'))
      value = _write_rows(cached_value, value, positions, VALUE_LAYOUT.index('length'))
      new_cache = (key, value)
    h = self.self_attention.attend(query, key, value, self_bias, deterministic)
    x = x + self.dropout(h, deterministic=deterministic)
    h = self.encoder_decoder_attention(self.pre_cross_attention_layer_norm(x), *cross_kv,
                                       cross_bias, deterministic)
    x = x + self.dropout(h, deterministic=deterministic)
    h = self.mlp(self.pre_mlp_layer_norm(x), deterministic)
    return x + self.dropout(h, deterministic=deterministic), new_cache


@flax.struct.dataclass
class DecoderCache:
  """Decoder state for incremental decoding; a pytree of fixed-shape arrays (jit/while_loop/shard).

  index:        [batch] int32, tokens already written per row (= position of the next token).
  self_key, self_value:   per decoder layer, [batch, heads, head_dim, max_length] and
                          [batch, heads, max_length, head_dim] (KEY_LAYOUT, VALUE_LAYOUT).
  cross_key, cross_value: per decoder layer, the same layouts over encoder_length.
  encoder_mask: [batch, encoder_length] bool, non-padding encoder positions.
  features:     None, or (a target paired with a feature draft) [batch, max_length, k * emb],
                the hidden states a feature draft reads at each position written
                (`Decoder._features`).
  hidden:       None, or (a feature draft) [batch, emb], its own top hidden state at the
                position of its last call's logits: the feature of the token it proposes next.

  Entries at positions >= index are never read, so `with_index` is a complete rollback.
  Every leaf has the batch on axis 0 (beam search and num_decodes expand/gather all leaves alike).
  """
  index: Array
  self_key: Tuple[Array, ...]
  self_value: Tuple[Array, ...]
  cross_key: Tuple[Array, ...]
  cross_value: Tuple[Array, ...]
  encoder_mask: Array
  features: Optional[Array] = None
  hidden: Optional[Array] = None

  @property
  def max_length(self) -> int:
    return self.self_value[0].shape[2]

  @classmethod
  def logical_axes(cls) -> 'DecoderCache':
    """Each field's logical axis names (for partitioning), in the structure of a cache."""
    return cls(index=('batch',), self_key=KEY_LAYOUT, self_value=VALUE_LAYOUT,
               cross_key=KEY_LAYOUT, cross_value=VALUE_LAYOUT, encoder_mask=('batch', 'length'),
               features=('batch', 'length', 'embed'), hidden=('batch', 'embed'))

  def with_index(self, index: Array) -> 'DecoderCache':
    """Moves each row to `index` [batch]; moving back discards what was written from there on."""
    return self.replace(index=jnp.asarray(index, jnp.int32))

  def keep_tree_path(self, path: Array, length: Array,
                     source_rows: Optional[Array] = None) -> 'DecoderCache':
    """Commits one root-to-node path of a tree written by `tree_step` at each row's index.

    path: [batch, n] int32 tree nodes (path[:, d] the node at depth d; entries at d >= length
    are ignored). Moves their keys/values from slots index + path to index + d and advances the
    index by length [batch]: the cache then equals having fed the path token by token.
    source_rows: optional [batch] int32, row b takes its self-attention entries (and index) from
    row source_rows[b] first, as beam search reorders beams. Only for rows that share their
    encoder input (the beams of one example): cross-attention entries are not moved.
    """
    index, self_key, self_value = self.index, self.self_key, self.self_value
    if source_rows is not None:
      take = lambda x: jnp.take(x, source_rows, axis=0)
      index, self_key, self_value = take(index), tuple(map(take, self_key)), tuple(
          map(take, self_value))
    start = index[:, None]
    src = start + path  # [batch, n]
    dst = start + jnp.arange(path.shape[1])[None, :]
    rows = jnp.arange(path.shape[0])[:, None]

    def move_key(key):  # [batch, heads, head_dim, max_length]
      moved = jnp.take_along_axis(key, src[:, None, None, :], axis=3, mode='clip')
      return key.at[rows, :, :, dst].set(jnp.moveaxis(moved, 3, 1), mode='drop')

    def move_value(value):  # [batch, heads, max_length, head_dim]
      moved = jnp.take_along_axis(value, src[:, None, :, None], axis=2, mode='clip')
      return value.at[rows, :, dst].set(jnp.moveaxis(moved, 2, 1), mode='drop')

    return self.replace(index=index + length, self_key=tuple(map(move_key, self_key)),
                        self_value=tuple(map(move_value, self_value)))

  def extend(self, extra: int) -> 'DecoderCache':
    """The same cache with `extra` more (empty) self-attention slots, room for a token tree."""
    pad = lambda x, axis: jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])
    return self.replace(self_key=tuple(pad(k, 3) for k in self.self_key),
                        self_value=tuple(pad(v, 2) for v in self.self_value))


def feature_layer_counts(num_layers: int, count: int) -> Tuple[int, ...]:
  """After how many of a decoder's `num_layers` layers each of a feature draft's `count` hidden
  states is taken: evenly spaced, the last the top (EAGLE-3's low, middle and top for 3)."""
  return tuple(num_layers * j // count for j in range(1, count + 1))


def _mask_bias(mask: Array) -> Array:
  return jnp.where(mask, 0.0, MASK_BIAS).astype(jnp.float32)


class Encoder(nn.Module):
  config: T5Config
  shared_embedding: nn.Module

  def setup(self):
    cfg = self.config
    self.relpos_bias = RelativePositionBiases(cfg.num_heads, bidirectional=True, dtype=cfg.dtype)
    self.layers = [EncoderLayer(cfg) for _ in range(cfg.num_encoder_layers)]
    self.encoder_norm = RMSNorm(cfg.dtype)
    self.dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))

  def __call__(self, encoder_input_tokens: Array, encoder_segment_ids: Optional[Array] = None,
               deterministic: bool = True) -> Array:
    """[batch, length] tokens (0 = padding) -> [batch, length, emb]."""
    length = encoder_input_tokens.shape[1]
    valid = encoder_input_tokens > 0
    mask = valid[:, None, :, None] & valid[:, None, None, :]
    if encoder_segment_ids is not None:
      mask &= (encoder_segment_ids[:, None, :, None] == encoder_segment_ids[:, None, None, :])
    positions = jnp.arange(length)
    bias = self.relpos_bias(positions[None], positions) + _mask_bias(mask)
    x = self.dropout(self.shared_embedding(encoder_input_tokens), deterministic=deterministic)
    for layer in self.layers:
      x = layer(x, bias, deterministic)
    return self.dropout(self.encoder_norm(x), deterministic=deterministic)


def _embedding_first(key: Array, shape: Tuple[int, int], dtype: DType) -> Array:
  """A feature draft's `input_projection` kernel [2 emb, emb] at init: the embedding passed
  through, the feature ignored, so a feature draft warm-started from a plain draft's weights
  starts as that draft (its feature rows then learn from their gradient)."""
  del key
  emb = shape[1]
  return jnp.concatenate([jnp.eye(emb, dtype=dtype), jnp.zeros((shape[0] - emb, emb), dtype)])


class Decoder(nn.Module):
  config: T5Config
  shared_embedding: nn.Module

  def setup(self):
    cfg = self.config
    self.relpos_bias = RelativePositionBiases(cfg.num_heads, bidirectional=False, dtype=cfg.dtype)
    self.layers = [DecoderLayer(cfg) for _ in range(cfg.num_decoder_layers)]
    self.decoder_norm = RMSNorm(jnp.float32 if cfg.float32_logits else cfg.dtype)
    self.dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
    if not cfg.logits_via_embedding:
      self.logits_dense = Dense((cfg.vocab_size,), ('embed', 'vocab'), dtype=jnp.float32)
    if cfg.feature_width:  # (a small draft's: replicated, 'feature' has no mesh axis)
      self.feature_projection = Dense((cfg.emb_dim,), ('feature', 'embed'), dtype=cfg.dtype)
      self.input_projection = Dense((cfg.emb_dim,), ('feature', 'embed'), dtype=cfg.dtype,
                                    kernel_init=_embedding_first)

  def _inputs(self, tokens: Array, features: Optional[Array] = None,
              own: Optional[Array] = None) -> Array:
    """The first layer's input for tokens [batch, k]: their embeddings; for a feature draft,
    `input_projection([embedding; feature])`, each token's feature its row of `features`
    [batch, k, feature_width] (the target's, projected) or else of `own` [batch, k, emb] (the
    draft's own top hidden states)."""
    y = self.shared_embedding(tokens)
    if not self.config.feature_width:
      return y
    if features is None and own is None:
      raise ValueError('A feature draft needs the features of the positions before its tokens.')
    feature = self.feature_projection(features) if features is not None else own
    return self.input_projection(jnp.concatenate([y, feature.astype(y.dtype)], axis=-1))

  def _features(self, states: Sequence[Array], top: Array, count: int) -> Array:
    """A feature draft's reading of this decoder: states, each layer's output [batch, k, emb],
    top, the last one after the final norm -> [batch, k, count * emb], the outputs of the
    layers `feature_layer_counts` names, each after the final norm (the last one is top)."""
    counts = feature_layer_counts(len(states), count)[:-1]
    return jnp.concatenate([self.decoder_norm(states[c - 1]) for c in counts] + [top], axis=-1)

  def _logits(self, top: Array, deterministic: bool) -> Array:
    """Logits of the top hidden states after the final norm (`decoder_norm`)."""
    y = self.dropout(top, deterministic=deterministic)
    tied = self.config.logits_via_embedding
    # Tied: in the norm's dtype (float32 under float32_logits, else the config's); untied:
    # `logits_dense` multiplies in float32.
    dtype = y.dtype if tied else jnp.float32
    kernel = _decode_variable(self, 'logits_kernel')
    if kernel is not None:
      logits = jnp.dot(y.astype(dtype), kernel.astype(dtype))
    elif tied:
      logits = self.shared_embedding.attend(y, dtype)
    else:
      logits = self.logits_dense(y)
    if tied:
      logits = logits / jnp.sqrt(y.shape[-1]).astype(dtype)
    index = _decode_variable(self, 'logits_index')
    if index is not None:  # a restricted vocabulary: every other token is masked
      # A gather into the full vocabulary: XLA:CPU runs a scatter of the kept tokens' logits
      # index by index, 1.5x slower at batch 8 than the logits over all tokens.
      kept = jnp.take(logits, jnp.maximum(index, 0), axis=-1)
      logits = jnp.where(index >= 0, kept, jnp.asarray(MASK_BIAS, logits.dtype))
    return logits

  def cross_kv(self, encoded: Array) -> Tuple[Tuple[Array, Array], ...]:
    return tuple(layer.cross_kv(encoded) for layer in self.layers)

  def __call__(self, encoded: Array, encoder_input_tokens: Array, decoder_input_tokens: Array,
               decoder_target_tokens: Array, encoder_segment_ids: Optional[Array] = None,
               decoder_segment_ids: Optional[Array] = None,
               deterministic: bool = True, features: Optional[Array] = None,
               own_features: Optional[Array] = None, return_features: int = 0
               ) -> Union[Array, Tuple[Array, Array]]:
    """Teacher-forced decoder: [batch, length] inputs -> logits [batch, length, vocab] (float32).

    As in T5X, positions where `decoder_target_tokens` is 0 are masked as padding. A feature
    draft reads each position's feature (`_inputs`): features [batch, length, feature_width]
    or own_features [batch, length, emb], row p the feature of position p - 1 (zero at 0).
    return_features: k > 0 returns (logits, `_features` of k hidden states [batch, length,
    k * emb]); k = 1 (or True): the top one after the final norm.
    """
    length = decoder_input_tokens.shape[1]
    valid = decoder_target_tokens > 0
    positions = jnp.arange(length)
    self_mask = (valid[:, None, :, None] & valid[:, None, None, :] &
                 (positions[None, None, None, :] <= positions[None, None, :, None]))
    cross_mask = valid[:, None, :, None] & (encoder_input_tokens > 0)[:, None, None, :]
    if decoder_segment_ids is not None:
      self_mask &= decoder_segment_ids[:, None, :, None] == decoder_segment_ids[:, None, None, :]
      if encoder_segment_ids is not None:
        cross_mask &= decoder_segment_ids[:, None, :, None] == encoder_segment_ids[:, None, None, :]
    self_bias = self.relpos_bias(positions[None], positions) + _mask_bias(self_mask)
    cross_bias = _mask_bias(cross_mask)
    y = self.dropout(self._inputs(decoder_input_tokens, features, own_features),
                     deterministic=deterministic)
    states = []
    for layer in self.layers:
      y, _ = layer(y, self_bias, layer.cross_kv(encoded), cross_bias, deterministic=deterministic)
      states.append(y)
    top = self.decoder_norm(y)
    logits = self._logits(top, deterministic)
    if not return_features:
      return logits
    return logits, self._features(states, top, int(return_features))

  def decode_step(self, tokens: Array, cache: DecoderCache, num_new: Optional[Array] = None,
                  logits_at: Optional[Array] = None, features: Optional[Array] = None
                  ) -> Tuple[Array, DecoderCache]:
    """Appends tokens [batch, k] at each row's own `cache.index`; returns logits [batch, k, vocab].

    Token j of row b sits at position `cache.index[b] + j` and attends to every cached position
    up to its own. The new index is `index + num_new` ([batch], default k): rows that fed padding
    after their real tokens keep those entries beyond their index, where they are never read.
    logits_at: optional [batch] int32; then only token logits_at[b]'s logits are computed:
    [batch, 1, vocab] (the output projection is most of a small model's step).
    features: a feature draft's [batch, max_length, feature_width], the target's `features`
    cache: each token reads the row at its position - 1 (zero at position 0). Without them
    (one token a row), it reads the draft's own `cache.hidden`.
    """
    k = tokens.shape[1]
    positions = cache.index[:, None] + jnp.arange(k)[None, :]  # [batch, k]
    key_positions = jnp.arange(cache.max_length)
    self_mask = key_positions[None, None, None, :] <= positions[:, None, :, None]
    self_bias = self.relpos_bias(positions, key_positions) + _mask_bias(self_mask)
    own = None
    if features is not None:
      previous = jnp.clip(positions - 1, 0, features.shape[1] - 1)
      features = jnp.where((positions > 0)[..., None],
                           jnp.take_along_axis(features, previous[..., None], axis=1), 0)
    elif cache.hidden is not None:
      own = jnp.broadcast_to(cache.hidden[:, None], positions.shape + cache.hidden.shape[-1:])
    inputs = self._inputs(tokens, features, own)
    logits, new_cache = self._cached_step(inputs, cache, positions, self_bias, logits_at)
    advance = k if num_new is None else num_new
    return logits, new_cache.replace(index=cache.index + advance)

  def _cached_step(self, y: Array, cache: DecoderCache, write_slots: Array,
                   self_bias: Array, logits_at: Optional[Array] = None
                   ) -> Tuple[Array, DecoderCache]:
    """Writes the inputs y [batch, k, emb] (`_inputs`) at cache slots write_slots [batch, k],
    attends with self_bias [batch, heads, k, max_length]; returns (logits [batch, k, vocab], or
    [batch, 1, vocab] at the offsets logits_at [batch], cache, index unchanged). A cache with
    `features` gets the hidden states a feature draft reads (`_features`, as many as its width
    holds) at the same slots; one with `hidden`, the top one of the last token (of token
    logits_at[b])."""
    cross_bias = _mask_bias(cache.encoder_mask[:, None, None, :])
    keys, values, states = [], [], []
    for i, layer in enumerate(self.layers):
      y, (key, value) = layer(y, self_bias, (cache.cross_key[i], cache.cross_value[i]), cross_bias,
                              self_cache=(cache.self_key[i], cache.self_value[i], write_slots))
      keys.append(key)
      values.append(value)
      states.append(y)
    new_cache = cache.replace(self_key=tuple(keys), self_value=tuple(values))
    if logits_at is not None:
      y = jnp.take_along_axis(y, logits_at[:, None, None], axis=1)
    top = self.decoder_norm(y)
    if cache.features is not None:
      if logits_at is not None:
        raise ValueError("A target's features are kept for every token it is fed: no logits_at.")
      count = cache.features.shape[-1] // top.shape[-1]
      new_cache = new_cache.replace(features=_write_rows(
          cache.features, self._features(states, top, count), write_slots, axis=1))
    if cache.hidden is not None:
      new_cache = new_cache.replace(hidden=top[:, -1].astype(cache.hidden.dtype))
    return self._logits(top, deterministic=True), new_cache

  def tree_step(self, tokens: Array, cache: DecoderCache, tree_depths: Array,
                tree_mask: Array) -> Tuple[Array, DecoderCache]:
    """Scores the last k nodes of a token tree in one call: tokens [batch, k] -> logits
    [batch, k, vocab], each node's next-token logits given its row's cache and its own ancestors.

    The tree has `nodes` = tree_depths.shape[-1] nodes stored at cache slots index[b] + 0..nodes-1
    (node 0, the root, at slot index[b]); these k tokens are nodes nodes-k..nodes-1, the earlier
    ones were written by earlier calls. Node n has position index[b] + tree_depths[n] (for the
    relative position bias) and sees the cache below index[b] plus the nodes m with
    tree_mask[n - (nodes - k), m] (its ancestors and itself). So a node gets exactly the logits
    of feeding its root-to-node path one token at a time (`DecoderCache.keep_tree_path` then
    commits a path).

    tree_depths: [nodes] or [batch, nodes] int32. tree_mask: [k, nodes] or [batch, k, nodes] bool.
    The cache index is not moved: the tree is scratch space until a path is kept.
    """
    nodes, k = tree_depths.shape[-1], tokens.shape[1]
    depths = jnp.broadcast_to(tree_depths, (tokens.shape[0], nodes))
    mask = jnp.broadcast_to(tree_mask, (tokens.shape[0], k, nodes))
    start = cache.index[:, None]  # [batch, 1]
    write_slots = start + (nodes - k) + jnp.arange(k)[None, :]  # [batch, k]
    positions = start + depths[:, nodes - k:]
    slots = jnp.arange(cache.max_length)[None, :]
    node = slots - start  # [batch, max_length]: the tree node a slot holds, if in [0, nodes)
    in_tree = (node >= 0) & (node < nodes)
    node = jnp.clip(node, 0, nodes - 1)
    key_positions = jnp.where(in_tree, start + jnp.take_along_axis(depths, node, axis=1), slots)
    node_visible = jnp.take_along_axis(mask, jnp.broadcast_to(node[:, None, :], mask.shape[:2] +
                                                              node.shape[1:]), axis=2)
    self_mask = (slots < start)[:, None, :] | (in_tree[:, None, :] & node_visible)
    self_bias = self.relpos_bias(positions, key_positions) + _mask_bias(self_mask[:, None])
    return self._cached_step(self._inputs(tokens), cache, write_slots, self_bias)


class Transformer(nn.Module):
  """T5 encoder-decoder; module and method names as T5X's `network.Transformer`."""
  config: T5Config

  def setup(self):
    cfg = self.config
    self.token_embedder = Embed(cfg.vocab_size, cfg.emb_dim, cfg.dtype)
    if cfg.has_encoder:
      self.encoder = Encoder(cfg, self.token_embedder)
    self.decoder = Decoder(cfg, self.token_embedder)

  def encode(self, encoder_input_tokens: Array, encoder_segment_ids: Optional[Array] = None,
             enable_dropout: bool = False) -> Array:
    """[batch, enc_length] -> [batch, enc_length, emb]."""
    if not self.config.has_encoder:
      raise ValueError(f'This decoder-only model (encoded_width {self.config.encoded_width}) has '
                       'no encoder: pass the encoder output of the model it reads.')
    return self.encoder(encoder_input_tokens, encoder_segment_ids,
                        deterministic=not enable_dropout)

  def decode(self, encoded: Array, encoder_input_tokens: Array, decoder_input_tokens: Array,
             decoder_target_tokens: Array, encoder_segment_ids: Optional[Array] = None,
             decoder_segment_ids: Optional[Array] = None, enable_dropout: bool = False,
             **feature_args: Any) -> Union[Array, Tuple[Array, Array]]:
    """Teacher-forced decoding -> logits [batch, dec_length, vocab]; feature_args
    (features, own_features, return_features) as `Decoder.__call__`'s."""
    return self.decoder(encoded, encoder_input_tokens, decoder_input_tokens,
                        decoder_target_tokens, encoder_segment_ids, decoder_segment_ids,
                        deterministic=not enable_dropout, **feature_args)

  def __call__(self, encoder_input_tokens: Array, decoder_input_tokens: Array,
               decoder_target_tokens: Array, encoder_segment_ids: Optional[Array] = None,
               decoder_segment_ids: Optional[Array] = None, *,
               enable_dropout: bool = False, encoded: Optional[Array] = None,
               **feature_args: Any) -> Union[Array, Tuple[Array, Array]]:
    """Full teacher-forced forward pass -> logits [batch, dec_length, vocab] (float32).

    encoded: [batch, enc_length, encoded_width], the encoder output a decoder-only model reads
      (required for one, except at init, where a zero stand-in gives the parameters' shapes).
    feature_args: `Decoder.__call__`'s (a feature draft's features; return_features).
    """
    cfg = self.config
    if self.is_initializing() and not cfg.has_encoder and encoded is None:
      encoded = jnp.zeros(encoder_input_tokens.shape + (cfg.encoded_width,), cfg.dtype)
    if self.is_initializing() and cfg.feature_width and not feature_args:
      feature_args = {'features': jnp.zeros(decoder_input_tokens.shape + (cfg.feature_width,),
                                            cfg.dtype)}
    if encoded is None:
      encoded = self.encode(encoder_input_tokens, encoder_segment_ids, enable_dropout)
    return self.decode(encoded, encoder_input_tokens, decoder_input_tokens,
                       decoder_target_tokens, encoder_segment_ids, decoder_segment_ids,
                       enable_dropout, **feature_args)

  def init_cache(self, encoded: Array, encoder_input_tokens: Array,
                 max_length: int, feature_layers: int = 0) -> DecoderCache:
    """An empty cache (every row at index 0) for `max_length` decoder positions.

    encoded [batch, enc_length, emb], encoder_input_tokens [batch, enc_length] (0 = padding).
    Cross-attention keys/values are computed here, once. feature_layers: a target's cache keeps
    this many hidden states a position for a feature draft (`DecoderCache.features`); a feature
    draft's cache always has its own `hidden`.
    """
    cfg = self.config
    batch = encoded.shape[0]
    cross = self.decoder.cross_kv(encoded)
    empty_key = jnp.zeros((batch, cfg.num_heads, cfg.head_dim, max_length), cfg.dtype)
    empty_value = jnp.zeros((batch, cfg.num_heads, max_length, cfg.head_dim), cfg.dtype)
    n = cfg.num_decoder_layers
    top_dtype = jnp.float32 if cfg.float32_logits else cfg.dtype  # (`decoder_norm`'s)
    return DecoderCache(
        index=jnp.zeros((batch,), jnp.int32), self_key=(empty_key,) * n,
        self_value=(empty_value,) * n, cross_key=tuple(k for k, _ in cross),
        cross_value=tuple(v for _, v in cross), encoder_mask=encoder_input_tokens > 0,
        features=(jnp.zeros((batch, max_length, feature_layers * cfg.emb_dim), top_dtype)
                  if feature_layers else None),
        hidden=jnp.zeros((batch, cfg.emb_dim), top_dtype) if cfg.feature_width else None)

  def decode_step(self, tokens: Array, cache: DecoderCache, num_new: Optional[Array] = None,
                  logits_at: Optional[Array] = None, features: Optional[Array] = None
                  ) -> Tuple[Array, DecoderCache]:
    """Cached decoding of a chunk tokens [batch, k] -> (logits [batch, k, vocab], cache);
    see `Decoder.decode_step`."""
    return self.decoder.decode_step(tokens, cache, num_new, logits_at, features)

  def tree_step(self, tokens: Array, cache: DecoderCache, tree_depths: Array,
                tree_mask: Array) -> Tuple[Array, DecoderCache]:
    """Tree attention over the cache (`Decoder.tree_step`): logits [batch, k, vocab], cache."""
    return self.decoder.tree_step(tokens, cache, tree_depths, tree_mask)


def decode_variables(config: T5Config, params: Any, fuse: bool = False,
                     vocabulary_ids: Optional[Any] = None) -> Dict[str, Any]:
  """Predict-time copies of parameters in the layouts the encoder and the cached decoder step
  read fastest.

  Pass them as `{'params': params, DECODE_COLLECTION: decode_variables(config, params)}` to
  `Transformer.encode`, `init_cache` and `decode_step`; without them each computes the same
  values from `params`. The parameter tree and checkpoints are unchanged. Computed once per
  job (`EncoderDecoderModel.with_decode_variables`), or per decode when not prepared:
    decoder/logits_kernel (tied embeddings): the embedding transposed, [emb, vocab].
      `y @ embedding.T` makes XLA:CPU transpose the table (or repack it) on every step.
  With `vocabulary_ids` ([n] token ids), logits over those tokens only, every other token at
  MASK_BIAS: decoder/logits_kernel [emb, n] holds their columns, decoder/logits_index [vocab]
  each token's column (-1: masked). For a draft, whose proposals are only proposals (the target
  decides what is emitted, and speculative sampling's acceptance uses the distribution the
  draft sampled from), a vocabulary cut to the tokens it ever proposes keeps every output exact
  and makes its vocabulary projection, most of a small draft's step, proportionally cheaper.
  With `fuse`, projections that read one input are stacked into one matmul:
    {encoder,decoder}/layers_i/{attention,self_attention}/qkv_kernel: [emb, 3, heads * head_dim]
      (query, key, value);
    decoder/layers_i/encoder_decoder_attention/kv_kernel: [emb, 2, heads * head_dim];
    {encoder,decoder}/layers_i/mlp/wi_kernel (gated MLPs, T5 1.1): [emb, 2, mlp] (wi_0, wi_1).
  Fewer matmul kernels reading the same bytes; measured neutral on a 2-core CPU
  (docs/engine.md), at the price of a second copy of about two thirds of the weights.
  """
  stack = lambda tree, names: jnp.stack([tree[n]['kernel'] for n in names], axis=1)
  qkv = ('query', 'key', 'value')
  wi = tuple(f'wi_{j}' for j in range(len(config.mlp_activations)))
  out = {'encoder': {}, 'decoder': {}}
  for stack_name, count, attention in (('encoder', config.num_encoder_layers, 'attention'),
                                       ('decoder', config.num_decoder_layers, 'self_attention')):
    for i in range(count if fuse else 0):
      layer = params[stack_name][f'layers_{i}']
      entry = {attention: {'qkv_kernel': stack(layer[attention], qkv)}}
      if stack_name == 'decoder':
        entry['encoder_decoder_attention'] = {
            'kv_kernel': stack(layer['encoder_decoder_attention'], ('key', 'value'))}
      if len(wi) > 1:
        entry['mlp'] = {'wi_kernel': stack(layer['mlp'], wi)}
      out[stack_name][f'layers_{i}'] = entry
  if vocabulary_ids is not None:
    ids = jnp.asarray(vocabulary_ids, jnp.int32)
    kernel = (jnp.transpose(params['token_embedder']['embedding'])
              if config.logits_via_embedding else params['decoder']['logits_dense']['kernel'])
    out['decoder']['logits_kernel'] = jnp.take(kernel, ids, axis=1)
    out['decoder']['logits_index'] = jnp.full((config.vocab_size,), -1, jnp.int32).at[ids].set(
        jnp.arange(ids.shape[0], dtype=jnp.int32))
  elif config.logits_via_embedding:
    out['decoder']['logits_kernel'] = jnp.transpose(params['token_embedder']['embedding'])
  return {k: v for k, v in out.items() if v}


@functools.lru_cache(maxsize=16)
def decode_variables_logical_axes(config: T5Config) -> Dict[str, Any]:
  """Logical axis names of every variable `decode_variables(config, ...)` can make (with or
  without `fuse` and `vocabulary_ids`), in its tree (for shardings; cached per config, not to
  be modified).

  The stacked axis is never split: a model-parallel shard holds its own heads' query, key and
  value (its own columns of each wi), so a stacked matmul needs no collective.
  """
  params = jax.eval_shape(functools.partial(init_params, config))[0]
  shapes = jax.eval_shape(functools.partial(decode_variables, config, fuse=True,
                                            vocabulary_ids=np.zeros(1, np.int32)), params)
  stacked = ('embed', 'stack', 'joined_kv')
  names = {'qkv_kernel': stacked, 'kv_kernel': stacked, 'logits_kernel': ('embed', 'vocab'),
           'wi_kernel': ('embed', 'mlp_activations', 'mlp'), 'logits_index': ('vocab',)}
  return jax.tree_util.tree_map_with_path(lambda path, _: names[path[-1].key], shapes)


def init_params(config: T5Config, rng: Optional[jax.Array] = None, batch_size: int = 1,
                encoder_length: int = 8, decoder_length: int = 8) -> Tuple[Any, Any]:
  """Random parameters and their logical axes: (params, params_axes) as T5X's init gives them."""
  rng = jax.random.PRNGKey(0) if rng is None else rng
  variables = _init_variables(config, rng, batch_size, encoder_length, decoder_length)
  return variables['params'], variables['params_axes']


# The config and shapes are static arguments, so jax's compilation cache serves every later call
# with the same config (jitting a fresh module's bound `init` would compile the whole network
# again each time: seconds per call on a CPU).
@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4))
def _init_variables(config: T5Config, rng: jax.Array, batch_size: int, encoder_length: int,
                    decoder_length: int) -> Any:
  enc = jnp.ones((batch_size, encoder_length), jnp.int32)
  dec = jnp.ones((batch_size, decoder_length), jnp.int32)
  return Transformer(config).init(rng, enc, dec, dec)


def validate_params(params: Any, config: T5Config, source: str = '') -> None:
  """Checks that `params` has exactly the names and shapes `init_params(config)` makes.

  Raises a one-line ValueError naming the first missing parameter, else the first unexpected
  one, else the first mis-shaped one with both shapes ('first' in sorted path order), followed
  by the counts of each kind of difference. `source` (a path) is appended when given.
  """
  expected = _expected_shapes(config)
  actual = {'/'.join(k): tuple(np.shape(v)) for k, v in traverse_util.flatten_dict(params).items()}
  missing = sorted(set(expected) - set(actual))
  unexpected = sorted(set(actual) - set(expected))
  misshaped = sorted(k for k in set(expected) & set(actual) if expected[k] != actual[k])
  if missing:
    problem = f"parameter '{missing[0]}' is missing from the checkpoint"
  elif unexpected:
    problem = f"parameter '{unexpected[0]}' is in the checkpoint but not in the config"
  elif misshaped:
    name = misshaped[0]
    problem = (f"parameter '{name}' has shape {actual[name]} in the checkpoint but "
               f'{expected[name]} in the config')
  else:
    return
  counts = (f'{len(missing)} missing, {len(unexpected)} unexpected, '
            f'{len(misshaped)} mis-shaped in all')
  where = f' [{source}]' if source else ''
  raise ValueError(f'checkpoint does not match T5Config: {problem} ({counts}){where}')


@functools.lru_cache(maxsize=16)
def _expected_shapes(config: T5Config) -> Dict[str, Tuple[int, ...]]:
  """{'encoder/layers_0/...': shape} of `init_params(config)`, traced (nothing is computed)."""
  params, _ = jax.eval_shape(functools.partial(init_params, config))
  return {'/'.join(k): tuple(v.shape) for k, v in traverse_util.flatten_dict(params).items()}
