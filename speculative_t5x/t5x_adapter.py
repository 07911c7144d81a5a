"""Optional adapter for T5X users: speculative / BiLD decoding inside `python -m t5x.infer`.

Only importable usefully when T5X is installed (`T5X_AVAILABLE`); nothing else in the package
imports it. `SpeculativeEncoderDecoderModel` is a `t5x.models.EncoderDecoderModel` whose
parameters are `{'target': ..., 'draft': ...}` and whose `predict_batch_with_aux` runs this
package's decoders (T5X's own decode_fn contract gives a decoder one model only, so a two-model
decoder needs this subclass; T5X's docs call it "option 2"). Gin, with T5X's infer.gin:

  from speculative_t5x import decoding as spec_decoding
  from speculative_t5x import network as spec_network
  from speculative_t5x import t5x_adapter
  MODEL = @t5x_adapter.SpeculativeEncoderDecoderModel()
  t5x_adapter.SpeculativeEncoderDecoderModel:
    module = @target/spec_network.Transformer()
    draft_module = @draft/spec_network.Transformer()
    decode_fn = @spec_decoding.speculative_sample
    input_vocabulary = %VOCABULARY
    output_vocabulary = %VOCABULARY
    optimizer_def = None
  target/spec_network.Transformer.config = @target/spec_network.T5Config()
  draft/spec_network.Transformer.config = @draft/spec_network.T5Config()
  (plus the two T5Config bindings, and `from __gin__ import dynamic_registration` at the top)

The checkpoint given to T5X must hold both models under `target/` and `draft/`, e.g. written
with `checkpoints.save_t5x_legacy_checkpoint(dir, {'target': t, 'draft': d})`.
`score_batch` and training losses use the target alone.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Mapping, Optional

import flax

from speculative_t5x import decoding
from speculative_t5x import models

T5X_AVAILABLE = importlib.util.find_spec('t5x') is not None


def _build_class():
  from t5x import models as t5x_models  # pylint: disable=g-import-not-at-top

  class SpeculativeEncoderDecoderModel(t5x_models.EncoderDecoderModel):
    """T5X model over a target `network.Transformer` and a draft one (params target/draft)."""

    def __init__(self, module, draft_module, input_vocabulary, output_vocabulary,
                 optimizer_def=None, decode_fn: Callable = decoding.speculative_sample,
                 decode_kwargs: Optional[Mapping[str, Any]] = None, **kwargs):
      super().__init__(module=module, input_vocabulary=input_vocabulary,
                       output_vocabulary=output_vocabulary, optimizer_def=optimizer_def,
                       decode_fn=decode_fn, **kwargs)
      self.draft_module = draft_module
      self._pair = models.EncoderDecoderModel(
          module.config, draft_module.config, decode_fn=decode_fn, decode_kwargs=decode_kwargs,
          input_vocabulary=input_vocabulary, output_vocabulary=output_vocabulary)

    def get_initial_variables(self, rng, input_shapes, input_types=None):
      # T5X's version passes keyword arguments (positions, decode=...) that this network's
      # __call__ does not take; the pair model initialises both networks.
      del input_types
      return flax.core.freeze(self._pair.get_initial_variables(rng, input_shapes))

    def _compute_logits(self, params, batch, dropout_rng=None, mutable=False,
                        other_variables=None):
      del mutable, other_variables
      rngs = {'dropout': dropout_rng} if dropout_rng is not None else None
      return self.module.apply(
          {'params': params['target']}, batch['encoder_input_tokens'],
          batch['decoder_input_tokens'], batch['decoder_target_tokens'],
          encoder_segment_ids=batch.get('encoder_segment_ids'),
          decoder_segment_ids=batch.get('decoder_segment_ids'),
          enable_dropout=rngs is not None, rngs=rngs)

    def predict_batch_with_aux(self, params, batch, rng=None, decoder_params=None,
                               return_all_decodes=None, num_decodes=None,
                               prompt_with_targets=False):
      return self._pair.predict_batch_with_aux(
          params, batch, rng, decoder_params=decoder_params,
          return_all_decodes=bool(return_all_decodes), num_decodes=num_decodes or 1,
          prompt_with_targets=prompt_with_targets)

  return SpeculativeEncoderDecoderModel


if T5X_AVAILABLE:
  SpeculativeEncoderDecoderModel = _build_class()
