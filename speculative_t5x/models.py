"""A target + draft encoder-decoder model in the style of T5X's `models.EncoderDecoderModel`.

`params = {'target': <T5 params>, 'draft': <T5 params>}`; batches are T5X's feature dicts
(`encoder_input_tokens`, `decoder_input_tokens`, `decoder_target_tokens`, `decoder_loss_weights`,
all [batch, length] int32 / float32). The decoding algorithm is the constructor's `decode_fn`
(gin: `models.EncoderDecoderModel.decode_fn = @decoding.speculative_sample`); decode functions
that take `draft_cache`/`draft_tokens_to_logits` get the draft model, the others (T5X's
temperature_sample, beam_search) run the target alone.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp

from speculative_t5x import decoding
from speculative_t5x import network

Array = jnp.ndarray
Params = Mapping[str, Any]


# An optional batch feature: each row's sampling temperature, [batch] float32 (0 = greedy); it
# overrides the decoder's `temperature` (the infer job fills it from the inputs' "temperature").
TEMPERATURE_FEATURE = 'decoder_temperature'


def make_tokens_to_logits(module: network.Transformer, params: Params,
                          decode_variables: Optional[Mapping[str, Any]] = None
                          ) -> decoding.TokensToLogits:
  """The decoding loops' `tokens_to_logits` for one model: feeds cur_token at cur_index.

  A `decoding.TreeDecodingState` is scored as a token tree (`network.Transformer.tree_step`).

  `decode_variables` (`network.decode_variables` of `params`) are computed here, outside the
  decoding loop that calls the result, unless given; then without the stacked projections,
  whose copies would cost every call memory and time (`with_decode_variables` makes them once).
  """
  if decode_variables is None:
    decode_variables = network.decode_variables(module.config, params, fuse=False)
  variables = {'params': params, network.DECODE_COLLECTION: decode_variables}

  def tokens_to_logits(state: decoding.DecodingState):
    cache = state.cache.with_index(state.cur_index)
    if isinstance(state, decoding.TreeDecodingState):
      return module.apply(variables, state.cur_token, cache, state.tree_depths, state.tree_mask,
                          method=network.Transformer.tree_step)
    return module.apply(variables, state.cur_token, cache, logits_at=state.logits_at,
                        features=getattr(state, 'features', None),
                        method=network.Transformer.decode_step)

  return tokens_to_logits


def _check_reads(config: network.T5Config, encoder_config: Optional[network.T5Config],
                 name: str) -> None:
  """Raises a one-line ValueError unless `config` has an encoder or can read the encoder
  output of the model of `encoder_config`."""
  if config.has_encoder:
    return
  if encoder_config is None or not encoder_config.has_encoder:
    raise ValueError(f'The {name} is decoder-only (encoded_width {config.encoded_width}): it '
                     'needs a model with an encoder to read.')
  if config.encoded_width != encoder_config.emb_dim:
    raise ValueError(f'The {name} reads an encoder output of width {config.encoded_width}, but '
                     f'the encoder it reads has emb_dim {encoder_config.emb_dim}.')


def _takes_draft(decode_fn: Callable) -> bool:
  fn = decode_fn.func if isinstance(decode_fn, functools.partial) else decode_fn
  return 'draft_tokens_to_logits' in inspect.signature(fn).parameters


class EncoderDecoderModel:
  """T5 target (and optional draft) with T5X's predict/score interface.

  params: {'target': T5 params, 'draft': T5 params} (T5X's trees), optionally with
  'decode': {'target': ..., 'draft': ...}, their `network.decode_variables` from
  `with_decode_variables` (else computed inside every predict call: ~2 ms a batch on CPU for the
  embedded pair, worth hoisting when batches are small).

  target_config / draft_config: the two networks' `network.T5Config`s.
  decode_fn: `decoding.speculative_sample` (default), `decoding.bild_decode`,
    `decoding.temperature_sample`, `beam_search.beam_search` or
    `beam_search.speculative_beam_search`; `decode_kwargs` are passed to it
    (e.g. gamma, temperature), and `predict_batch_with_aux(decoder_params=...)` overrides them.
  eos_id / draft_eos_id: the two models' EOS ids (default: from the vocabularies, else 1).
  encoder_config: only for a decoder-only target (`T5Config.encoded_width`, e.g. such a draft
    decoding alone): the config of the model whose encoder it reads, from params['encoder'].

  A decoder-only draft reads the target's encoder output: one encoder runs per batch.
  """

  def __init__(self, target_config: network.T5Config,
               draft_config: Optional[network.T5Config] = None,
               decode_fn: Callable = decoding.speculative_sample,
               decode_kwargs: Optional[Mapping[str, Any]] = None,
               input_vocabulary: Any = None, output_vocabulary: Any = None,
               draft_output_vocabulary: Any = None, eos_id: Optional[int] = None,
               draft_eos_id: Optional[int] = None,
               encoder_config: Optional[network.T5Config] = None):
    self.target_config = target_config
    self.encoder_config = encoder_config
    if encoder_config is not None and target_config.has_encoder:
      raise ValueError('encoder_config is for a decoder-only target; this target has an encoder.')
    self.encoder_module = network.Transformer(encoder_config) if encoder_config else None
    _check_reads(target_config, encoder_config, 'target')
    self.draft_config = draft_config
    self.module = network.Transformer(target_config)
    self.draft_module = network.Transformer(draft_config) if draft_config else None
    self.decode_fn = decode_fn
    self.decode_kwargs = dict(decode_kwargs or {})
    self.input_vocabulary = input_vocabulary
    self.output_vocabulary = output_vocabulary
    self.draft_output_vocabulary = draft_output_vocabulary
    vocab_eos = lambda v: getattr(v, 'eos_id', None) if v is not None else None
    self.eos_id = eos_id if eos_id is not None else (vocab_eos(output_vocabulary) or 1)
    self.draft_eos_id = draft_eos_id if draft_eos_id is not None else (
        vocab_eos(draft_output_vocabulary) or self.eos_id)
    self.uses_draft = _takes_draft(decode_fn)
    # Applied to each decoder cache where it is created; `partitioning.partition_predict` sets
    # it to pin caches to their mesh shardings (identity otherwise).
    self.constrain_cache: Callable[[Any], Any] = lambda cache: cache
    if self.uses_draft:
      self._check_draft_compatible()

  def with_decoder(self, decode_fn: Callable, decode_kwargs: Mapping[str, Any]
                   ) -> 'EncoderDecoderModel':
    """This model's networks and vocabularies decoding with decode_fn(**decode_kwargs): a new
    model (whether it needs the draft follows from decode_fn)."""
    return EncoderDecoderModel(
        self.target_config, self.draft_config, decode_fn=decode_fn, decode_kwargs=decode_kwargs,
        input_vocabulary=self.input_vocabulary, output_vocabulary=self.output_vocabulary,
        draft_output_vocabulary=self.draft_output_vocabulary, eos_id=self.eos_id,
        draft_eos_id=self.draft_eos_id, encoder_config=self.encoder_config)

  def _check_draft_compatible(self, params: Optional[Params] = None) -> None:
    """Raises ValueError naming both values if target and draft cannot be combined."""
    if self.draft_config is None:
      raise ValueError(f'{getattr(self.decode_fn, "__name__", self.decode_fn)} needs a draft '
                       'model: pass draft_config.')
    sizes = {'target': self.target_config.vocab_size, 'draft': self.draft_config.vocab_size}
    if params is not None:
      sizes = {name: params[name]['token_embedder']['embedding'].shape[0] for name in sizes}
    if sizes['target'] != sizes['draft']:
      raise ValueError(f'Draft and target vocabularies differ: target vocab_size '
                       f'{sizes["target"]}, draft vocab_size {sizes["draft"]}.')
    if self.eos_id != self.draft_eos_id:
      raise ValueError(f'Draft and target EOS ids differ: target eos_id {self.eos_id}, '
                       f'draft eos_id {self.draft_eos_id}.')
    _check_reads(self.draft_config, self.target_config, 'draft')
    count, layers = self.draft_config.feature_layers, self.target_config.num_decoder_layers
    if count > layers:
      raise ValueError(f'The feature draft reads {count} hidden states of its target '
                       f'(feature_width {self.draft_config.feature_width}), which has {layers} '
                       'decoder layers.')

  # ---------------------------------------------------------------------------------------------

  def get_initial_variables(self, rng: jax.Array, input_shapes: Mapping[str, Tuple[int, ...]]
                            ) -> Dict[str, Any]:
    """{'params': {'target', 'draft'}, 'params_axes': {...}} for T5X-style input shapes."""
    enc = jnp.ones(input_shapes['encoder_input_tokens'], jnp.int32)
    dec = jnp.ones(input_shapes['decoder_input_tokens'], jnp.int32)
    target_rng, draft_rng = jax.random.split(rng)
    out = {'params': {}, 'params_axes': {}}
    for name, module, key in (('target', self.module, target_rng),
                              ('draft', self.draft_module, draft_rng)):
      if module is not None:
        variables = module.init(key, enc, dec, dec)
        out['params'][name] = variables['params']
        out['params_axes'][name] = variables['params_axes']
    return out

  def with_decode_variables(self, params: Params, fuse: bool = False,
                            draft_vocabulary: Optional[Any] = None) -> Dict[str, Any]:
    """`params` plus 'decode': each model's `network.decode_variables`, for repeated predicts.

    fuse: with the stacked projections (measured neutral on a 2-core CPU, docs/engine.md,
      and they cost a copy of two thirds of the weights: off unless asked for).
    draft_vocabulary: optional token ids the draft may propose (`network.decode_variables`'
      `vocabulary_ids`; outputs stay exact), e.g. `checkpoints.load_draft_vocabulary(path)`.
    """
    out = {}
    for name, module in (('target', self.module), ('draft', self.draft_module)):
      if module is not None and name in params:
        ids = draft_vocabulary if name == 'draft' else None
        out[name] = network.decode_variables(module.config, params[name], fuse, ids)
    return {**params, 'decode': out}

  def _compute_logits(self, params: Params, batch: Mapping[str, Array]) -> Array:
    encoded = (None if self.encoder_module is None else
               self._encode(params, batch['encoder_input_tokens'], {}))
    return self.module.apply({'params': params['target']}, batch['encoder_input_tokens'],
                             batch['decoder_input_tokens'], batch['decoder_target_tokens'],
                             encoded=encoded)

  def score_batch(self, params: Params, batch: Mapping[str, Array]) -> Array:
    """Sum of the target's log-probabilities of `decoder_target_tokens`, weighted: [batch]."""
    logits = self._compute_logits(params, batch)
    log_probs = jax.nn.log_softmax(logits)
    token_scores = jnp.take_along_axis(log_probs, batch['decoder_target_tokens'][..., None],
                                       axis=-1)[..., 0]
    weights = batch.get('decoder_loss_weights')
    if weights is None:
      weights = batch['decoder_target_tokens'] > 0
    return jnp.sum(token_scores * weights, axis=-1)

  def _encode(self, params: Params, encoder_input_tokens: Array,
              prepared: Mapping[str, Any]) -> Array:
    """The encoder output the target reads: [batch, enc_length, emb] (its own encoder's, else
    that of `encoder_config`'s model)."""
    if self.encoder_module is not None:
      module, variables = self.encoder_module, {'params': params['encoder']}
    else:
      variables = {'params': params['target'],
                   network.DECODE_COLLECTION: prepared.get('target') or {}}
      module = self.module
    return module.apply(variables, encoder_input_tokens, method=network.Transformer.encode)

  def _init_cache(self, module: network.Transformer, params: Params, encoder_input_tokens: Array,
                  max_length: int, decode_variables: Optional[Mapping[str, Any]] = None,
                  encoded: Optional[Array] = None, feature_layers: int = 0
                  ) -> network.DecoderCache:
    """An empty decoder cache over `encoded`, or over the module's own encoder output."""
    variables = {'params': params, network.DECODE_COLLECTION: decode_variables or {}}
    if module.config.has_encoder:
      encoded = module.apply(variables, encoder_input_tokens, method=network.Transformer.encode)
    return self.constrain_cache(
        module.apply(variables, encoded, encoder_input_tokens, max_length, feature_layers,
                     method=network.Transformer.init_cache))

  def init_caches(self, params: Params, encoder_input_tokens: Array, max_length: int,
                  with_draft: bool = True
                  ) -> Tuple[network.DecoderCache, Optional[network.DecoderCache]]:
    """A batch's empty (target cache, draft cache) for `max_length` decoder positions; the
    draft's is None without `with_draft` or when `decode_fn` takes no draft. A decoder-only draft
    reads the target's encoder output, computed once; for a feature draft the target's cache
    keeps the hidden states it reads (`network.DecoderCache.features`)."""
    prepared = params.get('decode', {})
    encoded = self._encode(params, encoder_input_tokens, prepared)
    with_draft = self.uses_draft and with_draft
    cache = self._init_cache(self.module, params['target'], encoder_input_tokens, max_length,
                             prepared.get('target'), encoded,
                             self.draft_config.feature_layers if with_draft else 0)
    if not with_draft:
      return cache, None
    return cache, self._init_cache(self.draft_module, params['draft'], encoder_input_tokens,
                                   max_length, prepared.get('draft'), encoded)

  def predict_batch_with_aux(self, params: Params, batch: Mapping[str, Array],
                             rng: Optional[jax.Array] = None,
                             decoder_params: Optional[Mapping[str, Any]] = None,
                             return_all_decodes: bool = False, num_decodes: int = 1,
                             prompt_with_targets: bool = False) -> Tuple[Array, Dict[str, Any]]:
    """Decodes a batch: (decodes [batch, length], aux) as T5X's predict_batch_with_aux.

    With return_all_decodes, decodes are [batch, num_decodes, length] sorted best last.
    aux: 'scores' ([batch] or [batch, num_decodes]) and, for the draft-verify loops,
    'stats': per-row `decoding.DecodeStats` fields as a dict.
    batch: encoder_input_tokens [batch, input_length], decoder_input_tokens [batch, length],
    optionally `TEMPERATURE_FEATURE` [batch] (per-row temperatures).
    Jittable; `decode_fn` and `decoder_params` are static.
    """
    if self.uses_draft:
      self._check_draft_compatible(params)
    encoder_input_tokens = batch['encoder_input_tokens']
    decoder_input_tokens = batch['decoder_input_tokens']
    max_length = decoder_input_tokens.shape[1]
    if prompt_with_targets:
      inputs = jnp.where(decoder_input_tokens == self.eos_id, 0, decoder_input_tokens)
    else:
      inputs = jnp.zeros_like(decoder_input_tokens)
    kwargs = {**self.decode_kwargs, **(decoder_params or {})}
    prepared = params.get('decode', {})  # `with_decode_variables`
    if TEMPERATURE_FEATURE in batch:  # per-row temperatures, traced: no recompilation
      kwargs['temperature'] = batch[TEMPERATURE_FEATURE]
    # speculative_sample at gamma 0 is the target alone (a calibrated schedule's choice where
    # speculation does not pay): the draft's encoder and cache would be work for nothing.
    with_draft = kwargs.get('gamma') != 0
    cache, draft_cache = self.init_caches(params, encoder_input_tokens, max_length, with_draft)
    kwargs.update(
        inputs=inputs, eos_id=self.eos_id, num_decodes=num_decodes, decode_rng=rng, cache=cache,
        tokens_to_logits=make_tokens_to_logits(self.module, params['target'],
                                               prepared.get('target')))
    signature = inspect.signature(getattr(self.decode_fn, 'func', self.decode_fn)).parameters
    wants_stats = 'return_stats' in signature
    if 'max_decode_steps' in signature:
      # Rows that are all padding (the filler of a fixed-shape last batch) decode nothing, so
      # they cannot keep the batch's loop running.
      steps = kwargs.get('max_decode_steps')
      steps = max_length if steps is None else steps
      empty = ~jnp.any(encoder_input_tokens > 0, axis=1)
      kwargs['max_decode_steps'] = jnp.where(empty, 0, steps)
    if wants_stats:
      kwargs['return_stats'] = True
    if self.uses_draft:
      kwargs['draft_cache'] = draft_cache
      kwargs['draft_tokens_to_logits'] = make_tokens_to_logits(
          self.draft_module, params['draft'], prepared.get('draft')) if with_draft else None
    outputs = self.decode_fn(**kwargs)
    decodes, scores = outputs[0], outputs[1]
    aux = {}
    if wants_stats:
      stats = outputs[2]
      aux['stats'] = {f: getattr(stats, f) for f in stats.__dataclass_fields__}
    if not return_all_decodes:
      decodes, scores = decodes[:, -1], scores[:, -1]
      if 'stats' in aux:
        aux['stats'] = {k: v[:, -1] for k, v in aux['stats'].items()}
    aux['scores'] = scores
    return decodes, aux

  def predict_batch(self, params: Params, batch: Mapping[str, Array],
                    rng: Optional[jax.Array] = None, **kwargs) -> Array:
    return self.predict_batch_with_aux(params, batch, rng, **kwargs)[0]
