"""This project's decoders against real T5X's greedy decoder, on the embedded pair, one process.

  PYTHONPATH=. /path/to/t5x-venv/bin/python -m benchmarks.vs_t5x --sentences 1:40,8:80

Needs T5X itself, installed apart (docs/t5x.md; without it, one line). T5X's side: its
`EncoderDecoderModel.predict_batch_with_aux` over its example network and `temperature_sample`
at temperature 0, on the embedded target's parameters; ours: target-only greedy and speculative
greedy at each --gammas ('auto' as the infer job runs it), on the same batches of the first N
test captions, timed round-robin (benchmarks.harness); each speedup is the median over rounds of
T5X's pass over the configuration's. Outputs are compared with T5X's token for token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import jax
import numpy as np

from benchmarks import harness
from benchmarks import scale_t5x
from benchmarks.harness import Setting
from speculative_t5x import data
from speculative_t5x import network
from speculative_t5x import policy

NAME = 'vs_t5x'
T5X = 'T5X greedy'


def import_t5x() -> Any:
  """T5X's modules (`scale_t5x.t5x_modules`); exits with one line when T5X is not importable."""
  try:
    return scale_t5x.t5x_modules()
  except ImportError as e:
    raise SystemExit(f'error: benchmarks.vs_t5x needs T5X itself ({e}); install it in a venv of '
                     'its own: ../shared/docs/t5x_private_install.md') from None


def t5x_greedy_pass(t5x: Any, config: network.T5Config, params: Any,
                    batches: Sequence[Mapping[str, Any]]) -> Callable[[], List[Any]]:
  """One pass of T5X's own greedy decoding over `batches`, compiled first for every width."""
  model = scale_t5x.t5x_model(t5x, dataclasses.asdict(config))
  predict = jax.jit(functools.partial(model.predict_batch_with_aux,
                                      decoder_params={'eos_id': data.EOS_ID}))
  compiled = {}
  for batch in batches:
    width = batch['encoder_input_tokens'].shape[1]
    if width not in compiled:
      compiled[width] = predict.lower(params, batch).compile()
  return lambda: [compiled[b['encoder_input_tokens'].shape[1]](params, b) for b in batches]


def batch_block(t5x: Any, settings: Sequence[Setting], batch_size: int,
                sources: Sequence[str], args: Any) -> Dict[str, Any]:
  """T5X and every setting on the first len(sources) sentences: the block's rows."""
  count, pair = len(sources), harness.load_pair()
  batches = harness.make_batches(data.encode(sources, harness.INPUT_LENGTH), batch_size,
                                 args.input_length_step)
  compiled = {s.name: harness.compile_setting(s, pair, batches) for s in settings}
  passes = {T5X: t5x_greedy_pass(t5x, pair.target_config, pair.params['target'], batches),
            **{name: c.one_pass for name, c in compiled.items()}}
  decodes = {name: harness.collect(outputs, count)['decodes']
             for name, outputs in harness.warm(passes).items()}
  times = policy.round_robin(passes, args.rounds)
  speedups = harness.speedups(times, T5X)
  rows = []
  for name in passes:
    rows.append({'name': name, 'ms_per_sentence': harness.ms_per(times[name], count),
                 'speedup_vs_t5x': speedups[name]['speedup'],
                 'range': [speedups[name]['speedup_min'], speedups[name]['speedup_max']],
                 'same_as_t5x': float(np.mean(np.all(decodes[name] == decodes[T5X], axis=1))),
                 **(compiled[name].info() if name in compiled else {})})
    r = rows[-1]
    print(f"batch {batch_size} {name}: {r['ms_per_sentence']:.1f} ms/sentence, "
          f"{r['speedup_vs_t5x']:.2f}x T5X ({r['range'][0]:.2f}-{r['range'][1]:.2f}), same as "
          f"T5X {r['same_as_t5x']:.0%}" + (f", batches per gamma {r['gammas_used']}"
                                           if 'gammas_used' in r else ''), flush=True)
  return {'sentences': count, 'rows': rows}


def markdown(results: Mapping[str, Any]) -> str:
  lines = harness.heading("This project's decoders against T5X's greedy decoder", results)
  for batch_size, block in results['batches'].items():
    lines += [f"## Batch {batch_size} ({block['sentences']} sentences)", '']
    lines += harness.table(
        ('configuration', 'ms/sentence', 'speedup vs T5X', 'range over rounds', 'same as T5X'),
        [[r['name'], f"{r['ms_per_sentence']:.1f}", f"{r['speedup_vs_t5x']:.2f}x",
          f"{r['range'][0]:.2f}-{r['range'][1]:.2f}", f"{r['same_as_t5x']:.0%}"]
         for r in block['rows']]) + ['']
    lines += [harness.auto_note(r) for r in block['rows'] if 'gammas_used' in r] + ['']
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  args = harness.parser(__doc__, sentences='1:40,8:80', gammas='2,auto',
                        rounds=5).parse_args(argv)
  t5x = import_t5x()
  settings = harness.greedy_settings(args.gammas)
  sources, _ = harness.test_split(args.data_dir)
  results = {'meta': harness.meta(NAME, argv, args), 'batches': {}}
  for batch_size, count in harness.parse_sentences(args.sentences).items():
    results['batches'][str(batch_size)] = batch_block(t5x, settings, batch_size,
                                                      sources[:count], args)
    paths = harness.write_results(args, NAME, results, markdown)
  print('wrote', *paths)
  return results


if __name__ == '__main__':
  main()
