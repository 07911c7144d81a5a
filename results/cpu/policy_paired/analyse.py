"""Paired speedups over gamma 0 (per round, then geometric mean and median over rounds) in the
rounds with and without the probes: python analyse.py probes_in_rounds_b8.json"""
import json, sys, numpy as np
rows = [x for x in json.load(open(sys.argv[1])) if x['round'] > 0]
G = sorted({x['gamma'] for x in rows})
for wp in (False, True):
  rs = sorted({x['round'] for x in rows if x['probes'] == wp})
  m = np.array([[np.log(next(x['s'] / x['positions'] for x in rows if x['round'] == r and x['gamma'] == g)) for g in G] for r in rs])
  rel = m - m[:, :1]  # vs gamma 0
  mean, se = rel.mean(0), rel.std(0, ddof=1) / np.sqrt(len(rs))
  print('probes' if wp else 'no probes', 'n', len(rs), 'speedup over g0 (paired, geo mean):', ' '.join(f'g{g} {np.exp(-a):.3f}±{s:.3f}' for g, a, s in zip(G, mean, se)),
        '| median', ' '.join(f'{np.exp(-a):.3f}' for a in np.median(rel, 0)))
  pos = np.array([[next(x['positions'] for x in rows if x['round'] == r and x['gamma'] == g) for g in G] for r in rs])
  print('   positions per round mean', pos.mean(0).round(1), 'sd', pos.std(0).round(1))
