"""XLA:TPU-compiled programs (`benchmarks.tpu`): the tiny pair compiled for a v5e topology when
libtpu is installed, the figures derived from a block, and one-line errors."""

import importlib.util

import pytest

from benchmarks import scale
from benchmarks import tpu

HAS_LIBTPU = importlib.util.find_spec('libtpu') is not None


def _program(seconds, ops=10, mb=1.0):
  return {'optimal_seconds': seconds, 'ops': ops, 'bytes_accessed': mb * 1e6}


def _block():
  """A block at gamma 2 (verify calls up to 3 tokens) whose programs' estimates are given:
  target step 100 us, verify 105 us, draft 5 us, prefill 50 us, iterations 104 / 125 us."""
  target = {'target 1': _program(100e-6), 'target 2': _program(102e-6),
            'target 3': _program(105e-6, ops=12), 'iteration 0 0': _program(104e-6, ops=15),
            'iteration 0 1': _program(104e-6, ops=15)}
  draft = {'draft 1': _program(5e-6, ops=4), 'draft 2': _program(5e-6, ops=4),
           'prefill': _program(50e-6), 'iteration 2 0': _program(125e-6, ops=30, mb=5.0),
           'iteration 2 1': _program(125e-6, ops=30, mb=5.0)}
  return {'batch': 1, 'gamma': 2, 'max_gamma': 2, 'output_length': 16, 'target': target,
          'drafts': {'small': {'programs': draft}}}


def test_loop_figures_and_predicted_speedup_from_estimates():
  b = _block()
  f = tpu.loop_figures(b, 'small', 'greedy')
  assert f['c'] == pytest.approx(0.05) and f['verify'] == pytest.approx(1.05)
  assert f['speculative_overhead'] == pytest.approx((125 - 105 - 2 * 5) / 100)
  assert f['target_only_overhead'] == pytest.approx(0.04)
  assert f['speculative_ops'] == 30 - 12 - 2 * 4 and f['target_only_ops'] == 5
  assert f['speculative_mb'] == pytest.approx(5.0 - 3.0)
  gamma, speedup = tpu.predicted(b, 'small', 'greedy', 0.75)
  # gamma 2: (1 - 0.75^3) / 0.25 tokens per 125 us, against 104 us a token; the prefill's
  # 50 us spread over 16 positions in both.
  assert gamma == 2
  expected = (104 + 50 / 16) / (125 / ((1 - 0.75 ** 3) / 0.25) + 50 / 16)
  assert speedup == pytest.approx(expected)


def test_an_unknown_topology_is_one_line():
  with pytest.raises(SystemExit, match=r'^error: XLA:TPU cannot describe topology .v9:2x2.'):
    scale.main(['--platform', 'tpu', '--topology', 'v9:2x2', '--tiny'])


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install 'jax[tpu]==<jax "
                    "version>' in a venv of its own)")
def test_tiny_pair_compiles_for_v5e(tmp_path):
  results = scale.main(['--platform', 'tpu', '--tiny', '--topology', 'v5e:2x2', '--batches', '1',
                        '--gamma', '2', '--max_gamma', '2', '--drafts', 'small-dec2',
                        '--out_dir', str(tmp_path)])
  b = results['blocks']['v5e:2x2 tiny 1x4 b1']
  assert b['device_kind'] == 'TPU v5 lite' and b['target_predict']['fit']['fits']
  d = b['drafts']['small-dec2']
  assert set(b['target']) == {'target 1', 'target 2', 'target 3', 'iteration 0 0',
                              'iteration 0 1'}
  assert set(d['programs']) == {'draft 1', 'draft 2', 'prefill', 'iteration 2 0',
                                'iteration 2 1'}
  for program in list(b['target'].values()) + list(d['programs'].values()):
    assert 0 < program['optimal_seconds'] < 1  # straight-line: XLA:TPU's estimate, corrected
  assert d['predict']['loops']['host_transfers'] == 0
  assert 'speedup the estimates predict' in (tmp_path / 'tpu.md').read_text()
