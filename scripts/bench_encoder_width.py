"""Encoder width: inputs padded to 64 vs to the input length rounded up to 16 (what
`speculative-t5x-translate` does), at batch 1 on the embedded pair.

  python scripts/bench_encoder_width.py [--sentences 24] [--rounds 5]

Greedy speculative decoding (gamma 2) and target-only greedy decoding of the first test_2016_flickr
sentences, every width compiled first, then `--rounds` interleaved rounds; prints the median ms
per sentence of each, the per-round target-only/speculative ratio, and whether all outputs agree.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from speculative_t5x import data
from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import train
from speculative_t5x.translate import INPUT_LENGTH_STEP, MAX_INPUT_LENGTH, MAX_OUTPUT_LENGTH
from speculative_t5x.translate import PRETRAINED

DATA = Path(os.environ.get('SPECULATIVE_T5X_DATA',
                           Path(__file__).resolve().parents[2] / 'shared' / 'data'))


def one_row_batches(ids, round_width: bool):
  """One batch per sentence: encoder width 64, or its length rounded up to the step."""
  batches = []
  for row in ids:
    width = (min(MAX_INPUT_LENGTH, -(-len(row) // INPUT_LENGTH_STEP) * INPUT_LENGTH_STEP)
             if round_width else MAX_INPUT_LENGTH)
    batch = data.pad_batch([row], None, width, MAX_OUTPUT_LENGTH, 1)
    batches.append({k: jnp.asarray(v) for k, v in batch.items()})
  return batches


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--sentences', type=int, default=24)
  parser.add_argument('--rounds', type=int, default=5)
  args = parser.parse_args()
  target_config, target_params, _ = train.load_weights(PRETRAINED / 'multi30k_de_en_target.msgpack')
  draft_config, draft_params, _ = train.load_weights(PRETRAINED / 'multi30k_de_en_draft.msgpack')
  params = jax.jit(models.EncoderDecoderModel(target_config, draft_config).with_decode_variables)(
      {'target': target_params, 'draft': draft_params})
  sentences = (DATA / 'multi30k' / 'test_2016_flickr.de').read_text(
      encoding='utf-8').splitlines()[:args.sentences]
  ids = data.encode(sentences, MAX_INPUT_LENGTH)
  predicts = {}
  for name, fn, kwargs in (
      ('speculative', decoding.speculative_sample, {'temperature': 0.0, 'gamma': 2}),
      ('target-only', decoding.temperature_sample, {'temperature': 0.0})):
    model = models.EncoderDecoderModel(target_config, draft_config, decode_fn=fn,
                                       decode_kwargs=kwargs, eos_id=data.EOS_ID)
    predicts[name] = jax.jit(model.predict_batch)
  batches = {'64': one_row_batches(ids, False), 'rounded': one_row_batches(ids, True)}
  for width_batches in batches.values():
    for predict in predicts.values():
      for batch in width_batches:
        jax.block_until_ready(predict(params, batch))  # compile every width in use
  ms = {(name, width): [] for name in predicts for width in batches}
  outputs = {}
  for _ in range(args.rounds):
    for width, width_batches in batches.items():
      for name, predict in predicts.items():
        start = time.perf_counter()
        outputs[name, width] = [np.asarray(jax.block_until_ready(predict(params, batch)))
                                for batch in width_batches]
        ms[name, width].append(1e3 * (time.perf_counter() - start) / len(width_batches))
  for (name, width), values in ms.items():
    print(f'{name:12s} width {width:8s} {np.median(values):6.2f} ms/sentence (median)')
  for width in batches:
    ratios = np.array(ms['target-only', width]) / np.array(ms['speculative', width])
    print(f'width {width}: target-only / speculative {np.median(ratios):.3f}')
  reference = outputs['target-only', '64']
  same = all(np.array_equal(a, b) for key in outputs for a, b in zip(outputs[key], reference))
  print(f'outputs identical across widths and decoders: {same}')


if __name__ == '__main__':
  main()
