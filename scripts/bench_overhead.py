"""Measures the engine's own costs on random fp32 T5-small-sized models (no trained weights).

  python scripts/bench_overhead.py [--json out.json]

1. Cached decode step: time of appending k = 1, 4, 8 tokens per row (batch 1), the price of a
   verify call relative to one autoregressive step.
2. Loop overhead: time per generated token of target-only greedy decoding vs greedy speculative
   decoding with gamma = 4 and the draft = the target (alpha = 1), batch 1 and 8. With c = 1 the
   analytic speedup is (gamma + 1) / (gamma + 1) = 1, so the gap to 1x is the loop's own cost.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmark import median_seconds  # scripts/benchmark.py, beside this file
from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import network

CONFIG = network.T5Config(vocab_size=32128, emb_dim=512, num_heads=6, head_dim=64,
                          num_encoder_layers=8, num_decoder_layers=8, mlp_dim=1024,
                          mlp_activations=('gelu', 'linear'), dropout_rate=0.0)
ENC_LEN, DEC_LEN = 32, 64


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--json', help='write the results here')
  parser.add_argument('--repeats', type=int, default=5)
  args = parser.parse_args()

  module = network.Transformer(CONFIG)
  params, _ = network.init_params(CONFIG, jax.random.PRNGKey(0))
  results = {'config': 'emb 512, 6x64 heads, 8+8 layers, mlp 1024, vocab 32128, fp32',
             'device': str(jax.devices()[0]), 'step_ms': {}, 'loop': {}}

  enc = jax.random.randint(jax.random.PRNGKey(1), (1, ENC_LEN), 2, CONFIG.vocab_size)
  encoded = module.apply({'params': params}, enc, method=network.Transformer.encode)
  cache = module.apply({'params': params}, encoded, enc, DEC_LEN,
                       method=network.Transformer.init_cache).with_index(jnp.array([20]))
  step = jax.jit(lambda p, tok, c: module.apply({'params': p}, tok, c,
                                                method=network.Transformer.decode_step))
  for k in (1, 4, 8):
    tokens = jnp.full((1, k), 5, jnp.int32)
    ms = 1e3 * median_seconds(lambda: step(params, tokens, cache), args.repeats * 4)
    results['step_ms'][k] = ms
    print(f'cached step, batch 1, k={k}: {ms:.2f} ms')

  for batch in (1, 8):
    enc = jax.random.randint(jax.random.PRNGKey(2), (batch, ENC_LEN), 2, CONFIG.vocab_size)
    batch_dict = {'encoder_input_tokens': enc,
                  'decoder_input_tokens': jnp.zeros((batch, DEC_LEN), jnp.int32),
                  'decoder_target_tokens': jnp.zeros((batch, DEC_LEN), jnp.int32)}
    all_params = {'target': params, 'draft': params}
    row = {}
    for name, fn, kwargs in (
        ('baseline', decoding.temperature_sample, {'temperature': 0.0}),
        ('speculative_gamma4', decoding.speculative_sample, {'temperature': 0.0, 'gamma': 4})):
      # EOS = -1: nothing stops early, every row makes DEC_LEN tokens.
      model = models.EncoderDecoderModel(CONFIG, CONFIG, decode_fn=fn, decode_kwargs=kwargs,
                                         eos_id=-1)
      predict = jax.jit(model.predict_batch_with_aux)
      start = time.perf_counter()
      jax.block_until_ready(predict(all_params, batch_dict))
      compile_s = time.perf_counter() - start
      seconds = median_seconds(lambda: predict(all_params, batch_dict), args.repeats)
      _, aux = predict(all_params, batch_dict)
      calls = float(np.mean(aux['stats']['target_calls']))
      row[name] = {'ms_per_token': 1e3 * seconds / DEC_LEN, 'first_call_s': compile_s,
                   'target_calls': calls}
      print(f'batch {batch} {name}: {1e3 * seconds / DEC_LEN:.2f} ms/token '
            f'({calls:.0f} target calls for {DEC_LEN} tokens; first call {compile_s:.1f} s)')
    row['speedup'] = row['baseline']['ms_per_token'] / row['speculative_gamma4']['ms_per_token']
    print(f'batch {batch}: speculative/baseline speedup with alpha = 1, c = 1: '
          f'{row["speedup"]:.2f}x')
    results['loop'][batch] = row
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=2)


if __name__ == '__main__':
  main()
