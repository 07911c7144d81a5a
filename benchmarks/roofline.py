"""A roofline projection of `benchmarks.scale`'s per-device figures onto TPU v4, TPU v5e and H100.

A step of a decoding loop is projected as

  max(flops / peak bf16 FLOP/s, bytes accessed / HBM bandwidth)
    + sum over its collectives of (latency + bytes on the wire / interconnect bandwidth)

with the flops, bytes accessed and collectives of the step program compiled alone for one
device of the mesh (`benchmarks.scale`). Bytes on the wire of a ring over n devices: all-reduce
2 (n - 1) / n of the result, all-gather (n - 1) / n, anything else the result. Speculative
decoding's time per token is one iteration (the draft's first call feeds 2 tokens, the others 1,
then one verify call of gamma + 1 tokens) over the expected tokens per iteration at acceptance
alpha, (1 - alpha^(gamma + 1)) / (1 - alpha) (Leviathan et al. 2023, eq. 1); target-only
spends one 1-token step per token. Loop overhead, the encoder and the host are left out.

The bytes are what the step has to read on an accelerator (`benchmarks.scale.step_memory`:
its weights and caches per device) where the block records them, else XLA:CPU's bytes
accessed, which count the float32 copies of bfloat16 operands that the CPU backend makes.

Vendor figures (peak dense bf16, HBM bandwidth, per-chip interconnect bandwidth) are cited in
docs/scale.md; the per-collective latency is an assumption, stated there.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from speculative_t5x import costs

HARDWARE = {
    # name: peak bf16 FLOP/s (dense), HBM bytes/s, HBM bytes, interconnect bytes/s per chip,
    # assumed latency of one small collective (s).
    'TPU v4': {'flops': 275e12, 'hbm': 1200e9, 'hbm_bytes': 32 * 2**30, 'ici': 300e9,
               'latency': 5e-6},
    'TPU v5e': {'flops': 197e12, 'hbm': 819e9, 'hbm_bytes': 16e9, 'ici': 200e9,
                'latency': 5e-6},
    'H100 SXM': {'flops': 989e12, 'hbm': 3.35e12, 'hbm_bytes': 80e9, 'ici': 450e9,
                 'latency': 10e-6},
    # For benchmarks.accelerator on an H200 (not part of the projection tables).
    'H200': {'flops': 989e12, 'hbm': 4.8e12, 'hbm_bytes': 141e9, 'ici': 450e9, 'latency': 10e-6},
}
PROJECTED = ('TPU v4', 'TPU v5e', 'H100 SXM')
# device_kind substrings (lower case, spaces removed) of each entry.
DEVICE_KINDS = {'TPU v4': ('tpuv4',), 'TPU v5e': ('tpuv5e', 'tpuv5lite'), 'H100 SXM': ('h100',),
                'H200': ('h200',)}
# Leviathan et al. 2023, Table 2: T5-XXL (11B) target, T5-small draft, WMT EnDe, TPU v4, batch 1.
PAPER = {'greedy': {'alpha': 0.75, 'gamma': 7, 'speedup': 3.4},
         'sampling': {'alpha': 0.62, 'gamma': 7, 'speedup': 2.6}}
_SHORT = {'all-reduce': 'AR', 'all-gather': 'AG', 'reduce-scatter': 'RS', 'all-to-all': 'A2A',
          'collective-permute': 'CP', 'collective-broadcast': 'CB'}


def collective_text(collectives: Mapping[str, Mapping[str, int]]) -> str:
  """'AR 75 (2.3 MB), AG 32 (0.4 MB)' or '0'."""
  if not collectives:
    return '0'
  return ', '.join(f"{_SHORT.get(k, k)} {v['count']} ({v['bytes'] / 1e6:.2g} MB)"
                   for k, v in sorted(collectives.items()))


def add_collectives(*parts: Mapping[str, Mapping[str, int]], times: Sequence[int] = ()
                    ) -> Dict[str, Dict[str, int]]:
  """Sum of collective tables, part i counted times[i] times (default once)."""
  out: Dict[str, Dict[str, int]] = {}
  for i, part in enumerate(parts):
    n = times[i] if i < len(times) else 1
    for kind, v in part.items():
      entry = out.setdefault(kind, {'count': 0, 'bytes': 0})
      entry['count'] += n * v['count']
      entry['bytes'] += n * v['bytes']
  return out


def wire_seconds(collectives: Mapping[str, Mapping[str, int]], group: int,
                 hw: Mapping[str, float]) -> float:
  """Latency plus bandwidth time of a step's collectives over a group of `group` devices."""
  if group <= 1:
    return 0.0
  factor = {'all-reduce': 2 * (group - 1) / group, 'all-gather': (group - 1) / group}
  return sum(v['count'] * hw['latency'] + factor.get(k, 1.0) * v['bytes'] / hw['ici']
             for k, v in collectives.items())


def step_seconds(step: Mapping[str, Any], group: int, hw: Mapping[str, float],
                 memory_bytes: Optional[float] = None) -> float:
  """Projected seconds of one step program (see the module docstring); `memory_bytes` replaces
  the program's own bytes accessed (`benchmarks.scale.step_memory`: what an accelerator reads)."""
  memory = step['bytes_accessed'] if memory_bytes is None else memory_bytes
  return (max(step['flops'] / hw['flops'], memory / hw['hbm']) +
          wire_seconds(step.get('collectives', {}), group, hw))


def read_bytes(parts: Optional[Mapping[str, int]], t5x: bool = False) -> Optional[float]:
  """Bytes one step reads, from `step_memory`'s parts: this project's step reads the
  cross-attention cache; T5X's reads the encoder output and the cross key/value kernels."""
  if parts is None:
    return None
  if t5x:
    return parts['weights'] + parts['cross_kv_weights'] + parts['self_cache'] + parts['encoded']
  return parts['weights'] + parts['self_cache'] + parts['cross_cache']


def project(block: Mapping[str, Any], hw: Mapping[str, float], alpha: float, gamma: int,
            placement: str, t5x_step: Optional[Mapping[str, Any]] = None) -> Dict[str, float]:
  """Step times (ms) and speedups of one block on `hw` at acceptance alpha and gamma."""
  # The loop's collectives run over 'model' (tensor parallelism); on a mesh without it, over
  # 'data' (the per-row cache writes: see docs/scale.md).
  group = block['mesh'][1] if block['mesh'][1] > 1 else block['mesh'][0]
  steps = block['steps']
  if f'draft_{placement}' not in steps:  # a mesh without 'model': one placement compiled
    placement = next(k for k in steps if k.startswith('draft_'))[len('draft_'):]
  draft = steps[f'draft_{placement}']
  memory = block.get('step_memory', {})
  target_bytes = read_bytes(memory.get('target'))
  draft_bytes = read_bytes(memory.get(f'draft_{placement}'))
  target_1 = step_seconds(steps['target']['1'], group, hw, target_bytes)
  verify = step_seconds(steps['target'][str(gamma + 1)], group, hw, target_bytes)
  draft_1 = step_seconds(draft['1'], group, hw, draft_bytes)
  iteration = step_seconds(draft['2'], group, hw, draft_bytes) + (gamma - 1) * draft_1 + verify
  per_token = iteration / costs.expected_tokens(alpha, gamma)
  held = block.get('per_device', {})
  # Parameters of both models and both caches must fit the chip (temporaries come on top).
  resident = (held.get('params', {}).get('target', 0) +
              held.get('params', {}).get(f'draft_{placement}', 0) +
              held.get('cache', {}).get('target', 0) +
              held.get('cache', {}).get(f'draft_{placement}', 0))
  out = {'fits': resident <= hw['hbm_bytes'],
         'target_1_ms': 1e3 * target_1, 'verify_ms': 1e3 * verify, 'draft_ms': 1e3 * draft_1,
         'c': draft_1 / target_1, 'speculative_ms_per_token': 1e3 * per_token,
         'speedup': target_1 / per_token}
  if t5x_step is not None:
    t5x = step_seconds(t5x_step, group, hw, read_bytes(memory.get('target'), t5x=True))
    out.update(t5x_ms=1e3 * t5x, speedup_vs_t5x=t5x / per_token, target_vs_t5x=t5x / target_1)
  return out


def table_rows(blocks: Mapping[str, Mapping[str, Any]], t5x: Mapping[str, Any],
               gammas: Sequence[int], placement: str, setting: str = 'greedy'
               ) -> List[List[str]]:
  """One markdown row per (block, hardware, gamma): step times and predicted speedups."""
  alpha = PAPER[setting]['alpha']
  rows = []
  for key, block in blocks.items():
    t5x_step = t5x.get('blocks', {}).get(key, {}).get('steps', {}).get('1')
    for name in PROJECTED:
      hw = HARDWARE[name]
      for gamma in gammas:
        if str(gamma + 1) not in block['steps']['target']:
          continue
        p = project(block, hw, alpha, gamma, placement, t5x_step)
        rows.append([key, name + ('' if p['fits'] else ' (does not fit)'), str(gamma),
                     f"{p['target_1_ms']:.3f}", f"{p['verify_ms']:.3f}",
                     f"{p['draft_ms']:.3f}", f"{p['c']:.2f}", f"{p['speedup']:.2f}x",
                     f"{p['t5x_ms']:.3f}" if 't5x_ms' in p else '',
                     f"{p['speedup_vs_t5x']:.2f}x" if 'speedup_vs_t5x' in p else ''])
  return rows


HEADER = ('block', 'hardware', 'γ', 'target 1-token ms', 'target γ+1 ms', 'draft ms', 'c',
          'speculative / target-only', "T5X step ms", "speculative / T5X's loop")
