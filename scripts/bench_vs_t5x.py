"""This project's decoders against real T5X's greedy decoder, on the embedded pair, one process.

  PYTHONPATH=. /path/to/t5x-venv/bin/python scripts/bench_vs_t5x.py --sentences 1:40,8:80

Needs T5X itself (not a dependency: ../shared/docs/t5x_private_install.md installs it in a
venv of its own). T5X's side is `t5x.models.EncoderDecoderModel.predict_batch_with_aux` over
T5X's own example network (`t5x.examples.t5.network`) and `t5x.decoding.temperature_sample` at
temperature 0, on the embedded target's parameters (the trees are T5X's). This project's side:
target-only greedy, greedy speculative decoding at each --gammas value ('auto' as the infer job
runs it). Every configuration decodes the first N test_2016_flickr sentences in fixed-shape
batches (output length 64, encoder width each batch's longest input rounded up to
--input_length_step, as scripts/benchmark.py; both sides get the same batches); the configurations are timed
round-robin for --repeats rounds and each speedup is the median over rounds of T5X's pass time
over the configuration's in the same round. Outputs are compared with T5X's token for token.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark  # pylint: disable=g-import-not-at-top,wrong-import-position

from speculative_t5x import data  # pylint: disable=wrong-import-position


def t5x_greedy_pass(target_config, target_params, batches):
  """One pass of T5X's own greedy decoding over `batches` (compiled first): a callable."""
  try:
    from t5x import decoding as t5x_decoding  # pylint: disable=g-import-not-at-top
    from t5x import models as t5x_models  # pylint: disable=g-import-not-at-top
    from t5x.examples.t5 import network as t5x_network  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise SystemExit(f'error: this comparison needs T5X itself ({e}); see '
                     '../shared/docs/t5x_private_install.md') from None
  fields = {f.name for f in dataclasses.fields(t5x_network.T5Config)}
  config = t5x_network.T5Config(**{k: v for k, v in dataclasses.asdict(target_config).items()
                                   if k in fields})
  model = t5x_models.EncoderDecoderModel(
      t5x_network.Transformer(config), None, None, None,
      decode_fn=functools.partial(t5x_decoding.temperature_sample, temperature=0.0))
  predict = jax.jit(functools.partial(model.predict_batch_with_aux,
                                      decoder_params={'eos_id': data.EOS_ID}))
  compiled = benchmark.compile_per_width(predict, target_params, batches)
  return lambda: [compiled(target_params, b) for b in batches]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--sentences', default='1:40,8:80', help='batch_size:count pairs')
  parser.add_argument('--gammas', default='2,auto', help="speculative gammas ('auto' too)")
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--input_length_step', type=int, default=benchmark.INPUT_LENGTH_STEP,
                      help=f'0: every batch padded to {benchmark.INPUT_LENGTH}')
  parser.add_argument('--data_dir', default=None)
  parser.add_argument('--out', default='results/cpu/vs_t5x.json')
  args = parser.parse_args()
  configs, params, prepared = benchmark.load_pair()
  sources, _ = data.load_split('test', data_dir=args.data_dir)
  settings = [benchmark.Setting('baseline')] + [
      benchmark.Setting('speculative', gamma=g if g == 'auto' else int(g))
      for g in args.gammas.split(',') if g]
  results = {'command': 'python scripts/bench_vs_t5x.py ' + ' '.join(sys.argv[1:]),
             'jax': jax.__version__, 'input_length_step': args.input_length_step, 'batches': {}}
  for batch_size, count in benchmark.parse_sentences(args.sentences).items():
    batches = benchmark.make_batches(data.encode(sources[:count], benchmark.INPUT_LENGTH),
                                     batch_size, args.input_length_step)
    passes = {'T5X greedy': t5x_greedy_pass(configs['target'], params['target'], batches)}
    infos = {}
    for setting in settings:
      passes[setting.name], _, infos[setting.name] = benchmark.compile_setting(
          setting, configs, prepared, batches)
    decodes = {}
    for name, one_pass in passes.items():  # warm-up, and the outputs
      decodes[name] = np.concatenate([np.asarray(d) for d, _ in jax.block_until_ready(
          one_pass())])[:count]
    times = benchmark.round_robin(passes, args.repeats)
    rows = []
    for name in passes:
      speedup = benchmark.speedup_over_rounds(times['T5X greedy'], times[name])
      rows.append({'name': name, 'ms_per_sentence': 1e3 * float(np.median(times[name])) / count,
                   'speedup_vs_t5x': speedup['speedup'],
                   'range': [speedup['speedup_min'], speedup['speedup_max']],
                   'same_as_t5x': float(np.mean(np.all(decodes[name] == decodes['T5X greedy'],
                                                       axis=1)))})
      if infos.get(name):  # gamma='auto': its calibration and choices
        rows[-1].update(calibration=infos[name]['calibration'], gammas_used={
            str(g): n for g, n in sorted(infos[name]['gammas_used'].items())})
        print(f"batch {batch_size} {name}: batches per gamma {rows[-1]['gammas_used']}, "
              f"calibration {rows[-1]['calibration']}")
      print(f"batch {batch_size} {name}: {rows[-1]['ms_per_sentence']:.1f} ms/sentence, "
            f"{rows[-1]['speedup_vs_t5x']:.2f}x T5X (rounds {speedup['speedup_min']:.2f}-"
            f"{speedup['speedup_max']:.2f}), same as T5X {rows[-1]['same_as_t5x']:.0%}", flush=True)
    results['batches'][str(batch_size)] = {'sentences': count, 'rows': rows}
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(results, indent=1))
  print('wrote', args.out)


if __name__ == '__main__':
  main()
