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
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import jax
import numpy as np

from speculative_t5x import errors
from speculative_t5x import gin_utils
from speculative_t5x import models
from speculative_t5x import pipeline
from speculative_t5x import policy

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
    if Path(args.file).is_dir():
      raise SystemExit(f'error: --file {args.file} is a directory: give a file with one German '
                       'sentence per line')
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
                         encoder_input_tokens: np.ndarray, decodes: np.ndarray,
                         score_batch: Optional[Callable[..., Any]] = None) -> np.ndarray:
  """The target's mean log-probability per output token (through EOS) of `decodes`: [batch].

  One teacher-forced pass (`score_batch`) over encoder_input_tokens [batch, input_length] and
  decodes [batch, length] (0 after EOS, as the decoders return them). score_batch: a jitted
  `model.score_batch` to reuse across calls (default: jitted here).
  """
  decoder_input_tokens = np.zeros_like(decodes)
  decoder_input_tokens[:, 1:] = decodes[:, :-1]
  weights = (decodes > 0).astype(np.float32)
  score_batch = score_batch or jax.jit(model.score_batch)
  scores = score_batch(params, {
      'encoder_input_tokens': encoder_input_tokens, 'decoder_input_tokens': decoder_input_tokens,
      'decoder_target_tokens': decodes, 'decoder_loss_weights': weights})
  return np.asarray(scores) / np.maximum(weights.sum(axis=1), 1)


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog='speculative-t5x-translate', description='\n\n'.join(__doc__.split('\n\n')[0:3:2]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('sentences', nargs='*', help='German image captions (default: piped '
                      'stdin, else a bundled sample)')
  parser.add_argument('--file', help='a file with one German sentence per line')
  parser.add_argument('--gamma', default=policy.AUTO,
                      help="draft tokens per target call, or 'auto' (default): chosen per "
                           'batch from measured batch times, gamma 0 (the target alone) '
                           f'included; the first batch runs gamma {policy.FALLBACK_GAMMA} '
                           f'({policy.MAX_GAMMA} for a single sentence)')
  parser.add_argument('--batch_size', default=8,
                      help='at most this many sentences per batch (default 8; fewer sentences: '
                           'one batch of exactly that many, so no padding rows are decoded)')
  parser.add_argument('--target', default=str(pipeline.EMBEDDED_TARGET),
                      help='target weights (checkpoints.export_weights file); default: embedded')
  parser.add_argument('--draft', default=str(pipeline.EMBEDDED_DRAFT),
                      help='draft weights; default: embedded')
  args = parser.parse_args(argv)
  if args.sentences and args.file:
    raise SystemExit('error: give sentences as arguments or --file FILE, not both')
  if args.gamma != policy.AUTO:
    args.gamma = _whole_number('--gamma', args.gamma, "'auto' or a whole number >= 1 (draft "
                               'tokens per target call)')
  args.batch_size = _whole_number('--batch_size', args.batch_size, 'a whole number >= 1')
  return args


def _whole_number(flag: str, value: Any, allowed: str) -> int:
  """`value` as an int >= 1; else exits with one line naming the flag and what it allows."""
  try:
    number = int(value)
  except ValueError:
    number = 0
  if number < 1:
    raise SystemExit('error: ' + errors.must_be(flag, allowed, value))
  return number


def _status(message: str) -> None:
  """What the command is doing, on stderr (stdout keeps the translations): its compiling and
  timing take tens of seconds with nothing else to show."""
  print(message, file=sys.stderr, flush=True)


def _timed(pipe: pipeline.Pipeline, sentences: Sequence[str], gamma: Union[int, str]
           ) -> Tuple[Dict[str, pipeline.Decoded], Dict[str, float], int]:
  """Greedy speculative and target-only decodes of `sentences`, and each one's median seconds.

  Both are compiled (every gamma of 'auto') and run once first. A few sentences decode in
  milliseconds, where one pass of each is noise: the two alternate over several rounds.
  """
  passes = {'speculative': lambda: pipe.decode(sentences, 'speculative', gamma=gamma),
            'target-only': lambda: pipe.decode(sentences, 'target')}
  rounds = TIMING_ROUNDS if len(sentences) <= 64 else 1
  gammas = (f"gammas 0-{policy.MAX_GAMMA}, for gamma 'auto'" if gamma == policy.AUTO else
            f'gamma {gamma}')
  _status(f'compiling greedy speculative ({gammas}) and target-only decoding for '
          f'{len(sentences)} sentence{"s" * (len(sentences) > 1)} ...')
  # Every gamma the policy may choose, compiled ahead: none compiles inside a timed pass.
  pipe.compile(sentences, 'speculative', gamma=gamma)
  pipe.compile(sentences, 'target')
  _status(f'decoding, then timing speculative vs target-only: '
          f'{"one run each" if rounds == 1 else f"{rounds} alternating runs of each"} ...')
  results = {name: one_pass() for name, one_pass in passes.items()}

  def remember(name):
    def one_pass():
      results[name] = passes[name]()
      return results[name].tokens
    return one_pass

  times = policy.round_robin({name: remember(name) for name in passes}, rounds)
  return results, {name: float(np.median(t)) for name, t in times.items()}, rounds


def _print_translations(pipe: pipeline.Pipeline, sentences: Sequence[str],
                        result: pipeline.Decoded) -> None:
  """Each translation, flagged where the target finds its own output unlikely."""
  model, log_probs = pipe.pair.model(), []
  score_batch = jax.jit(model.score_batch)  # one jitted function for every batch
  for b, batch in enumerate(pipe.batches(sentences)):  # each batch has its own encoder width
    rows = len(batch['encoder_input_tokens'])
    decodes = result.tokens[b * rows:(b + 1) * rows]
    log_probs.append(mean_token_log_probs(
        model, pipe.pair.params, np.asarray(batch['encoder_input_tokens'])[:len(decodes)], decodes,
        score_batch))
  log_probs = np.concatenate(log_probs)
  unusual = log_probs < OUT_OF_DOMAIN_LOG_PROB
  for source, translation, flag in zip(sentences, result.texts, unusual):
    print(f'{source}\n  -> {translation}' + ('   [looks out of domain]' if flag else ''))
  if unusual.any():
    print(f'\n{unusual.sum()} of {len(sentences)} inputs look out of domain for the embedded '
          f'pair (image captions): the target gives its own output a mean log-probability per '
          f'token below {OUT_OF_DOMAIN_LOG_PROB} (as for 36 of the 1000 Multi30k test captions).')


def _schedule_text(gamma: Union[int, str], result: pipeline.Decoded) -> str:
  """The gamma of the reported (last) pass: as given, or under 'auto' the batches each gamma
  ran and what the policy measured."""
  if gamma != policy.AUTO:
    return str(gamma)
  (rows, used), = result.schedule.items()
  measured = result.policy['measured']
  return (f'auto at batch size {rows}: ' + ', '.join(f'{g} x{n}' for g, n in sorted(used.items())) +
          (' (the fallback; too few batches to measure others)' if result.policy['fallback_only']
           else '; ms per output position ' +
           ', '.join(f'{g}: {m["ms_per_position"]:.2f}' for g, m in measured.items())))


def _acceptance_text(result: pipeline.Decoded) -> str:
  """alpha and tokens per target call; or, when 'auto' ran the target alone on every batch (no
  draft token proposed), that speculation was off and why: alpha=0.000 would read as a broken
  draft."""
  stats = result.stats
  proposed = int(stats['proposed'].sum()) if 'proposed' in stats else 0
  if not proposed:
    with_draft = {g: m['ms_per_position'] for g, m in result.policy.get('measured', {}).items()
                  if g != '0'}
    if not with_draft:
      return 'speculation off: gamma 0 (the target alone) ran every batch'
    best = min(with_draft, key=with_draft.get)
    return (f'speculation off: gamma 0 (the target alone) measured faster than gamma {best} '
            'on these batches')
  alpha = stats['accepted'].sum() / proposed
  per_call = stats['emitted'].sum() / max(stats['target_calls'].sum(), 1)
  return f'alpha={alpha:.3f}, {per_call:.2f} tokens per target call'


def _print_statistics(n: int, gamma: Union[int, str], results: Mapping[str, pipeline.Decoded],
                      seconds: Mapping[str, float], rounds: int) -> None:
  result, base = results['speculative'], results['target-only']
  timing = f'median of {rounds} alternating runs' if rounds > 1 else 'one run each'
  spec, target_only = seconds['speculative'], seconds['target-only']
  print(f'\n{n} sentence{"s" * (n > 1)}, gamma={_schedule_text(gamma, result)}: '
        f'{_acceptance_text(result)}, speculative '
        f'{1e3 * spec:.0f} ms vs target-only {1e3 * target_only:.0f} ms ({timing}; '
        f'{target_only / spec:.2f}x); outputs identical to '
        f'target-only greedy: {bool((result.tokens == base.tokens).all())}')


def main(argv: Optional[Sequence[str]] = None) -> None:
  args = _parse_args(argv)
  sentences = _read_sentences(args)
  try:
    pair = pipeline.load_pair(args.target, args.draft)
  except (OSError, ValueError, KeyError) as e:
    raise SystemExit(f'error: cannot load the model weights: {e}') from None
  pipe = pipeline.Pipeline(pair, batch_size=min(args.batch_size, len(sentences)),
                           max_input_length=MAX_INPUT_LENGTH,
                           max_output_length=MAX_OUTPUT_LENGTH,
                           input_length_step=INPUT_LENGTH_STEP)
  results, seconds, rounds = _timed(pipe, sentences, args.gamma)
  _print_translations(pipe, sentences, results['speculative'])
  _print_statistics(len(sentences), args.gamma, results, seconds, rounds)


if __name__ == '__main__':
  main()
