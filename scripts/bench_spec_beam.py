"""Speculative beam search against beam_search on the embedded Multi30k pair, batch 1.

  python scripts/bench_spec_beam.py --sentences 20 --beam 4 --branching 2 --branching 8 --branching 4,2

For each test_2016_flickr sentence (file order) both decoders run on the same compiled
functions, interleaved per sentence (beam_search, then each tree shape), compilation excluded.
Checks every beam and score against beam_search, and reports per sentence beam steps (=
beam_search's target calls) and speculative target calls, and the median ms per sentence.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from speculative_t5x import beam_search as bs
from speculative_t5x import data
from speculative_t5x import models
from speculative_t5x import train

PRETRAINED = Path(__file__).resolve().parents[1] / 'speculative_t5x' / 'pretrained'
DATA = Path(os.environ.get('SPECULATIVE_T5X_DATA',
                           Path(__file__).resolve().parents[2] / 'shared' / 'data'))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--sentences', type=int, default=20)
  parser.add_argument('--beam', type=int, default=4)
  parser.add_argument('--alpha', type=float, default=0.6)
  parser.add_argument('--branching', action='append',
                      help='children per depth, e.g. 4,2 (repeatable; default 8)')
  parser.add_argument('--length', type=int, default=64, help='input and output length')
  parser.add_argument('--data', default=str(DATA / 'multi30k' / 'test_2016_flickr.de'))
  parser.add_argument('--json', help='write the per-sentence results here')
  args = parser.parse_args()
  shapes = [tuple(int(b) for b in s.split(',')) for s in (args.branching or ['8'])]

  target_config, target_params, _ = train.load_weights(str(PRETRAINED /
                                                           'multi30k_de_en_target.msgpack'))
  draft_config, draft_params, _ = train.load_weights(str(PRETRAINED /
                                                         'multi30k_de_en_draft.msgpack'))
  params = {'target': target_params, 'draft': draft_params}
  params = jax.jit(models.EncoderDecoderModel(target_config, draft_config).with_decode_variables)(
      params)
  sentences = Path(args.data).read_text(encoding='utf-8').splitlines()[:args.sentences]
  ids = data.encode(sentences, args.length)

  decoders = {'beam_search': bs.beam_search}
  for shape in shapes:
    decoders['tree' + 'x'.join(map(str, shape))] = functools.partial(
        bs.speculative_beam_search, branching=shape)
  predicts = {}
  for name, fn in decoders.items():
    model = models.EncoderDecoderModel(target_config, draft_config, decode_fn=fn,
                                       decode_kwargs={'alpha': args.alpha}, eos_id=data.EOS_ID)
    predicts[name] = jax.jit(functools.partial(model.predict_batch_with_aux,
                                               num_decodes=args.beam, return_all_decodes=True))

  results = {name: [] for name in decoders}
  for i, sentence_ids in enumerate(ids):
    batch = {k: jnp.asarray(v) for k, v in
             data.pad_batch([sentence_ids], None, args.length, args.length, 1).items()}
    for name, predict in predicts.items():
      if i == 0:
        start = time.perf_counter()
        jax.block_until_ready(predict(params, batch))
        print(f'{name}: compiled in {time.perf_counter() - start:.1f} s', flush=True)
      start = time.perf_counter()
      decodes, aux = jax.block_until_ready(predict(params, batch))
      ms = 1e3 * (time.perf_counter() - start)
      stats = aux.get('stats', {})
      results[name].append({
          'ms': ms, 'decodes': np.asarray(decodes)[0], 'scores': np.asarray(aux['scores'])[0],
          'target_calls': int(stats['target_calls'][0, 0]) if stats else None,
          'steps': int(stats['emitted'][0, 0]) if stats else None})

  base = results['beam_search']
  # beam_search makes one target call per step, and an exact decoder takes the same steps.
  steps = [r['steps'] for r in results[next(n for n in results if n != 'beam_search')]]
  for r, n in zip(base, steps):
    r['steps'] = r['target_calls'] = n
  summary = {'beam': args.beam, 'alpha': args.alpha, 'sentences': len(ids), 'decoders': {}}
  print(f'\n{len(ids)} sentences, beam {args.beam}, alpha {args.alpha}, batch 1')
  print(f'{"decoder":12s} {"identical":>9s} {"max|dscore|":>11s} {"steps":>6s} '
        f'{"target calls":>12s} {"steps/call":>10s} {"median ms":>9s}')
  for name, rows in results.items():
    s = {'identical': all(np.array_equal(r['decodes'], b['decodes']) and r['steps'] == b['steps']
                          for r, b in zip(rows, base)),
         'max_score_diff': max(float(np.abs(r['scores'] - b['scores']).max())
                               for r, b in zip(rows, base)),
         'median_ms': float(np.median([r['ms'] for r in rows])),
         'steps': sum(r['steps'] for r in rows),
         'target_calls': sum(r['target_calls'] for r in rows),
         'per_sentence_calls': [r['target_calls'] for r in rows],
         'per_sentence_ms': [round(r['ms'], 2) for r in rows]}
    summary['decoders'][name] = s
    print(f'{name:12s} {str(s["identical"]):>9s} {s["max_score_diff"]:11.2e} {s["steps"]:6d} '
          f'{s["target_calls"]:12d} {s["steps"] / s["target_calls"]:10.2f} '
          f'{s["median_ms"]:9.1f}')
  if args.json:
    Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == '__main__':
  main()
