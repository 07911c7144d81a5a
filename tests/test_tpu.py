"""XLA:TPU-compiled programs (`benchmarks.tpu`): the tiny pair compiled for a v5e topology when
libtpu is installed, the figures derived from a block, and one-line errors."""

import importlib.util

import pytest

from benchmarks import scale
from benchmarks import tpu

HAS_LIBTPU = importlib.util.find_spec('libtpu') is not None


def _program(seconds, ops=10, bytes_accessed=1e6):
  return {'optimal_seconds': seconds, 'ops': ops, 'bytes_accessed': bytes_accessed}


def _block(step, verify, draft, iteration, base):
  """A block whose programs' estimates are given (seconds), at gamma 3."""
  return {'target_steps': {'1': _program(step), '4': _program(verify, ops=12)},
          'target_iterations': {'greedy': _program(base, ops=15)},
          'drafts': {'small': {'draft_steps': {'1': _program(draft, ops=4),
                                               '2': _program(draft, ops=4)},
                               'iterations': {'greedy 3': _program(iteration, ops=40)}}}}


def test_loop_figures_and_predicted_speedup_from_estimates():
  b = _block(step=100e-6, verify=110e-6, draft=5e-6, iteration=140e-6, base=104e-6)
  f = tpu.loop_figures(b, 'small', 'greedy', 3)
  assert f['c'] == pytest.approx(0.05) and f['verify'] == pytest.approx(1.1)
  assert f['overhead'] == pytest.approx((140 - 110 - 15) / 100)
  assert f['target_overhead'] == pytest.approx(0.04)
  assert f['ops_beyond'] == 40 - 12 - 3 * 4 and f['target_ops_beyond'] == 5
  gamma, speedup = tpu.predicted(b, 'small', 'greedy', 0.75)
  assert gamma == 3
  assert speedup == pytest.approx((1 - 0.75 ** 4) / 0.25 * 104 / 140)


def test_an_unknown_topology_is_one_line():
  with pytest.raises(SystemExit, match=r'^error: XLA:TPU cannot describe topology .v9:2x2.'):
    scale.main(['--platform', 'tpu', '--topology', 'v9:2x2', '--tiny'])


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install 'jax[tpu]==<jax "
                    "version>' in a venv of its own)")
def test_tiny_pair_compiles_for_v5e(tmp_path):
  results = scale.main(['--platform', 'tpu', '--tiny', '--topology', 'v5e:2x2', '--batches', '1',
                        '--gamma', '2', '--gammas', '2', '--drafts', 'small-dec2',
                        '--out_dir', str(tmp_path)])
  b = results['blocks']['v5e:2x2 tiny 1x4 b1']
  assert b['device_kind'] == 'TPU v5 lite' and b['target_predict']['fit']['fits']
  d = b['drafts']['small-dec2']
  for program in (b['target_steps']['1'], b['target_steps']['3'], d['draft_steps']['1'],
                  d['iterations']['greedy 2'], d['iterations']['t1 2'], d['prefill']):
    assert program['optimal_seconds'] > 0  # a straight-line program: XLA:TPU's estimate
  assert d['predict']['loops']['host_transfers'] == 0
  assert (tmp_path / 'tpu.md').exists()
