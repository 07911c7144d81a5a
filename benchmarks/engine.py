"""The engine's decode-time layouts against the previous ones: steps, encoder, whole decodes.

  python -m benchmarks.engine --sentences 1:64,8:128 --gammas 3 --rounds 5

Three preparations of the same embedded pair (`network.decode_variables`), each adding one
change to the one before:
  separate: the tied logits kernel pre-transposed, every projection its own matmul (the engine
    before the changes);
  draft vocabulary: also the draft's logits over the tokens it may propose only (the embedded
    draft's `checkpoints.load_draft_vocabulary`; what `pipeline.load_pair` and the infer job
    prepare);
  stacked: also q/k/v, the cross-attention k/v and the gated MLP's wi_0/wi_1 stacked into one
    matmul each, encoder and decoder (`with_decode_variables(fuse=True)`).
Per batch size, for each: the compiled while body of the target's 1-token and (gamma+1)-token
steps and the draft's 1-token step (top-level HLO instructions: fusions, library matmuls,
copies); those steps' times inside a jitted loop (`harness.step_loop`), the draft's cost ratio
c; the encoder at the batches' median width; greedy target-only and greedy speculative decoding
(each --gammas value) of the first test sentences. Every timed pass of a batch size, both
preparations, runs round-robin (see benchmarks.harness); speedups are medians over rounds of
separate's time over the layout's in the same round. Outputs are compared token for token.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Dict, List, Mapping, Optional, Sequence

import jax
import numpy as np

from benchmarks import compiled as hlo
from benchmarks import harness
from benchmarks.harness import Setting
from speculative_t5x import checkpoints
from speculative_t5x import data
from speculative_t5x import pipeline
from speculative_t5x import policy

NAME = 'engine'
LAYOUTS = ('separate', 'draft vocabulary', 'stacked')
STEPS_PER_CALL = 16
# The instruction kinds reported per step (the others are bookkeeping: parameters, tuples).
KINDS = ('fusion', 'dot', 'copy')


def while_body_counts(hlo_text: str) -> Dict[str, int]:
  """Top-level instructions of the (first) while body of a compiled program, by kind: XLA:CPU
  runs each as one kernel (a fusion, a library matmul, a copy, ...)."""
  module = hlo.Module.parse(hlo_text)
  _, body = module.whiles()[0]
  counts = collections.Counter(inst.opcode for inst in module.computations[body])
  skipped = ('parameter', 'get-tuple-element', 'constant', 'tuple', 'bitcast')
  kernels = {kind: counts[kind] for kind in KINDS}
  kernels['kernels'] = sum(n for kind, n in counts.items() if kind not in skipped)
  return kernels


def layouts(pair: pipeline.Pair) -> Dict[str, pipeline.Pair]:
  """{layout: the pair prepared so} (module docstring)."""
  vocabulary = checkpoints.load_draft_vocabulary(pipeline.EMBEDDED_DRAFT)
  return {'separate': harness.with_layouts(pair, False),
          'draft vocabulary': harness.with_layouts(pair, False, vocabulary),
          'stacked': harness.with_layouts(pair, True, vocabulary)}


def step_passes(pairs: Mapping[str, pipeline.Pair], batch: int, verify_k: int
                ) -> Dict[Any, Any]:
  """{(layout, step): (call, kernels)} for the target's 1-token and verify_k-token steps and the
  draft's 1-token step."""
  out = {}
  for layout, pair in pairs.items():
    for step, (name, k) in {'target k=1': ('target', 1), f'target k={verify_k}': (
        'target', verify_k), 'draft k=1': ('draft', 1)}.items():
      call, compiled = harness.step_loop(pair, name, batch, k, STEPS_PER_CALL)
      out[layout, step] = call, while_body_counts(compiled.as_text())
  return out


def encoder_passes(pairs: Mapping[str, pipeline.Pair], batch: harness.Batch) -> Dict[Any, Any]:
  """{(layout, 'encoders'): call}: both models' encoders and caches over one batch."""
  out = {}
  for layout, pair in pairs.items():
    model = pair.model()
    tokens = batch['encoder_input_tokens']

    @jax.jit
    def caches(params, tokens, model=model):
      return [model._init_cache(module, params[name], tokens, harness.OUTPUT_LENGTH,  # pylint: disable=protected-access
                                params['decode'][name])
              for name, module in (('target', model.module), ('draft', model.draft_module))]

    out[layout, 'encoders'] = functools.partial(caches, pair.params, tokens)
  return out


def decode_passes(pairs: Mapping[str, pipeline.Pair], settings: Sequence[Setting],
                  batches: List[harness.Batch]) -> Dict[Any, harness.Compiled]:
  return {(layout, s.name): harness.compile_setting(s, pair, batches)
          for layout, pair in pairs.items() for s in settings}


def batch_block(pairs: Mapping[str, pipeline.Pair], settings: Sequence[Setting], batch_size: int,
                sources: Sequence[str], args: Any) -> Dict[str, Any]:
  """Every pass of one batch size, both layouts, timed round-robin."""
  count = len(sources)
  batches = harness.make_batches(data.encode(sources, harness.INPUT_LENGTH), batch_size,
                                 args.input_length_step)
  widths = sorted(int(b['encoder_input_tokens'].shape[1]) for b in batches)
  verify_k = max(g for g in [1] + [s.gamma for s in settings if s.gamma]) + 1
  steps = step_passes(pairs, batch_size, verify_k)
  median_batch = next(b for b in batches
                      if b['encoder_input_tokens'].shape[1] == widths[len(widths) // 2])
  compiled = decode_passes(pairs, settings, batches)
  passes = {**{key: call for key, (call, _) in steps.items()},
            **encoder_passes(pairs, median_batch),
            **{key: c.one_pass for key, c in compiled.items()}}
  outputs = harness.warm(passes)
  times = policy.round_robin(passes, args.rounds)
  ms = lambda key, per: 1e3 * float(np.median(times[key])) / per
  rows = []
  for layout in pairs:
    row = {'layout': layout, 'kernels': {step: steps[layout, step][1]
                                         for _, step in steps if _ == layout}}
    row['step_ms'] = {step: ms((layout, step), STEPS_PER_CALL) for _, step in steps if _ == layout}
    row['c'] = row['step_ms']['draft k=1'] / row['step_ms']['target k=1']
    row['encoders_ms'] = ms((layout, 'encoders'), 1)
    row['ms_per_sentence'] = {s.name: ms((layout, s.name), count) for s in settings}
    rows.append(row)
  speedups = collections.defaultdict(dict)  # {pass: {layout: its speedup over separate}}
  for layout, what in passes:
    if layout != 'separate':
      speedups[what][layout] = harness.speedups(times, ('separate', what))[layout, what]
  decodes = {key: harness.collect(outputs[key], count)['decodes'] for key in compiled}
  reference = decodes['separate', settings[0].name]
  block = {'num_sentences': count, 'encoder_width': widths[len(widths) // 2], 'rows': rows,
           'over_separate': dict(speedups),
           'identical_outputs': all(np.array_equal(d, reference) for d in decodes.values())}
  for what, by_layout in speedups.items():
    print(f'batch {batch_size} {what} over separate: ' + ', '.join(
        f"{layout} {s_['speedup']:.3f}x ({s_['speedup_min']:.2f}-{s_['speedup_max']:.2f})"
        for layout, s_ in by_layout.items()), flush=True)
  return block


def markdown(results: Mapping[str, Any]) -> str:
  lines = harness.heading('The engine: decode-time layouts against the previous ones', results)
  for batch_size, block in results['batches'].items():
    rows = block['rows']
    steps = list(rows[0]['step_ms'])
    decoders = list(rows[0]['ms_per_sentence'])
    lines += [f"## Batch {batch_size} ({block['num_sentences']} sentences, encoder width "
              f"{block['encoder_width']}; outputs identical across layouts and decoders: "
              f"{block['identical_outputs']})", '']
    lines += harness.table(
        ['layout'] + [f'{s} ms' for s in steps] + ['c', 'encoders ms'] +
        [f'{d} ms/sentence' for d in decoders],
        [[r['layout']] + [f"{r['step_ms'][s]:.3f}" for s in steps] +
         [f"{r['c']:.3f}", f"{r['encoders_ms']:.2f}"] +
         [f"{r['ms_per_sentence'][d]:.2f}" for d in decoders] for r in rows]) + ['']
    lines += ['Kernels of one step (top-level instructions of the compiled while body: all, '
              'fusions, library matmuls, copies):', '']
    lines += harness.table(['layout'] + steps, [
        [r['layout']] + ['{kernels} ({fusion} / {dot} / {copy})'.format(**r['kernels'][s])
                         for s in steps] for r in rows]) + ['']
    others = [r['layout'] for r in rows[1:]]
    span = lambda s_: f"{s_['speedup']:.3f}x ({s_['speedup_min']:.2f}-{s_['speedup_max']:.2f})"
    lines += ['Speedup over separate (median over rounds, and its range):', '']
    lines += harness.table(['pass'] + others, [
        [what] + [span(by_layout[layout]) for layout in others]
        for what, by_layout in block['over_separate'].items()]) + ['']
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  args = harness.parser(__doc__, sentences='1:64,8:128', gammas='3', rounds=5).parse_args(argv)
  settings = harness.greedy_settings(args.gammas, auto=False)
  pairs = layouts(harness.load_pair())
  return harness.run_blocks(NAME, argv, args, lambda batch_size, sources: batch_block(
      pairs, settings, batch_size, sources, args), markdown)


if __name__ == '__main__':
  main()
