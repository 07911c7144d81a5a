"""Does timing the step probes in a round change the loops' ranking? T=1, batch 8, 96 captions.

A one-off check, run at the calibration code before its probes got their own rounds: rounds
alternate, the odd ones running the calibration's step probes before the loops of gamma 0..4,
the even ones the loops alone. Usage (from the repository root, the data folder set):
  python results/cpu/policy_paired/probes_in_rounds.py [BATCH [ROUNDS_EACH]]
then analyse.py on the JSON it writes."""
import json, sys, time
import numpy as np, jax
from speculative_t5x import calibrate, pipeline, data, policy
B = int(sys.argv[1]) if len(sys.argv) > 1 else 8
R = int(sys.argv[2]) if len(sys.argv) > 2 else 12
texts = data.load_split('test')[0][:96]
pair = pipeline.load_pair(str(pipeline.EMBEDDED_TARGET), str(pipeline.EMBEDDED_DRAFT))
pipe = pipeline.Pipeline(pair, batch_size=B, max_output_length=calibrate.OUTPUT_LENGTH)
widths = [b['encoder_input_tokens'].shape[1] for b in pipe.batches(texts)]
calls = calibrate.probes(pair, B, 4, int(np.median(widths)), trees=[(3, 1), (2, 1, 1, 1)])
gammas = [0, 1, 2, 3, 4]
decodes = {g: [] for g in gammas}
passes = {}
for g in gammas:
  name, kw = calibrate._decoder(g, 1.0)
  pipe.compile(texts, name, **kw)
  passes[g] = calibrate._loop_pass(pipe, texts, name, kw, decodes[g], True)
  passes[g]()
for c, _ in calls.values():
  jax.block_until_ready(c())
rows = []
for r in range(2 * R + 1):
  with_probes = r % 2 == 1
  if with_probes:
    for c, _ in calls.values():
      jax.block_until_ready(c())
  for g in gammas:
    t0 = time.perf_counter(); d = passes[g](); jax.block_until_ready(d.tokens); dt = time.perf_counter() - t0
    pos = calibrate._counts(d, B)['positions']
    rows.append(dict(round=r, probes=with_probes, gamma=g, s=dt, positions=pos))
  print(r, with_probes, [f"{x['s']*1e3/x['positions']:.3f}" for x in rows[-5:]], flush=True)
json.dump(rows, open(f'probes_in_rounds_b{B}.json', 'w'))
rows = [x for x in rows if x['round'] > 0]
for wp in (False, True):
  med = {g: np.median([x['s'] * 1e3 / x['positions'] for x in rows if x['gamma'] == g and x['probes'] == wp]) for g in gammas}
  summ = {g: sum(x['s'] for x in rows if x['gamma'] == g and x['probes'] == wp) * 1e3 / sum(x['positions'] for x in rows if x['gamma'] == g and x['probes'] == wp) for g in gammas}
  print('probes' if wp else 'no probes', 'median ms/pos', {g: round(v, 3) for g, v in med.items()}, 'summed', {g: round(v, 3) for g, v in summ.items()})
