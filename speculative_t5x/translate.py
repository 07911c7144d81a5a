"""Translates German to English with speculative decoding on the embedded Multi30k model pair.

  python -m speculative_t5x.translate "Ein Mann fährt Fahrrad." "Zwei Hunde spielen im Schnee."
  echo "Eine Frau liest ein Buch." | python -m speculative_t5x.translate
  python -m speculative_t5x.translate --file sentences.de

Prints each translation, then the run's statistics: acceptance rate (alpha), tokens per target
call, and the wall time of greedy speculative decoding against greedy target-only decoding of the
same sentences in the same process (compilation excluded; each is compiled once, first).
The embedded models were trained on Multi30k (non-commercial research and education only).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from speculative_t5x import data
from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import train

PRETRAINED = Path(__file__).resolve().parent / 'pretrained'
MAX_INPUT_LENGTH = 64
MAX_OUTPUT_LENGTH = 64


def _read_sentences(args: argparse.Namespace) -> List[str]:
  if args.sentences:
    lines = list(args.sentences)
  elif args.file:
    lines = Path(args.file).read_text(encoding='utf-8').splitlines()
  else:
    lines = sys.stdin.read().splitlines()
  lines = [line.strip() for line in lines if line.strip()]
  if not lines:
    raise SystemExit('error: no sentences given (arguments, --file or stdin).')
  return lines


def _batch(sentences: Sequence[str], batch_size: int) -> dict:
  ids = data.encode(sentences, MAX_INPUT_LENGTH)
  rows = -(-len(ids) // batch_size) * batch_size  # fixed shapes: pad the last batch
  return data.pad_batch(ids, None, MAX_INPUT_LENGTH, MAX_OUTPUT_LENGTH, rows)


def main(argv: Sequence[str] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('sentences', nargs='*', help='German sentences (default: stdin)')
  parser.add_argument('--file', help='a file with one German sentence per line')
  parser.add_argument('--gamma', type=int, default=2,
                      help='draft tokens per target call (2: the fastest on the benchmark at '
                           'batch 1; 1 at batch 8 and more)')
  parser.add_argument('--batch_size', type=int, default=8,
                      help='at most this many sentences per batch (fewer sentences: one batch '
                           'of exactly that many, so no padding rows are decoded)')
  parser.add_argument('--target', default=str(PRETRAINED / 'multi30k_de_en_target.msgpack'))
  parser.add_argument('--draft', default=str(PRETRAINED / 'multi30k_de_en_draft.msgpack'))
  args = parser.parse_args(argv)
  sentences = _read_sentences(args)
  if args.gamma < 1 or args.batch_size < 1:
    raise SystemExit('error: --gamma and --batch_size must be at least 1.')
  args.batch_size = min(args.batch_size, len(sentences))

  target_config, target_params, _ = train.load_weights(args.target)
  draft_config, draft_params, _ = train.load_weights(args.draft)
  params = {'target': target_params, 'draft': draft_params}
  # Decode-time weight layouts once, not once per batch.
  params = jax.jit(models.EncoderDecoderModel(target_config, draft_config).with_decode_variables)(
      params)
  batch = _batch(sentences, args.batch_size)
  runs = {}
  for name, fn, kwargs in (
      ('speculative', decoding.speculative_sample, {'temperature': 0.0, 'gamma': args.gamma}),
      ('target-only', decoding.temperature_sample, {'temperature': 0.0})):
    model = models.EncoderDecoderModel(target_config, draft_config, decode_fn=fn,
                                       decode_kwargs=kwargs, eos_id=data.EOS_ID)
    predict = jax.jit(model.predict_batch_with_aux)
    chunks = [{k: jnp.asarray(v[i:i + args.batch_size]) for k, v in batch.items()}
              for i in range(0, len(batch['encoder_input_tokens']), args.batch_size)]
    jax.block_until_ready(predict(params, chunks[0]))  # compile
    start = time.perf_counter()
    outputs = [jax.block_until_ready(predict(params, chunk)) for chunk in chunks]
    seconds = time.perf_counter() - start
    decodes = np.concatenate([np.asarray(d) for d, _ in outputs])[:len(sentences)]
    stats = {k: np.concatenate([np.asarray(a['stats'][k]) for _, a in outputs])[:len(sentences)]
             for k in ('accepted', 'proposed', 'target_calls', 'emitted')}
    runs[name] = (decodes, stats, seconds)

  decodes, stats, seconds = runs['speculative']
  for source, translation in zip(sentences, data.decode(decodes)):
    print(f'{source}\n  -> {translation}')
  base_decodes, _, base_seconds = runs['target-only']
  alpha = stats['accepted'].sum() / max(stats['proposed'].sum(), 1)
  per_call = stats['emitted'].sum() / max(stats['target_calls'].sum(), 1)
  print(f'\n{len(sentences)} sentences, gamma={args.gamma}: alpha={alpha:.3f}, '
        f'{per_call:.2f} tokens per target call, speculative {1e3 * seconds:.0f} ms vs target-only '
        f'{1e3 * base_seconds:.0f} ms ({base_seconds / seconds:.2f}x); outputs identical to '
        f'target-only greedy: {bool((decodes == base_decodes).all())}')


if __name__ == '__main__':
  main()
