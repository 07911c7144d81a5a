"""Translates German image captions to English with speculative decoding on the embedded pair.

  speculative-t5x-translate                     (a bundled sample of eight captions)
  speculative-t5x-translate "Ein Mann fährt Fahrrad." "Zwei Hunde spielen im Schnee."
  echo "Eine Frau liest ein Buch." | speculative-t5x-translate
  speculative-t5x-translate --file sentences.de
  (or python -m speculative_t5x.translate ...)

Domain: the embedded models were trained on Multi30k's 29k image captions, short descriptions of
a photo ("Ein Hund rennt durch den Schnee."); everyday, news or technical German comes back as
caption-like nonsense. When the target's own mean log-probability per output token is below
-1.5 (OUT_OF_DOMAIN_LOG_PROB), the input is flagged as looking out of domain (reported, still
translated).

Prints each translation, then the run's statistics: acceptance rate (alpha), tokens per target
call, and the wall time of greedy speculative decoding against greedy target-only decoding of the
same sentences in the same process (compilation excluded; each is compiled once, first).
Multi30k's licence limits the embedded models to non-commercial research and education.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path
from typing import List, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from speculative_t5x import autogamma
from speculative_t5x import data
from speculative_t5x import gin_utils
from speculative_t5x import models
from speculative_t5x import train

PRETRAINED = gin_utils.PACKAGE_DIR / 'pretrained'
SAMPLE = gin_utils.PACKAGE_DIR / 'samples' / 'captions_de.txt'
# Per sentence, the target's mean log-probability of its own greedy output tokens (EOS included),
# measured: below it are 36 of test_2016_flickr's 1000 captions (median -0.68) and 12 of 16
# everyday and news sentences (-2.75 to -1.40); README, "What the embedded pair translates".
OUT_OF_DOMAIN_LOG_PROB = -1.5
MAX_INPUT_LENGTH = 64
INPUT_LENGTH_STEP = 16
MAX_OUTPUT_LENGTH = 64
TIMING_ROUNDS = 5


def _read_sentences(args: argparse.Namespace) -> List[str]:
  """Arguments, else --file, else piped stdin, else (a terminal, or nothing piped) the sample."""
  if args.sentences:
    lines = list(args.sentences)
  elif args.file:
    try:
      lines = Path(args.file).read_text(encoding='utf-8').splitlines()
    except (OSError, UnicodeDecodeError) as e:
      raise SystemExit(f'error: cannot read --file {args.file}: {e}') from None
    if not any(line.strip() for line in lines):
      raise SystemExit(f'error: --file {args.file} has no sentences.')
  else:
    piped = sys.stdin is not None and not sys.stdin.isatty()
    lines = sys.stdin.read().splitlines() if piped else []
    if not any(line.strip() for line in lines):
      print(f'(no sentences given: translating the bundled sample, {SAMPLE.name})')
      lines = SAMPLE.read_text(encoding='utf-8').splitlines()
  return [line.strip() for line in lines if line.strip()]


def mean_token_log_probs(model: models.EncoderDecoderModel, params: dict,
                         encoder_input_tokens: np.ndarray, decodes: np.ndarray) -> np.ndarray:
  """The target's mean log-probability per output token (through EOS) of `decodes`: [batch].

  One teacher-forced pass (`score_batch`) over encoder_input_tokens [batch, input_length] and
  decodes [batch, length] (0 after EOS, as the decoders return them).
  """
  decoder_input_tokens = np.zeros_like(decodes)
  decoder_input_tokens[:, 1:] = decodes[:, :-1]
  weights = (decodes > 0).astype(np.float32)
  scores = jax.jit(model.score_batch)(params, {
      'encoder_input_tokens': encoder_input_tokens, 'decoder_input_tokens': decoder_input_tokens,
      'decoder_target_tokens': decodes, 'decoder_loss_weights': weights})
  return np.asarray(scores) / np.maximum(weights.sum(axis=1), 1)


def _batch(sentences: Sequence[str], batch_size: int) -> dict:
  """All sentences as one padded batch of rows, a multiple of batch_size (no row is split).

  The encoder width is the longest input rounded up to INPUT_LENGTH_STEP, not
  MAX_INPUT_LENGTH: the encoder and every decode step's cross-attention then skip padding that
  captions (~15 tokens) would leave, at one compilation per width in use.
  """
  ids = data.encode(sentences, MAX_INPUT_LENGTH)
  rows = -(-len(ids) // batch_size) * batch_size  # fixed shapes: pad the last batch
  return data.pad_batch(ids, None, MAX_INPUT_LENGTH, MAX_OUTPUT_LENGTH, rows,
                        length_step=INPUT_LENGTH_STEP)


def main(argv: Sequence[str] = None) -> None:
  parser = argparse.ArgumentParser(
      prog='speculative-t5x-translate', description='\n\n'.join(__doc__.split('\n\n')[0:3:2]), formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('sentences', nargs='*', help='German image captions (default: piped '
                      'stdin, else a bundled sample)')
  parser.add_argument('--file', help='a file with one German sentence per line')
  parser.add_argument('--gamma', default=autogamma.AUTO,
                      help="draft tokens per target call, or 'auto' (default): timed per "
                           f'gamma on the first batches when there are at least '
                           f'{autogamma.MIN_BATCHES} batches, else {autogamma.FALLBACK_GAMMA}')
  parser.add_argument('--batch_size', type=int, default=8,
                      help='at most this many sentences per batch (fewer sentences: one batch '
                           'of exactly that many, so no padding rows are decoded)')
  parser.add_argument('--target', default=str(PRETRAINED / 'multi30k_de_en_target.msgpack'),
                      help='target weights (train.export_weights file); default: embedded')
  parser.add_argument('--draft', default=str(PRETRAINED / 'multi30k_de_en_draft.msgpack'),
                      help='draft weights; default: embedded')
  args = parser.parse_args(argv)
  if args.gamma != autogamma.AUTO:
    try:
      args.gamma = int(args.gamma)
    except ValueError:
      args.gamma = 0
  if args.gamma != autogamma.AUTO and args.gamma < 1 or args.batch_size < 1:
    raise SystemExit("error: --gamma must be 'auto' or at least 1, and --batch_size at least 1.")
  sentences = _read_sentences(args)
  args.batch_size = min(args.batch_size, len(sentences))

  try:
    target_config, target_params, _ = train.load_weights(args.target)
    draft_config, draft_params, _ = train.load_weights(args.draft)
  except (OSError, ValueError, KeyError) as e:
    raise SystemExit(f'error: cannot load the model weights: {e}') from None
  params = {'target': target_params, 'draft': draft_params}
  # Decode-time weight layouts once, not once per batch.
  params = jax.jit(models.EncoderDecoderModel(target_config, draft_config).with_decode_variables)(
      params)
  batch = _batch(sentences, args.batch_size)
  chunks = [{k: jnp.asarray(v[i:i + args.batch_size]) for k, v in batch.items()}
            for i in range(0, len(batch['encoder_input_tokens']), args.batch_size)]
  model = models.EncoderDecoderModel(target_config, draft_config,
                                     decode_kwargs={'temperature': 0.0, 'gamma': args.gamma},
                                     eos_id=data.EOS_ID)
  gammas = [args.gamma]
  if args.gamma == autogamma.AUTO:
    gammas = [g for g in autogamma.candidates(len(chunks)) if g > 0]
  decoders = autogamma.decoders(model, model.decode_kwargs, max(gammas))
  compiled = {g: jax.jit(decoders[g].predict_batch_with_aux) for g in [0] + gammas}
  for predict in compiled.values():
    jax.block_until_ready(predict(params, chunks[0]))  # compile
  tuner, gammas_used = None, collections.Counter()
  if len(gammas) > 1:
    count = autogamma.calibration_batches(args.batch_size, len(chunks))
    tuner = autogamma.calibrate({g: functools.partial(p, params) for g, p in compiled.items()},
                                chunks[:count])

  def speculative(params, chunk):
    gamma = tuner.choose() if tuner else gammas[0]
    gammas_used[gamma] += 1
    decodes, aux = compiled[gamma](params, chunk)
    if tuner:
      tuner.observe({k: np.asarray(v) for k, v in aux['stats'].items()})
    return decodes, aux

  predicts = {'speculative': speculative, 'target-only': compiled[0]}
  # A few sentences decode in milliseconds, where one pass of each is noise: alternate the two
  # decoders over several rounds and keep each one's median.
  rounds = TIMING_ROUNDS if len(sentences) <= 64 else 1
  times = {name: [] for name in predicts}
  runs = {}  # name -> (decodes, stats) of the last round
  for _ in range(rounds):
    for name, predict in predicts.items():
      start = time.perf_counter()
      outputs = [jax.block_until_ready(predict(params, chunk)) for chunk in chunks]
      times[name].append(time.perf_counter() - start)
      decodes = np.concatenate([np.asarray(d) for d, _ in outputs])[:len(sentences)]
      stats = {k: np.concatenate([np.asarray(a['stats'][k]) for _, a in outputs])[:len(sentences)]
               for k in ('accepted', 'proposed', 'target_calls', 'emitted')}
      runs[name] = (decodes, stats)
  seconds, base_seconds = (float(np.median(times[name])) for name in predicts)

  decodes, stats = runs['speculative']
  scorer = models.EncoderDecoderModel(target_config, draft_config)
  log_probs = mean_token_log_probs(scorer, params, batch['encoder_input_tokens'][:len(sentences)],
                                   decodes)
  unusual = log_probs < OUT_OF_DOMAIN_LOG_PROB
  for source, translation, flag in zip(sentences, data.decode(decodes), unusual):
    print(f'{source}\n  -> {translation}' + ('   [looks out of domain]' if flag else ''))
  if unusual.any():
    print(f'\n{unusual.sum()} of {len(sentences)} inputs look out of domain for the embedded '
          f'pair (image captions): the target gives its own output a mean log-probability per '
          f'token below {OUT_OF_DOMAIN_LOG_PROB} (as for 36 of the 1000 Multi30k test captions).')
  base_decodes, _ = runs['target-only']
  alpha = stats['accepted'].sum() / max(stats['proposed'].sum(), 1)
  per_call = stats['emitted'].sum() / max(stats['target_calls'].sum(), 1)
  timing = f'median of {rounds} alternating runs' if rounds > 1 else 'one run each'
  gamma = ', '.join(str(g) for g in sorted(gammas_used))
  if args.gamma == autogamma.AUTO:
    gamma = f'auto: {gamma}' + ('' if tuner else ', too few batches to time each gamma')
  print(f'\n{len(sentences)} sentence{"s" * (len(sentences) > 1)}, gamma={gamma}: '
        f'alpha={alpha:.3f}, {per_call:.2f} tokens per target call, speculative '
        f'{1e3 * seconds:.0f} ms vs target-only {1e3 * base_seconds:.0f} ms ({timing}; '
        f'{base_seconds / seconds:.2f}x); outputs identical to '
        f'target-only greedy: {bool((decodes == base_decodes).all())}')


if __name__ == '__main__':
  main()
