"""Benchmarks the embedded Multi30k pair: target-only, speculative, BiLD and HF assisted generation.

  python scripts/benchmark.py                       # the full grid (about an hour on 2 CPU cores)
  python scripts/benchmark.py --quick               # a few configurations, a few sentences
  python scripts/benchmark.py --out_dir results/cpu --sentences 1:100,8:200,32:320
  python scripts/benchmark.py --gammas 1,2,auto --sampling_gammas '' --bild '' --beams 4:8,4:2

Everything runs in one process on test_2016_flickr (German -> English), from `--data_dir`
(default: $SPECULATIVE_T5X_DATA or ../shared/data). For every batch size the same sentences, in
file order, go through target-only decoding (the baseline), speculative decoding with
gamma = 1..8, gamma='auto' (calibrated as the infer job does it; the calibration is reported
apart) and adaptive gamma at temperature 0 and 1, BiLD over a grid of (fallback, rollback)
thresholds, and with --beams beam_search against speculative beam search for each
beam:branching pair; at batch 1 also Hugging Face transformers' assisted generation on the same
weights converted to T5ForConditionalGeneration (needs `pip install -e '.[hf]'`).

Per configuration (see README "Benchmark" for the definitions): median wall time per sentence
over `--repeats` passes (compilation excluded, reported as compile_s), speedup over the baseline
of the same batch size and temperature, BLEU, alpha, accepted draft tokens and emitted tokens per
target call, c = draft step / target step, the paper's predicted speedup
(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)), efficiency = measured / predicted, a step-cost
prediction that charges the verify call its measured (gamma+1)-token cost, draft-step and
verify-step times, and the extra arithmetic per token of Theorem 3.11,
(1 - alpha)(gamma c_hat + gamma + 1) / (1 - alpha^(gamma+1)), with c_hat the FLOPs ratio.
Beam rows: beam steps and tree nodes per target call, and a step-cost prediction from the
one-token beam step, the tree's verify call and its draft levels.

Writes <out_dir>/benchmark.json (rewritten after every configuration, so a killed run keeps what
it measured), benchmark.md (the tables) and, with matplotlib, speedup_vs_gamma.png and
acceptance_by_position.png.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from speculative_t5x import autogamma
from speculative_t5x import beam_search
from speculative_t5x import data
from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import train

PRETRAINED = Path(__file__).resolve().parents[1] / 'speculative_t5x' / 'pretrained'
INPUT_LENGTH = 64
INPUT_LENGTH_STEP = 16  # encoder width: each batch's longest input rounded up to this
OUTPUT_LENGTH = 64
BILD_FALLBACKS = (0.4, 0.6, 0.8)
BILD_ROLLBACKS = (2.0, 3.0, 5.0)
BILD_MAX_SMALL_STEPS = 10  # bild_decode's default, the paper's
BEAM_ALPHA = 0.6  # T5X's brevity penalty default


class Setting(NamedTuple):
  """One decoding configuration of the grid."""
  method: str      # 'baseline', 'speculative', 'bild', 'beam' or 'speculative_beam'
  temperature: float = 0.0
  gamma: Union[int, str] = 0     # speculative: (maximum) draft tokens per target call, or 'auto'
  adaptive: bool = False
  fallback: float = 0.0          # bild
  rollback: float = 0.0          # bild
  beam: int = 0                  # beam and speculative_beam: the beam size (num_decodes)
  branching: str = ''            # speculative_beam: the token tree's children per depth, '4,2'

  @property
  def name(self) -> str:
    if self.method == 'baseline':
      return f'target-only T={self.temperature:g}'
    if self.method == 'bild':
      return f'BiLD fb={self.fallback:g} rb={self.rollback:g}'
    if self.method == 'beam':
      return f'beam_search beam={self.beam}'
    if self.method == 'speculative_beam':
      return f'speculative beam={self.beam} tree={self.branching}'
    gamma = f'adaptive<={self.gamma}' if self.adaptive else f'gamma={self.gamma}'
    return f'speculative {gamma} T={self.temperature:g}'

  @property
  def baseline(self) -> 'Setting':
    """What this setting's speedup is measured against (the same search on the target alone)."""
    if self.method in ('beam', 'speculative_beam'):
      return Setting('beam', beam=self.beam)
    return Setting('baseline', self.temperature if self.method != 'bild' else 0.0)

  @property
  def tree(self) -> Tuple[int, ...]:
    return tuple(int(b) for b in self.branching.split(',') if b)

  def decoder(self):
    """(decode_fn, decode_kwargs) for models.EncoderDecoderModel."""
    if self.method == 'beam':
      return beam_search.beam_search, {'alpha': BEAM_ALPHA}
    if self.method == 'speculative_beam':
      return beam_search.speculative_beam_search, {'alpha': BEAM_ALPHA, 'branching': self.tree}
    if self.method == 'baseline':
      # topk=0: T5X's temperature_sample defaults to top-1, i.e. greedy even at temperature 1.
      return decoding.temperature_sample, {'temperature': self.temperature, 'topk': 0}
    if self.method == 'bild':
      return decoding.bild_decode, {'fallback_threshold': self.fallback,
                                    'rollback_threshold': self.rollback, 'temperature': 0.0}
    return decoding.speculative_sample, {'temperature': self.temperature, 'gamma': self.gamma,
                                         'adaptive_gamma': self.adaptive}


def grid(quick: bool, gammas: Sequence[int] = range(1, 9),
         sampling_gammas: Sequence[int] = range(1, 9),
         bild: Sequence[Tuple[float, float]] = tuple(
             (f, r) for f in BILD_FALLBACKS for r in BILD_ROLLBACKS),
         adaptive: bool = True, beams: Sequence[Tuple[int, str]] = ()) -> List[Setting]:
  """The configurations: baselines, speculative gammas at T=0 and T=1, BiLD (fallback,
  rollback), and beam_search against speculative beam search for each (beam, branching)."""
  if quick:
    return [Setting('baseline'), Setting('speculative', gamma=4),
            Setting('speculative', gamma=8, adaptive=True), Setting('bild', fallback=0.6,
                                                                    rollback=5.0)]
  settings = []
  for temperature, temperature_gammas in ((0.0, gammas), (1.0, sampling_gammas)):
    if not temperature_gammas:
      continue
    settings.append(Setting('baseline', temperature))
    settings += [Setting('speculative', temperature, gamma) for gamma in temperature_gammas]
    if adaptive:
      settings.append(Setting('speculative', temperature,
                              max(g for g in temperature_gammas if g != autogamma.AUTO),
                              adaptive=True))
  settings += [Setting('bild', fallback=f, rollback=r) for f, r in bild]
  for beam in sorted({b for b, _ in beams}):
    settings.append(Setting('beam', beam=beam))
    settings += [Setting('speculative_beam', beam=beam, branching=t) for b, t in beams if b == beam]
  return settings


# ------------------------------------------------------------------------------------------------
# Measuring.


def median_seconds(fn, repeats: int) -> float:
  """Median wall time of fn() (blocking on its result) after one warm-up call."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def step_times_ms(config: network.T5Config, params, batch: int, chunk_sizes: Sequence[int],
                  position: int = 8, repeats: int = 7, steps_per_call: int = 16
                  ) -> Dict[int, float]:
  """Median ms of one cached decode step appending k tokens per row, for k in chunk_sizes.

  The cache holds `position` tokens of a 20-token input; the step runs with the decode
  variables. Steps are timed as the decode loops run them: `steps_per_call` of them in one
  jitted `fori_loop` carrying the cache (each step's index stays at `position`, and depends on its
  logits so that nothing is dead code). A step jitted alone would add a dispatch (~0.3-1 ms
  here) that the loops do not pay and hide how the step grows with k. The sizes take turns in
  each of `repeats` rounds, so that slow phases of the machine hit all of them alike.
  """
  module = network.Transformer(config)
  variables = {'params': params,
               network.DECODE_COLLECTION: network.decode_variables(config, params)}
  encoder_tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, 20), 3, config.vocab_size)
  encoded = module.apply({'params': params}, encoder_tokens, method=network.Transformer.encode)
  cache = module.apply({'params': params}, encoded, encoder_tokens, OUTPUT_LENGTH,
                       method=network.Transformer.init_cache)
  cache = cache.with_index(jnp.full((batch,), position, jnp.int32))

  def steps(variables, cache, k):
    def body(_, cache):
      logits, new_cache = module.apply(variables, jnp.full((batch, k), 5, jnp.int32), cache,
                                       method=network.Transformer.decode_step)
      return new_cache.with_index(cache.index + (jnp.argmax(logits[:, -1], axis=-1) < 0))
    return jax.lax.fori_loop(0, steps_per_call, body, cache).index

  loops = {k: jax.jit(functools.partial(steps, k=k)) for k in chunk_sizes}
  times = round_robin({k: (lambda f=f: f(variables, cache)) for k, f in loops.items()},
                      repeats + 1)  # the first round compiles and warms up
  return {k: 1e3 * float(np.median(t[1:])) / steps_per_call for k, t in times.items()}


def step_weight_bytes(config: network.T5Config, params) -> int:
  """Bytes of parameters one cached decoder step reads: the decoder without its cross-attention
  key/value kernels (applied once, to the encoder output), plus the embedding table (the token
  lookup and, tied, the logits)."""
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params['decoder'])[0]:
    names = [getattr(k, 'key', '') for k in path]
    if 'encoder_decoder_attention' in names and ('key' in names or 'value' in names):
      continue
    total += leaf.size * leaf.dtype.itemsize
  embedding = params['token_embedder']['embedding']
  return total + embedding.size * embedding.dtype.itemsize


def memory_bandwidth_gbs(megabytes: int = 64, repeats: int = 30) -> float:
  """GB/s of a jitted sum over a fresh `megabytes` array (streams it once; best of repeats)."""
  x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  jax.block_until_ready(total(x))
  best = min(timed(lambda: total(x)) for _ in range(repeats))
  return x.size * 4 / best / 1e9


def matmul_gflops(size: int = 1024, repeats: int = 10) -> float:
  """GFLOP/s of a jitted fp32 [size, size] x [size, size] matmul (best of repeats): the machine's
  practical arithmetic peak, for the compute floor of a step."""
  x = jnp.ones((size, size), jnp.float32)
  product = jax.jit(jnp.matmul)
  jax.block_until_ready(product(x, x))
  best = min(timed(lambda: product(x, x)) for _ in range(repeats))
  return 2 * size ** 3 / best / 1e9


def timed(fn) -> float:
  """Seconds of one fn() call, blocking on its result."""
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def load_pair(target: Union[str, Path] = PRETRAINED / 'multi30k_de_en_target.msgpack',
              draft: Union[str, Path] = PRETRAINED / 'multi30k_de_en_draft.msgpack'
              ) -> Tuple[Dict[str, network.T5Config], Dict[str, Any], Dict[str, Any]]:
  """(configs, params, prepared) of a target/draft pair, each keyed 'target' and 'draft'
  (default: the embedded pair). `prepared` adds the decode-time weight layouts once, as a
  loaded checkpoint would be prepared (`with_decode_variables`)."""
  configs, params = {}, {}
  for name, path in (('target', target), ('draft', draft)):
    configs[name], params[name], _ = train.load_weights(path)
  prepared = jax.jit(models.EncoderDecoderModel(
      configs['target'], configs['draft']).with_decode_variables)(params)
  return configs, params, prepared


def make_batches(token_rows: Sequence[Sequence[int]], batch_size: int,
                 length_step: int = INPUT_LENGTH_STEP) -> List[Dict[str, Any]]:
  """[batch_size, width] batches, the last padded with all-zero rows. width is each batch's
  longest input rounded up to length_step (at most INPUT_LENGTH), or INPUT_LENGTH for step 0."""
  return [{k: jnp.asarray(v) for k, v in data.pad_batch(
      token_rows[start:start + batch_size], None, INPUT_LENGTH, OUTPUT_LENGTH, batch_size,
      length_step).items()} for start in range(0, len(token_rows), batch_size)]


def compile_per_width(jitted, params, batches: Sequence[Dict[str, Any]], *args) -> Callable:
  """`jitted` compiled ahead once per encoder width among `batches`: returns
  predict(params, batch, *args), which runs the executable compiled for the batch's width."""
  width = lambda batch: batch['encoder_input_tokens'].shape[1]
  compiled = {}
  for batch in batches:
    if width(batch) not in compiled:
      compiled[width(batch)] = jitted.lower(params, batch, *args).compile()
  return lambda p, batch, *a: compiled[width(batch)](p, batch, *a)


def compile_setting(setting: Setting, configs, params, batches, seed: int = 0,
                    decoder_params: Optional[Dict[str, Any]] = None
                    ) -> Tuple[Callable[[], List[Any]], float, Dict[str, Any]]:
  """(one_pass, compile seconds, info): one_pass() decodes every batch once with `setting`
  (decoder_params: extra decode_fn arguments, as predict_batch_with_aux takes them).

  gamma='auto' compiles gamma 0..autogamma.MAX_GAMMA, calibrates on the first batches (seconds
  in info['calibration_s'], not in compile seconds) and then chooses per batch, as the infer
  job does; info['gammas_used'] counts the choices of every pass.
  """
  decode_fn, kwargs = setting.decoder()
  model = models.EncoderDecoderModel(configs['target'], configs['draft'], decode_fn=decode_fn,
                                     decode_kwargs=kwargs, eos_id=data.EOS_ID)
  rngs = [jax.random.fold_in(jax.random.PRNGKey(seed), i) for i in range(len(batches))]
  auto = autogamma.wants_auto(model, kwargs)
  candidates = autogamma.decoders(model, kwargs) if auto else {None: model}
  predict_kwargs = {'num_decodes': setting.beam} if setting.beam else {}
  if decoder_params:
    predict_kwargs['decoder_params'] = decoder_params
  start = time.perf_counter()
  predicts = {g: compile_per_width(jax.jit(functools.partial(
      m.predict_batch_with_aux, **predict_kwargs)), params, batches, rngs[0])
              for g, m in candidates.items()}
  compile_s = time.perf_counter() - start
  if not auto:
    predict = predicts[None]
    return (lambda: [predict(params, b, r) for b, r in zip(batches, rngs)]), compile_s, {}
  start = time.perf_counter()
  count = autogamma.calibration_batches(batches[0]['encoder_input_tokens'].shape[0], len(batches))
  tuner = autogamma.calibrate({g: (lambda b, p=p: p(params, b, rngs[0]))
                               for g, p in predicts.items()}, batches[:count])
  info = {'calibration_s': time.perf_counter() - start, 'calibration': tuner.summary(),
          'gammas_used': collections.Counter()}

  def one_pass():
    # Dispatched without waiting, as the fixed-gamma passes are (on 2 cores consecutive batches
    # overlap): each batch's gamma uses the running alpha up to the previous pass.
    gammas = [tuner.choose() for _ in batches]
    outputs = [predicts[g](params, b, r) for g, b, r in zip(gammas, batches, rngs)]
    passed = []
    for gamma, (decodes, aux) in zip(gammas, outputs):
      stats = {k: np.asarray(v) for k, v in aux['stats'].items()}
      tuner.observe(stats)
      info['gammas_used'][gamma] += 1
      # accepted_at is [batch, max(gamma, 1)]: pad to one width for the whole pass.
      at = stats['accepted_at']
      stats['accepted_at'] = np.pad(at, ((0, 0), (0, autogamma.MAX_GAMMA - at.shape[1])))
      passed.append((decodes, {**aux, 'stats': stats}))
    return passed

  return one_pass, compile_s, info


def run_setting(setting: Setting, configs, params, batches, num_sentences: int,
                repeats: int, seed: int = 0) -> Dict[str, Any]:
  """Compiles and times one setting over all batches; returns its decodes, stats and times."""
  one_pass, compile_s, info = compile_setting(setting, configs, params, batches, seed)
  outputs = jax.block_until_ready(one_pass())  # warm-up, and the outputs
  passes = [timed(one_pass) for _ in range(repeats)]
  return {**collect(outputs, num_sentences), 'compile_s': compile_s,
          'ms_per_sentence': 1e3 * float(np.median(passes)) / num_sentences,
          'pass_seconds': passes, **info}


def collect(outputs: Sequence[Tuple[Any, Dict[str, Any]]], num_sentences: int
            ) -> Dict[str, Any]:
  """{'decodes': [num_sentences, length], 'stats': {field: [num_sentences, ...]}} from one pass's
  per-batch (decodes, aux) outputs, without the last batch's padding rows."""
  decodes = np.concatenate([np.asarray(d) for d, _ in outputs])[:num_sentences]
  stats = {}
  if 'stats' in outputs[0][1]:
    stats = {k: np.concatenate([np.asarray(a['stats'][k]) for _, a in outputs])[:num_sentences]
             for k in outputs[0][1]['stats']}
  return {'decodes': decodes, 'stats': stats}


def best_settings(rows: Sequence[Dict[str, Any]]) -> List[Setting]:
  """The baselines, the fastest greedy, sampling and BiLD configurations of a batch block, and
  gamma='auto' where it ran (to compare it with the best fixed gamma)."""
  chosen = []
  for method, temperature in (('speculative', 0.0), ('speculative', 1.0), ('bild', 0.0),
                              ('speculative_beam', 0.0)):
    candidates = [r for r in rows if r['method'] == method and r['temperature'] == temperature]
    if method != 'bild' and candidates:
      chosen.append(_setting(candidates[0]).baseline)
    fixed = [r for r in candidates if r['gamma'] != autogamma.AUTO]
    if fixed:
      best = max(fixed, key=lambda r: r['speedup'])
      chosen.append(_setting(best))
    chosen += [_setting(r) for r in candidates if r['gamma'] == autogamma.AUTO]
  return chosen


def _setting(row: Dict[str, Any]) -> Setting:
  """The Setting of a results row (rows of older runs lack the newer fields)."""
  return Setting(**{f: row[f] for f in Setting._fields if f in row})


def round_robin(passes: Dict[Any, Callable[[], Any]], repeats: int) -> Dict[Any, List[float]]:
  """Seconds of every pass in each of `repeats` rounds, the passes taking turns within a round,
  so that slow phases of a shared machine hit all of them alike (warm them up first)."""
  times = {key: [] for key in passes}
  for _ in range(repeats):
    for key, one_pass in passes.items():
      times[key].append(timed(one_pass))
  return times


def speedup_over_rounds(base_seconds: Sequence[float], seconds: Sequence[float]
                        ) -> Dict[str, float]:
  """Median, min and max over rounds of base/time, each round's pair timed in the same round."""
  ratios = np.array(base_seconds) / np.array(seconds)
  return {'speedup': float(np.median(ratios)), 'speedup_min': float(ratios.min()),
          'speedup_max': float(ratios.max())}


def interleaved(settings: Sequence[Setting], configs, params, batches, num_sentences: int,
                repeats: int) -> List[Dict[str, Any]]:
  """Re-times `settings` round-robin, `repeats` rounds: each speedup is the median over rounds
  of (its baseline's pass time / its pass time) in the same round."""
  compiled = {s: compile_setting(s, configs, params, batches) for s in settings}
  passes = {s: one_pass for s, (one_pass, _, _) in compiled.items()}
  for one_pass in passes.values():
    jax.block_until_ready(one_pass())
  times = round_robin(passes, repeats)
  rows = []
  for s in settings:
    rows.append({'name': s.name, 'ms_per_sentence': 1e3 * float(np.median(times[s])) /
                 num_sentences, **speedup_over_rounds(times[s.baseline], times[s])})
    info = compiled[s][2]
    if info:  # gamma='auto': its own calibration in this run, and the choices
      rows[-1].update(gammas_used={str(g): n for g, n in sorted(info['gammas_used'].items())},
                      calibration=info['calibration'])
  return rows


def predicted_speedup(alpha: float, gamma: float, c: float) -> float:
  """Leviathan et al.'s expected walltime improvement (Theorem 3.8, cost model of section 3.4)."""
  if alpha >= 1.0:
    return (gamma + 1) / (gamma * c + 1)
  return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def extra_arithmetic(alpha: float, gamma: float, c_hat: float) -> float:
  """Theorem 3.11: operations per generated token relative to the baseline."""
  if alpha >= 1.0:
    return (gamma * c_hat + gamma + 1) / (gamma + 1)
  return (1 - alpha) * (gamma * c_hat + gamma + 1) / (1 - alpha ** (gamma + 1))


def summarize(setting: Setting, run: Dict[str, Any], baseline: Dict[str, Any],
              steps: Dict[str, Dict[int, float]], c_hat: float,
              references: Sequence[str]) -> Dict[str, Any]:
  """The table row of one run (JSON-ready)."""
  texts = data.decode(run['decodes'])
  row = {'name': setting.name, **setting._asdict(),
         'ms_per_sentence': run['ms_per_sentence'], 'compile_s': run['compile_s'],
         'speedup': baseline['ms_per_sentence'] / run['ms_per_sentence'],
         'bleu': data.corpus_bleu(texts, references),
         'same_as_baseline': float(np.mean(np.all(run['decodes'] == baseline['decodes'], axis=1))),
         'target_step_ms': steps['target'][1]}
  s = run['stats']
  if setting.method == 'speculative_beam':
    return {**row, **beam_row(setting, s, steps)}
  if setting.method in ('baseline', 'beam') or not s:
    row['tokens_per_sentence'] = float(np.mean(np.sum(run['decodes'] > 0, axis=1) + 1))
    return row
  totals = {k: int(v.sum()) for k, v in s.items() if k != 'accepted_at'}
  calls = max(totals['target_calls'], 1)
  proposed, accepted = totals['proposed'], totals['accepted']
  # The paper's alpha is the acceptance probability of a draft position that is reached (one
  # after a rejection is not): every reached position ends in an acceptance or in a rejection,
  # and a call has at most one rejection (counted in `rollbacks`).
  alpha = accepted / max(accepted + totals['rollbacks'], 1)
  row.update(totals=totals, alpha=alpha, accepted_fraction=accepted / max(proposed, 1),
             accepted_per_call=accepted / calls,
             tokens_per_call=totals['emitted'] / calls,
             draft_calls_per_target_call=totals['draft_calls'] / calls,
             tokens_per_sentence=float(np.mean(s['emitted'])),
             fallbacks=totals['fallbacks'], rollbacks=totals['rollbacks'],
             # P(the first i+1 proposals of a target call were all accepted), i = 0..gamma-1.
             accepted_at=(s['accepted_at'].sum(axis=0) / calls).tolist())
  gamma = setting.gamma
  if gamma == autogamma.AUTO:
    # Predictions for the gamma chosen most often.
    gamma = run['gammas_used'].most_common(1)[0][0]
    row.update(gammas_used={str(g): n for g, n in sorted(run['gammas_used'].items())},
               calibration_s=run['calibration_s'], calibration=run['calibration'])
    if gamma == 0:
      return row
  # The verify chunk is always (static gamma) + 1 tokens wide; BiLD's gamma is max_small_steps.
  verify_k = (gamma if setting.method == 'speculative' else BILD_MAX_SMALL_STEPS) + 1
  c = steps['draft'][1] / steps['target'][1]
  row.update(c=c, c_hat=c_hat, draft_step_ms=steps['draft'][1],
             verify_step_ms=steps['target'].get(verify_k))
  if setting.method == 'speculative':
    mean_gamma = proposed / calls if setting.adaptive else gamma
    prediction = predicted_speedup(alpha, mean_gamma, c)
    row.update(gamma_mean=mean_gamma, predicted_speedup=prediction,
               efficiency=row['speedup'] / prediction,
               extra_arithmetic=extra_arithmetic(alpha, mean_gamma, c_hat))
    if not setting.adaptive:
      # The same expected tokens per call, but the verify call costs its measured k-token time.
      # Each draft phase's first call feeds 2 tokens (see decoding._draft_phase).
      tokens = row['tokens_per_call']
      draft_calls = row['draft_calls_per_target_call']
      cost = (steps['draft'][2] + (draft_calls - 1) * steps['draft'][1] +
              steps['target'][verify_k])
      row['step_cost_prediction'] = tokens * steps['target'][1] / cost
  return row


def tree_levels(branching: Sequence[int]) -> List[int]:
  """Nodes per depth of one beam's token tree (root first): (4, 2) -> [1, 4, 8]."""
  levels = [1]
  for b in branching:
    levels.append(levels[-1] * b)
  return levels


def beam_steps_ms(configs, params, rows: int, branching: Sequence[int]
                  ) -> Dict[str, Dict[int, float]]:
  """Step times for speculative beam search's calls at `rows` = batch x beam decoder rows: the
  target with 1 token (a beam_search step) and with the whole tree, the draft per tree level."""
  levels = tree_levels(branching)
  return {'target': step_times_ms(configs['target'], params['target'], rows, (1, sum(levels))),
          'draft': step_times_ms(configs['draft'], params['draft'], rows,
                                 sorted(set(levels[:-1])))}


def beam_row(setting: Setting, stats: Dict[str, np.ndarray],
             steps: Dict[str, Dict[int, float]]) -> Dict[str, Any]:
  """Speculative beam search's columns: beam steps and tree nodes per target call, and the
  step-cost prediction (steps per call x a beam_search step / (draft levels + tree verify)).

  stats are per example: `emitted` counts beam steps, `proposed` tree nodes below the roots.
  """
  levels = tree_levels(setting.tree)
  calls = max(int(stats['target_calls'].sum()), 1)
  steps_per_call = int(stats['emitted'].sum()) / calls
  cost = sum(steps['draft'][n] for n in levels[:-1]) + steps['target'][sum(levels)]
  return {'steps_per_call': steps_per_call, 'tokens_per_call': steps_per_call,
          'nodes_per_call': int(stats['proposed'].sum()) / calls + 1,
          'target_calls': calls, 'beam_step_ms': steps['target'][1],
          'verify_step_ms': steps['target'][sum(levels)],
          'draft_step_ms': sum(steps['draft'][n] for n in levels[:-1]),
          'step_cost_prediction': steps_per_call * steps['target'][1] / cost}


# ------------------------------------------------------------------------------------------------
# Hugging Face assisted generation (PyTorch, batch 1).


def hf_rows(configs, params, sentences: Sequence[str], references: Sequence[str],
            our_greedy: np.ndarray, baseline_ms: float, repeats: int,
            gammas: Sequence[int]) -> List[Dict[str, Any]]:
  """Times HF greedy generation with and without `assistant_model`, one sentence at a time."""
  import torch  # pylint: disable=g-import-not-at-top
  from transformers import cache_utils  # pylint: disable=g-import-not-at-top
  from speculative_t5x import hf  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(os.cpu_count() or 1)
  target = hf.to_hf_model(configs['target'], params['target'])
  draft = hf.to_hf_model(configs['draft'], params['draft'])
  inputs = [torch.tensor([ids]) for ids in data.encode(sentences, INPUT_LENGTH)]

  def generate(assistant=None):
    outs = []
    with torch.inference_mode():
      for ids in inputs:
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              num_beams=1, max_new_tokens=OUTPUT_LENGTH,
                              assistant_model=assistant,
                              # A lazily grown cache: the one generate() builds has one layer
                              # per *encoder* layer, too few for this deeper decoder.
                              cache=cache_utils.EncoderDecoderCache(cache_utils.DynamicCache(),
                                                                    cache_utils.DynamicCache()))
        outs.append(out[0, 1:].numpy())
    return outs

  rows = []
  for name, assistant, schedule, tokens in (
      [('HF greedy (no assistant)', None, None, None),
       ('HF assisted, default schedule', draft, 'heuristic', 20)] +
      [(f'HF assisted, constant gamma={g}', draft, 'constant', g) for g in gammas]):
    if assistant is not None:
      assistant.generation_config.num_assistant_tokens_schedule = schedule
      assistant.generation_config.num_assistant_tokens = tokens
    outs = generate(assistant)  # warm-up, and the outputs
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      generate(assistant)
      times.append(time.perf_counter() - start)
    decodes = np.zeros((len(outs), OUTPUT_LENGTH), np.int32)
    for i, out in enumerate(outs):
      decodes[i, :min(len(out), OUTPUT_LENGTH)] = out[:OUTPUT_LENGTH]
    ms = 1e3 * float(np.median(times)) / len(sentences)
    rows.append({'name': name, 'method': 'hf', 'batch_size': 1, 'ms_per_sentence': ms,
                 'speedup': baseline_ms / ms,
                 'bleu': data.corpus_bleu(data.decode(decodes), references),
                 'same_as_baseline': float(np.mean(np.all(decodes == our_greedy, axis=1)))})
  return rows


# ------------------------------------------------------------------------------------------------
# Reporting.


def fmt(value, spec: str) -> str:
  """value formatted with spec, or '' for a missing value (a table cell)."""
  return '' if value is None else format(value, spec)


def markdown(results: Dict[str, Any]) -> str:
  """The results as Markdown tables, one per batch size, then HF's."""
  lines = [f"# Benchmark: {results['meta']['description']}", '',
           f"Command: `{results['meta']['command']}`", '',
           f"Machine: {results['meta']['machine']}", '']
  header = ('| configuration | ms/sentence | speedup | BLEU | same as greedy | alpha | '
            'accepted/call | tokens/call | c | predicted | efficiency | step-cost pred. | '
            'extra arith. | draft step ms | verify step ms | compile s |')
  for batch_size, block in results['batches'].items():
    lines += [f"## Batch {batch_size} ({block['num_sentences']} sentences, "
              f"target 1-token step {block['step_ms']['target']['1']:.2f} ms, draft "
              f"{block['step_ms']['draft']['1']:.2f} ms)", '']
    target_steps = block['step_ms']['target']
    one = target_steps['1']
    floor = results['meta'].get('weight_streaming_floor_ms', {}).get('target')
    peak = results['meta'].get('matmul_gflops')
    # The arithmetic of a k-token step: 2 flops per multiply-add, batch * k rows.
    compute_ms = {k: 2e3 * results['meta']['target_flops_per_token'] * int(batch_size) * int(k) /
                  (peak * 1e9) for k in target_steps} if peak else {}
    lines += ['Cached target step by tokens per row (ms, and / the 1-token step): ' + ', '.join(
        f'k={k}: {v:.2f} ({v / one:.2f}x)' for k, v in target_steps.items()) + '.' + (
            f" Weight-streaming floor {floor:.2f} ms at "
            f"{results['meta']['memory_bandwidth_gbs']:.1f} GB/s: the 1-token step is "
            f"{one / floor:.1f}x above it." if floor else '') + (
            f" Compute floor at {peak:.0f} GFLOP/s (a 1024x1024 matmul): " + ', '.join(
                f'k={k}: {compute_ms[k]:.2f} ms' for k in ('1', '2', '5') if k in compute_ms) +
            '.' if compute_ms else ''), '', header,
              '|' + '---|' * (header.count('|') - 1)]
    for r in block['rows']:
      lines.append('| ' + ' | '.join([
          r['name'], fmt(r['ms_per_sentence'], '.1f'), fmt(r['speedup'], '.2f') + 'x',
          fmt(r['bleu'], '.2f'),
          fmt(r['same_as_baseline'], '.0%') if r['temperature'] == 0 else '',
          fmt(r.get('alpha'), '.3f'), fmt(r.get('accepted_per_call'), '.2f'),
          fmt(r.get('tokens_per_call'), '.2f'), fmt(r.get('c'), '.3f'),
          fmt(r.get('predicted_speedup'), '.2f'), fmt(r.get('efficiency'), '.2f'),
          fmt(r.get('step_cost_prediction'), '.2f'), fmt(r.get('extra_arithmetic'), '.2f'),
          fmt(r.get('draft_step_ms'), '.2f'), fmt(r.get('verify_step_ms'), '.2f'),
          fmt(r['compile_s'], '.1f')]) + ' |')
    lines.append('')
    beams = [r for r in block['rows'] if r['method'] == 'speculative_beam']
    if beams:
      lines += ['Speculative beam search against beam_search (batch x beam decoder rows; '
                '"beam step" is one beam_search target call, "verify" one call over the whole '
                'tree, "draft" the tree\'s draft levels):', '',
                '| configuration | speedup | same beams | beam steps/call | tree nodes/call | '
                'beam step ms | verify ms | draft ms | step-cost pred. |', '|---|---|---|---|---|'
                '---|---|---|---|']
      lines += [f"| {r['name']} | {r['speedup']:.2f}x | {r['same_as_baseline']:.0%} | "
                f"{r['steps_per_call']:.2f} | {r['nodes_per_call']:.1f} | "
                f"{r['beam_step_ms']:.2f} | {r['verify_step_ms']:.2f} | "
                f"{r['draft_step_ms']:.2f} | {r['step_cost_prediction']:.2f} |" for r in beams]
      lines.append('')
    if block.get('interleaved'):
      lines += [f"Interleaved re-timing (`{results['meta'].get('confirm_command', '--confirm')}`"
                '): median over rounds of the per-round ratio to the baseline.', '',
                '| configuration | ms/sentence | speedup | range over rounds |',
                '|---|---|---|---|']
      lines += [f"| {r['name']} | {r['ms_per_sentence']:.1f} | {r['speedup']:.2f}x | "
                f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f} |" for r in block['interleaved']]
      lines += [f"\n{r['name']}: batches per gamma {r['gammas_used']}; calibration "
                f"{r['calibration']}" for r in block['interleaved'] if 'gammas_used' in r]
      lines.append('')
  if results.get('hf'):
    lines += ['## Hugging Face transformers, PyTorch CPU, batch 1 (same sentences as batch 1)', '',
              '| configuration | ms/sentence | speedup vs our target-only | BLEU '
              '| same as our greedy |', '|---|---|---|---|---|']
    for r in results['hf']:
      lines.append(f"| {r['name']} | {r['ms_per_sentence']:.1f} | {r['speedup']:.2f}x | "
                   f"{r['bleu']:.2f} | {r['same_as_baseline']:.0%} |")
    lines.append('')
  return '\n'.join(lines)


def plots(results: Dict[str, Any], out_dir: Path) -> List[str]:
  """speedup_vs_gamma.png and acceptance_by_position.png; [] without matplotlib or without
  speculative rows with a fixed gamma (a beam-only run)."""
  if not any(r['method'] == 'speculative' and r['gamma'] != autogamma.AUTO
             for block in results['batches'].values() for r in block['rows']):
    return []
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    print('matplotlib is not installed: no plots (pip install matplotlib)', file=sys.stderr)
    return []
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for batch_size, block in results['batches'].items():
    for temperature, style in ((0.0, '-'), (1.0, ':')):
      rows = sorted((r for r in block['rows'] if r['method'] == 'speculative' and
                     not r['adaptive'] and r['temperature'] == temperature and
                     r['gamma'] != autogamma.AUTO),
                    key=lambda r: r['gamma'])
      if not rows:
        continue
      line, = ax.plot([r['gamma'] for r in rows], [r['speedup'] for r in rows], style + 'o',
                      label=f'batch {batch_size}, T={temperature:g}')
      if temperature == 0.0:
        ax.plot([r['gamma'] for r in rows], [r['predicted_speedup'] for r in rows], '--x',
                color=line.get_color(), alpha=0.5, label=f'batch {batch_size}, predicted')
  ax.axhline(1.0, color='gray', lw=0.8)
  ax.set(xlabel='gamma (draft tokens per target call)', ylabel='speedup over target-only',
         title='Speculative decoding on the embedded Multi30k pair')
  ax.legend(fontsize=7)
  fig.tight_layout()
  files = [str(out_dir / 'speedup_vs_gamma.png')]
  fig.savefig(files[-1], dpi=120)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for batch_size, block in results['batches'].items():
    fixed = [r for r in block['rows'] if r['method'] == 'speculative' and not r['adaptive'] and
             r['gamma'] != autogamma.AUTO]
    for temperature in sorted({r['temperature'] for r in fixed}):
      r = max((r for r in fixed if r['temperature'] == temperature), key=lambda r: r['gamma'])
      # accepted_at[i]: P(positions 0..i all accepted); the ratio conditions on reaching i.
      reached = np.array([1.0] + r['accepted_at'])
      conditional = reached[1:] / np.maximum(reached[:-1], 1e-9)
      ax.plot(range(1, len(conditional) + 1), conditional, 'o-',
              label=f"batch {batch_size}, T={temperature:g}, gamma={r['gamma']} "
                    f"(alpha {r['alpha']:.2f})")
  ax.set(xlabel='draft position i', ylim=(0, 1),
         ylabel='P(accept position i | positions < i accepted)',
         title='Acceptance by draft position')
  ax.legend(fontsize=7)
  fig.tight_layout()
  files.append(str(out_dir / 'acceptance_by_position.png'))
  fig.savefig(files[-1], dpi=120)
  plt.close(fig)
  return files


# ------------------------------------------------------------------------------------------------


def parse_sentences(spec: str) -> Dict[int, int]:
  """'1:80,8:160' -> {1: 80, 8: 160} (batch size: number of sentences); exits on bad input."""
  try:
    pairs = dict(item.split(':') for item in spec.split(','))
    return {int(b): int(n) for b, n in pairs.items()}
  except ValueError:
    raise SystemExit(f'error: --sentences wants batch:count pairs like 1:100,8:200, got {spec!r}')


def confirm(out_dir: Path, args: argparse.Namespace) -> None:
  """Adds `interleaved` re-timings of each batch block's best configurations to the results."""
  json_path = out_dir / 'benchmark.json'
  results = json.loads(json_path.read_text())
  configs, _, prepared = load_pair(args.target, args.draft)
  sources, _ = data.load_split('test', data_dir=args.data_dir)
  for batch_size, block in results['batches'].items():
    count = block['num_sentences']
    batches = make_batches(data.encode(sources[:count], INPUT_LENGTH), int(batch_size),
                           results['meta'].get('input_length_step', 0))
    block['interleaved'] = interleaved(best_settings(block['rows']), configs, prepared, batches,
                                       count, args.repeats)
    for r in block['interleaved']:
      print(f"batch {batch_size} {r['name']}: {r['ms_per_sentence']:.1f} ms/sentence, "
            f"{r['speedup']:.2f}x (rounds {r['speedup_min']:.2f}-{r['speedup_max']:.2f})",
            flush=True)
    json_path.write_text(json.dumps(results, indent=1))
  results['meta']['confirm_command'] = ('python scripts/benchmark.py --confirm --out_dir '
                                        f'{args.out_dir} --repeats {args.repeats}')
  json_path.write_text(json.dumps(results, indent=1))
  (out_dir / 'benchmark.md').write_text(markdown(results))


def main(argv: Optional[Sequence[str]] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out_dir', default='benchmark_results')
  parser.add_argument('--data_dir', default=None, help='folder holding multi30k/')
  parser.add_argument('--sentences', default='1:100,8:200,32:320',
                      help='batch_size:number_of_sentences pairs (the first N test sentences)')
  parser.add_argument('--repeats', type=int, default=3, help='timed passes per configuration')
  parser.add_argument('--input_length_step', type=int, default=INPUT_LENGTH_STEP,
                      help='encoder width: each batch\'s longest input rounded up to a multiple '
                           f'of this (0: every batch padded to {INPUT_LENGTH})')
  parser.add_argument('--quick', action='store_true', help='4 configurations, 16 sentences')
  parser.add_argument('--gammas', default='1,2,3,4,5,6,7,8,auto',
                      help="greedy speculative gammas ('auto': autogamma, as the infer job)")
  parser.add_argument('--sampling_gammas', default='1,2,3,4,5,6,7,8',
                      help='speculative gammas at temperature 1 (empty: none)')
  parser.add_argument('--bild', default=','.join(f'{f}:{r}' for f in BILD_FALLBACKS
                                                 for r in BILD_ROLLBACKS),
                      help='BiLD fallback:rollback pairs (empty: none)')
  parser.add_argument('--no_adaptive', action='store_true', help='skip adaptive gamma')
  parser.add_argument('--beams', default='',
                      help='beam:branching pairs for beam_search vs speculative beam search, '
                           "e.g. '4:8,4:4;2' (branching per depth separated by ';'; empty: none)")
  parser.add_argument('--no_hf', action='store_true', help='skip HF assisted generation')
  parser.add_argument('--hf_gammas', default='4', help='constant HF assistant lengths to run')
  parser.add_argument('--target', default=str(PRETRAINED / 'multi30k_de_en_target.msgpack'))
  parser.add_argument('--draft', default=str(PRETRAINED / 'multi30k_de_en_draft.msgpack'))
  parser.add_argument('--confirm', action='store_true',
                      help="re-time out_dir's baselines and best configurations interleaved "
                           '(adds an interleaved table to benchmark.json/.md)')
  parser.add_argument('--replot', action='store_true',
                      help="only rewrite the table and plots from out_dir's benchmark.json")
  args = parser.parse_args(argv)
  out_dir = Path(args.out_dir)
  if args.replot:
    results = json.loads((out_dir / 'benchmark.json').read_text())
    (out_dir / 'benchmark.md').write_text(markdown(results))
    print('wrote', out_dir / 'benchmark.md', *plots(results, out_dir))
    return
  if args.confirm:
    confirm(out_dir, args)
    return
  sizes = {1: 16, 8: 16} if args.quick else parse_sentences(args.sentences)
  out_dir.mkdir(parents=True, exist_ok=True)
  try:
    sources, references = data.load_split('test', data_dir=args.data_dir)
  except FileNotFoundError as e:
    raise SystemExit(f'error: Multi30k not found ({e}); pass --data_dir or set '
                     f'{data.DATA_ENV_VAR}.')

  configs, params, prepared = load_pair(args.target, args.draft)
  c_hat = configs['draft'].decode_flops_per_token() / configs['target'].decode_flops_per_token()
  try:
    ints = lambda spec: [g if g == autogamma.AUTO else int(g) for g in spec.split(',') if g]
    bild = [tuple(float(v) for v in pair.split(':')) for pair in args.bild.split(',') if pair]
    beams = [(int(pair.split(':')[0]), pair.split(':')[1].replace(';', ','))
             for pair in args.beams.split(',') if pair]
    settings = grid(args.quick, ints(args.gammas), ints(args.sampling_gammas), bild,
                    not args.no_adaptive, beams)
  except (ValueError, IndexError):
    raise SystemExit("error: --gammas/--sampling_gammas want integers (or 'auto') like 1,2,auto, "
                     '--bild fallback:rollback pairs like 0.6:5 and --beams beam:branching '
                     'pairs like 4:8')
  bandwidth = memory_bandwidth_gbs()
  peak_gflops = matmul_gflops()
  floor_ms = {name: 1e3 * step_weight_bytes(configs[name], params[name]) / (bandwidth * 1e9)
              for name in configs}
  results = {'meta': {
      'description': 'embedded Multi30k De->En pair on test_2016_flickr, greedy and sampling',
      'command': 'python scripts/benchmark.py ' + ' '.join(argv if argv is not None
                                                           else sys.argv[1:]),
      'machine': f'{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, '
                 f'jax {jax.__version__} on {jax.devices()[0].platform}',
      'xla_flags': os.environ.get('XLA_FLAGS', ''), 'repeats': args.repeats,
      'input_length': INPUT_LENGTH, 'input_length_step': args.input_length_step,
      'output_length': OUTPUT_LENGTH, 'c_hat': c_hat,
      'memory_bandwidth_gbs': bandwidth, 'weight_streaming_floor_ms': floor_ms,
      'matmul_gflops': peak_gflops,
      'target_flops_per_token': configs['target'].decode_flops_per_token(),
      'target_params': int(sum(x.size for x in jax.tree_util.tree_leaves(params['target']))),
      'draft_params': int(sum(x.size for x in jax.tree_util.tree_leaves(params['draft'])))},
      'batches': {}, 'hf': []}
  json_path = out_dir / 'benchmark.json'

  def save():
    json_path.write_text(json.dumps(results, indent=1))

  total = len(sizes) * len(settings)
  done = 0
  started = time.perf_counter()
  for batch_size, count in sizes.items():
    count = min(count, len(sources))
    token_rows = data.encode(sources[:count], INPUT_LENGTH)
    batches = make_batches(token_rows, batch_size, args.input_length_step)
    verify_sizes = sorted({1, 2, 3, 4, 5, 6, 7, 8, 9, BILD_MAX_SMALL_STEPS + 1})
    steps = {'target': step_times_ms(configs['target'], params['target'], batch_size,
                                     verify_sizes),
             'draft': step_times_ms(configs['draft'], params['draft'], batch_size, (1, 2))}
    print(f'batch {batch_size}: target step ms ' +
          ' '.join(f'k={k}: {v:.2f}' for k, v in steps['target'].items()) +
          f"; draft k=1: {steps['draft'][1]:.2f}, k=2: {steps['draft'][2]:.2f}; weight-"
          f"streaming floor {floor_ms['target']:.2f} ms at {bandwidth:.1f} GB/s", flush=True)
    block = {'num_sentences': count, 'rows': [],
             'step_ms': {m: {str(k): v for k, v in t.items()} for m, t in steps.items()}}
    results['batches'][str(batch_size)] = block
    baselines = {}
    for setting in settings:
      run = run_setting(setting, configs, prepared, batches, count, args.repeats)
      if setting.baseline == setting:
        baselines[setting] = run
      setting_steps = steps
      if setting.method == 'speculative_beam':
        setting_steps = beam_steps_ms(configs, params, batch_size * setting.beam, setting.tree)
      row = summarize(setting, run, baselines[setting.baseline], setting_steps, c_hat,
                      references[:count])
      block['rows'].append(row)
      done += 1
      print(f'[{done}/{total} {time.perf_counter() - started:.0f}s] batch {batch_size} '
            f"{row['name']}: {row['ms_per_sentence']:.1f} ms/sentence, {row['speedup']:.2f}x, "
            f"BLEU {row['bleu']:.2f}, alpha {fmt(row.get('alpha'), '.3f')}, "
            f"compile {row['compile_s']:.1f}s", flush=True)
      save()
    if batch_size == 1 and not args.no_hf:
      try:
        results['hf'] = hf_rows(configs, params, sources[:count], references[:count],
                                baselines[Setting('baseline')]['decodes'],
                                baselines[Setting('baseline')]['ms_per_sentence'],
                                args.repeats, [int(g) for g in args.hf_gammas.split(',')])
        for r in results['hf']:
          print(f"HF {r['name']}: {r['ms_per_sentence']:.1f} ms/sentence, "
                f"{r['speedup']:.2f}x vs our target-only, same as our greedy "
                f"{r['same_as_baseline']:.0%}", flush=True)
      except ImportError as e:
        print(f'skipping HF assisted generation: {e}', file=sys.stderr)
      save()
  (out_dir / 'benchmark.md').write_text(markdown(results))
  files = plots(results, out_dir)
  print(f'wrote {json_path}, {out_dir / "benchmark.md"}' + ''.join(f', {f}' for f in files))


if __name__ == '__main__':
  main()
