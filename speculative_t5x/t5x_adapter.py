"""Optional adapter for T5X users: speculative / BiLD decoding inside `python -m t5x.infer`.

Only usefully importable when T5X is installed (`T5X_AVAILABLE`); nothing else in the package
imports it. `SpeculativeEncoderDecoderModel` is a `t5x.models.EncoderDecoderModel` whose
parameters are `{'target': ..., 'draft': ...}` and whose `predict_batch_with_aux` runs this
package's decoders (T5X's decode_fn contract hands a decoder one model only, so a two-model
decoder needs a model subclass; T5X's docs call this "option 2").

Recipe (the embedded Multi30k De->En pair; every file below ships in the package):

  1. One T5X checkpoint holding both models, under `target/` and `draft/`:

       python -m speculative_t5x.t5x_adapter --output_dir=/tmp/multi30k_pair
       # -> /tmp/multi30k_pair/checkpoint_0 (T5X legacy format: msgpack + zarr arrays)

     (`write_pair_checkpoint` in Python; other weights: --target=... --draft=..., anything
     `checkpoints.load_checkpoint` reads.)

  2. T5X's CLI with T5X's own infer.gin and the files in `gin_configs/t5x/`, from any directory
     (gin finds `speculative_t5x/gin_configs/t5x/*.gin` through the Python path: installed, or
     `pip install -e .` from a clone):

       python -m t5x.infer \
         --gin_file=t5x/configs/runs/infer.gin \
         --gin_file=speculative_t5x/gin_configs/t5x/multi30k_pair.gin \
         --gin_file=speculative_t5x/gin_configs/t5x/speculative_greedy.gin \
         --gin_file=speculative_t5x/gin_configs/t5x/multi30k_task.gin \
         --gin.CHECKPOINT_PATH="'/tmp/multi30k_pair/checkpoint_0'" \
         --gin.INFER_OUTPUT_DIR="'/tmp/t5x_infer'"

     multi30k_pair.gin: MODEL = this class over both networks (values of
     gin_configs/pairs/multi30k.gin, scoped `target/` and `draft/`) and VOCABULARY (via
     vocab_multi30k.gin). speculative_greedy.gin: decode_fn = speculative_sample, gamma 4,
     temperature 0 (output identical to the target's greedy decoding); bild.gin instead: BiLD,
     greedy. multi30k_task.gin: the `multi30k_de_en` seqio task (split 'test'), feature lengths
     64 (data: $SPECULATIVE_T5X_DATA/multi30k). The files use gin's dynamic registration, as
     T5X's own do: configurables are named by the modules imported in them
     (`spec_network.T5Config`, ...), so they need no project registration code
     (gin_configs/pairs/*.gin, written for this project's CLI, do).
     --gin.infer.mode="'predict_with_aux'" adds each prediction's score (0 when greedy, as
     T5X's temperature_sample gives) and decode statistics (tokens proposed / accepted, target
     and draft calls); --gin.infer.mode="'score'" writes the target's log-likelihoods of the
     task's targets.

  3. The check: multi30k_target_t5x_greedy.gin in place of multi30k_pair.gin and the decoding
     file runs T5X's own EncoderDecoderModel, minimal T5 network and temperature_sample
     (temperature 0) on the checkpoint's target half; the predictions of step 2 equal its.

Training a draft: `DistillationEncoderDecoderModel` is the same pair with a loss, token
distillation of the draft from the frozen target (`evaluation.Objective`, this project's
trainer's), for `python -m t5x.train` with gin_configs/t5x/multi30k_distill.gin (its header
has the command; docs/t5x.md).

`speculative_sample`'s own default is temperature 1 (sampling): without speculative_greedy.gin
(or an equivalent binding) this model samples. `score_batch` (with `return_intermediates`, as
T5X's) and the training losses use the target alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import flax

from speculative_t5x import costs
from speculative_t5x import data
from speculative_t5x import decoding
from speculative_t5x import evaluation
from speculative_t5x import gin_utils
from speculative_t5x import models
from speculative_t5x import trees

T5X_AVAILABLE = importlib.util.find_spec('t5x') is not None

# The embedded pair's weights, as shipped.
EMBEDDED_TARGET = data.EMBEDDED_TARGET
EMBEDDED_DRAFT = data.EMBEDDED_DRAFT


def packaged_file(path: str) -> str:
  """Absolute path of a file shipped in the package, e.g. 'vocab/multi30k_8k.model'.

  For gin files run by T5X, which resolves relative paths against the working directory only.
  Raises FileNotFoundError if the package has no such file.
  """
  found = gin_utils.PACKAGE_DIR / path
  if not found.is_file():
    raise FileNotFoundError(f'speculative_t5x ships no file {path!r} (looked in '
                            f'{gin_utils.PACKAGE_DIR})')
  return str(found)


def write_pair_checkpoint(output_dir: Union[str, Path],
                          target: Union[str, Path] = EMBEDDED_TARGET,
                          draft: Union[str, Path] = EMBEDDED_DRAFT, step: int = 0) -> Path:
  """Writes one T5X checkpoint holding both models: params `{'target': t, 'draft': d}`.

  This is the checkpoint `SpeculativeEncoderDecoderModel` restores in `t5x.infer`
  (`CHECKPOINT_PATH`): T5X's legacy format, `<output_dir>/checkpoint_<step>/`, arrays as zarr
  under `target.target.<path>` and `target.draft.<path>`. `target` / `draft`: anything
  `checkpoints.load_checkpoint` reads (default: the embedded Multi30k pair). Needs no T5X.
  Returns the `checkpoint_<step>` directory.
  """
  from speculative_t5x import checkpoints  # pylint: disable=g-import-not-at-top  (tensorstore)
  params = {'target': checkpoints.load_checkpoint(target),
            'draft': checkpoints.load_checkpoint(draft)}
  return checkpoints.save_t5x_legacy_checkpoint(output_dir, params, step=step)


class _SpeculativeMethods:
  """What `SpeculativeEncoderDecoderModel` changes in T5X's `EncoderDecoderModel` (its mixin,
  first in the method order, so `super()` reaches T5X's class; defined without T5X)."""

  def __init__(self, module, draft_module, input_vocabulary, output_vocabulary,
               optimizer_def=None, decode_fn: Callable = decoding.speculative_sample,
               decode_kwargs: Optional[Mapping[str, Any]] = None,
               default_decoder_params: Optional[Any] = None,
               gamma_schedule: Optional[Mapping[int, Any]] = None, **kwargs):
    self.gamma_schedule = costs.parse_schedule(gamma_schedule or {})
    # Kept here as well as by T5X's constructor, which stores it privately.
    self._spec_default_decoder_params = (default_decoder_params or
                                         self._decoder_params_type())
    super().__init__(module=module, input_vocabulary=input_vocabulary,
                     output_vocabulary=output_vocabulary, optimizer_def=optimizer_def,
                     decode_fn=decode_fn,
                     default_decoder_params=self._spec_default_decoder_params, **kwargs)
    self.draft_module = draft_module
    self._pair = models.EncoderDecoderModel(
        module.config, draft_module.config, decode_fn=decode_fn, decode_kwargs=decode_kwargs,
        input_vocabulary=input_vocabulary, output_vocabulary=output_vocabulary)
    self._tree_pairs = self._scheduled_trees(decode_fn, decode_kwargs or {})

  def _scheduled_trees(self, decode_fn: Callable, decode_kwargs: Mapping[str, Any]
                       ) -> Dict[Tuple[int, ...], models.EncoderDecoderModel]:
    """{branching: the pair decoding with trees.tree_speculative_sample} for the schedule's
    trees, sampling as decode_fn does (its gin-bound and explicit temperature, topk, topp): a
    tree keeps speculative_sample's distribution, so only an exact speculative_sample may be
    replaced by one."""
    tree_choices = {c for c in self.gamma_schedule.values() if isinstance(c, tuple)}
    if not tree_choices or not self._has_gamma():
      return {}
    arguments = {**gin_utils.bound_arguments(decode_fn), **decode_kwargs}
    name = getattr(getattr(decode_fn, 'func', decode_fn), '__name__', decode_fn)
    if (name != decoding.speculative_sample.__name__ or arguments.get('lenience', 1.0) != 1.0
        or arguments.get('rule') is not None):
      raise ValueError(f'gamma_schedule holds token trees {sorted(tree_choices)}: they need '
                       f'decode_fn speculative_sample, exact (lenience 1, no rule); got {name} '
                       f'with {arguments}.')
    sampling = {k: arguments[k] for k in decoding.SAMPLING_ARGUMENTS if k in arguments}
    return {tree: self._pair.with_decoder(trees.tree_speculative_sample,
                                          {**sampling, 'branching': tree})
            for tree in tree_choices}

  def _has_gamma(self) -> bool:
    return 'gamma' in inspect.signature(self._pair.decode_fn).parameters

  def get_initial_variables(self, rng, input_shapes, input_types=None):
    # T5X's version passes keyword arguments (positions, decode=...) that this network's
    # __call__ does not take; the pair model initialises both networks.
    del input_types
    return flax.core.freeze(self._pair.get_initial_variables(rng, input_shapes))

  def _compute_logits(self, params, batch, dropout_rng=None, mutable=False,
                      other_variables=None):
    """Target logits [batch, dec_length, vocab]; with `mutable`, (logits, mutated variables).

    T5X's `score_batch(return_intermediates=True)` calls this with
    mutable=['intermediates'] and reads the sown values from the second element.
    """
    rngs = {'dropout': dropout_rng} if dropout_rng is not None else None
    return self.module.apply(
        {'params': params['target'], **(other_variables or {})},
        batch['encoder_input_tokens'], batch['decoder_input_tokens'],
        batch['decoder_target_tokens'],
        encoder_segment_ids=batch.get('encoder_segment_ids'),
        decoder_segment_ids=batch.get('decoder_segment_ids'),
        enable_dropout=rngs is not None, rngs=rngs, mutable=mutable)

  def predict_batch_with_aux(self, params, batch, rng=None, decoder_params=None,
                             return_all_decodes: Optional[bool] = None,
                             num_decodes: Optional[int] = None,
                             prompt_with_targets: bool = False) -> Tuple[Any, Mapping]:
    """T5X's contract: decodes [batch, length] (or [batch, num_decodes, length], sorted best
    last, with return_all_decodes) and aux {'scores', 'stats'}.

    return_all_decodes / num_decodes default to `default_decoder_params`'s. The decode RNG
    comes from `rng` or `decoder_params['decode_rng']`, not both (as T5X).
    """
    defaults = self._spec_default_decoder_params
    if return_all_decodes is None:
      return_all_decodes = defaults.return_all_decodes
    if num_decodes is None:
      num_decodes = defaults.num_decodes
    decoder_params = dict(decoder_params or {})
    if decoder_params.get('decode_rng') is not None:
      if rng is not None:
        raise ValueError('Got a decode RNG both as `rng` and as '
                         "`decoder_params['decode_rng']`; give one.")
      rng = decoder_params['decode_rng']
    # The pair model sets decode_rng itself (from `rng`); a second one would clash.
    decoder_params.pop('decode_rng', None)
    pair, choice = self._pair, self.scheduled_choice(batch['encoder_input_tokens'].shape[0])
    if choice is not None and 'gamma' not in decoder_params:  # an explicit gamma overrides it
      if isinstance(choice, tuple):
        pair = self._tree_pairs[choice]
      else:
        decoder_params['gamma'] = choice
    return pair.predict_batch_with_aux(
        params, batch, rng, decoder_params=decoder_params,
        return_all_decodes=bool(return_all_decodes), num_decodes=int(num_decodes),
        prompt_with_targets=prompt_with_targets)

  def scheduled_choice(self, batch_size: int) -> Optional[costs.Choice]:
    """The calibrated gamma or token tree for `batch_size` (`gamma_schedule`, written by
    speculative-t5x-calibrate; T5X traces predict_batch at a static batch size, so the choice is
    made once per compiled program), None without a schedule or for a decoder without gamma.
    Gamma 0 is a schedule's "the target alone": speculative_sample at gamma 0 decodes with the
    target only; a tree, trees.tree_speculative_sample with that branching."""
    if not self.gamma_schedule or not self._has_gamma():
      return None
    return costs.scheduled(self.gamma_schedule, batch_size)


def is_draft_parameter(path: str, value: Any = None) -> bool:
  """A `flax.traverse_util.ModelParamTraversal` filter: the draft's parameters only, so that
  T5X's optimizer (`optimizers.MultiOptimizer` over this traversal) never updates the teacher."""
  del value
  return path.startswith('/draft/')


class _DistillationMethods(_SpeculativeMethods):
  """What `DistillationEncoderDecoderModel` changes in the speculative model: its `loss_fn` is
  this project's `evaluation.Objective` for the draft (token distillation), the target the
  frozen teacher, and the encoder a decoder-only draft reads."""

  def __init__(self, module, draft_module, input_vocabulary, output_vocabulary,
               optimizer_def=None, kd_divergence: str = 'forward_kl', kd_weight: float = 1.0,
               kd_temperature: float = 1.0, z_loss: float = 1e-4, label_smoothing: float = 0.0,
               feature_passes: int = 1, **kwargs):
    super().__init__(module, draft_module, input_vocabulary, output_vocabulary,
                     optimizer_def=optimizer_def, **kwargs)
    if kd_divergence not in evaluation.DIVERGENCES:
      raise ValueError(f'kd_divergence must be one of {evaluation.DIVERGENCES}, not '
                       f'{kd_divergence!r}.')
    draft = draft_module.config
    self.objective = evaluation.Objective(
        draft, z_loss, label_smoothing, 'token', module.config, kd_weight, kd_temperature,
        kd_divergence, None if draft.has_encoder else module.config, feature_passes)

  def loss_fn(self, params, batch, dropout_rng):
    """T5X's contract: (loss, {name: clu metric}); the loss per target token, as this project's
    trainer's. The teacher is params['target'], under stop_gradient."""
    teacher = params['target']
    loss, sums = self.objective.loss(params['draft'], batch, dropout_rng, teacher, teacher)
    return loss, _t5x_metrics(loss, sums)


def _t5x_metrics(loss, sums: Dict[str, Any]) -> Dict[str, Any]:
  """The step's loss and each of `Objective.loss`'s sums per target token, as T5X's metrics."""
  from clu import metrics as clu_metrics  # pylint: disable=g-import-not-at-top
  from t5x import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  tokens = sums['tokens']
  metrics = {name: clu_metrics.Average(total=value, count=tokens)
             for name, value in sums.items() if name != 'tokens'}
  return {**metrics, 'loss': metrics_lib.AveragePerStep(total=loss)}


def _build_class() -> type:
  from t5x import models as t5x_models  # pylint: disable=g-import-not-at-top

  class SpeculativeEncoderDecoderModel(_SpeculativeMethods, t5x_models.EncoderDecoderModel):
    """T5X model over a target `network.Transformer` and a draft one (params target/draft).

    module / draft_module: the two `network.Transformer`s (same vocabulary and EOS).
    decode_fn: a decoder of `speculative_t5x.decoding` (speculative_sample, bild_decode; the
      one-model temperature_sample also works, on the target) or
      `trees.tree_speculative_sample`; `decode_kwargs` are passed to
      it, and `decoder_params` of `predict_batch_with_aux` override them.
    default_decoder_params: as T5X's: `return_all_decodes` / `num_decodes` used when
      `predict_batch_with_aux` is not given them.
    gamma_schedule: {batch size: gamma or token tree} (speculative-t5x-calibrate's
      t5x_schedule.gin): a predict_batch call decodes with its batch size's entry (the nearest
      calibrated size's); a tree, e.g. (2, 1, 1, 1), with trees.tree_speculative_sample at
      decode_fn's temperature, topk and topp.
    """
    _decoder_params_type = t5x_models.DecoderParams

  class DistillationEncoderDecoderModel(_DistillationMethods, t5x_models.EncoderDecoderModel):
    """T5X model that trains a draft for its target in `python -m t5x.train`.

    Parameters {'target', 'draft'} as SpeculativeEncoderDecoderModel's (it decodes as that one
    does). Its loss is token distillation of the draft from the frozen target:
    `(1 - kd_weight) * CE + kd_weight * D(target, draft)`, D `kd_divergence` ('forward_kl',
    'reverse_kl', 'jsd', 'tv') at `kd_temperature`, over the task's targets; a feature draft
    trains over `feature_passes`. The optimizer must update the draft only: T5X's
    `optimizers.MultiOptimizer` over `ModelParamTraversal(is_draft_parameter)`
    (gin_configs/t5x/multi30k_distill.gin).
    """
    _decoder_params_type = t5x_models.DecoderParams

  SpeculativeEncoderDecoderModel.__qualname__ = 'SpeculativeEncoderDecoderModel'
  DistillationEncoderDecoderModel.__qualname__ = 'DistillationEncoderDecoderModel'
  return SpeculativeEncoderDecoderModel, DistillationEncoderDecoderModel


if T5X_AVAILABLE:
  SpeculativeEncoderDecoderModel, DistillationEncoderDecoderModel = _build_class()


def main(argv: Optional[Sequence[str]] = None) -> None:
  """`python -m speculative_t5x.t5x_adapter --output_dir=DIR`: see `write_pair_checkpoint`."""
  parser = argparse.ArgumentParser(
      description='Write one T5X checkpoint holding a target and a draft model (target/, '
                  'draft/), for SpeculativeEncoderDecoderModel in `python -m t5x.infer`.')
  parser.add_argument('--output_dir', required=True,
                      help='Where checkpoint_<step>/ is written (must not exist yet).')
  parser.add_argument('--target', default=str(EMBEDDED_TARGET),
                      help='Target weights (default: the embedded Multi30k target).')
  parser.add_argument('--draft', default=str(EMBEDDED_DRAFT),
                      help='Draft weights (default: the embedded Multi30k draft).')
  parser.add_argument('--step', type=int, default=0)
  args = parser.parse_args(argv)
  print(write_pair_checkpoint(args.output_dir, args.target, args.draft, args.step))


if __name__ == '__main__':
  main()
