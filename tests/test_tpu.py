"""XLA:TPU-compiled programs without a TPU (`speculative_t5x.aot`, `benchmarks.scale --platform
tpu`, the compile-only calibration): the tiny pair and the embedded pair compiled for a v5e
topology when libtpu is installed; the figures derived from estimates, and one-line errors,
always."""

import importlib.util

import pytest

from benchmarks import scale
from speculative_t5x import aot
from speculative_t5x import calibrate
from speculative_t5x import costs

HAS_LIBTPU = importlib.util.find_spec('libtpu') is not None


def _program(seconds, cycles, ops=10, mb=1.0):
  return {'optimal_seconds': seconds, 'cycles': cycles, 'ops': ops, 'bytes_accessed': mb * 1e6}


def _block():
  """A block at gamma 2 whose programs' estimates are given: by optimal_seconds target step
  100 us, verify 105 us, draft 5 us, iterations 104 / 125 us; by cycles 1000, 1050, 60, 1040,
  1300 (the iteration's own work: 1300 - 1050 - 2 x 60 = 130 cycles, 13% of a step)."""
  target = {'target 1': _program(100e-6, 1000), 'target 3': _program(105e-6, 1050, ops=12),
            'iteration 0 0': _program(104e-6, 1040, ops=15),
            'iteration 0 1': _program(104e-6, 1040, ops=15)}
  draft = {'draft 1': _program(5e-6, 60, ops=4), 'draft 2': _program(5e-6, 60, ops=4),
           'prefill': _program(50e-6, 500),
           'iteration 2 0': _program(125e-6, 1300, ops=30, mb=5.0),
           'iteration 2 1': _program(125e-6, 1300, ops=30, mb=5.0)}
  return {'batch': 1, 'gamma': 2, 'output_length': 16, 'target': target,
          'drafts': {'small': {'programs': draft}}}


def test_loop_figures_and_predicted_speedup_from_estimates():
  b = _block()
  f = scale.loop_figures(b, 'small', 'greedy')
  assert f['c optimal_seconds'] == pytest.approx(0.05) and f['c cycles'] == pytest.approx(0.06)
  assert f['verify optimal_seconds'] == pytest.approx(1.05)
  assert f['speculative_overhead'] == pytest.approx(0.13)
  assert f['target_only_overhead'] == pytest.approx(0.04)
  assert f['speculative_ops'] == 30 - 12 - 2 * 4 and f['target_only_ops'] == 5
  assert f['speculative_mb'] == pytest.approx(5.0 - 3.0)
  tokens = (1 - 0.75 ** 3) / 0.25
  assert scale.predicted(b, 'small', 'greedy', 0.75, 'optimal_seconds') == (
      2, pytest.approx(tokens * 104 / 125))
  assert scale.predicted(b, 'small', 't1', 0.75, 'cycles') == (
      2, pytest.approx(tokens * 1040 / 1300))


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
  assert set(b['target']) == {'target 1', 'target 3', 'iteration 0 0', 'iteration 0 1'}
  assert set(d['programs']) == {'draft 1', 'draft 2', 'prefill', 'iteration 2 0',
                                'iteration 2 1'}
  for program in list(b['target'].values()) + list(d['programs'].values()):
    assert 0 < program['optimal_seconds'] < 1  # straight-line: XLA:TPU's estimate, corrected
    assert program['cycles'] > 0
  assert d['predict']['loops']['host_transfers'] == 0
  assert 'speedup the estimates predict' in (tmp_path / 'tpu.md').read_text()


def test_step_costs_from_estimates():
  """Steps as estimated; every gamma's prediction corrected to its own iteration's estimate."""
  seconds = {'target 1': 100e-6, 'target 2': 101e-6, 'target 3': 103e-6, 'draft 1': 5e-6,
             'draft 2': 6e-6, 'prefill': 40e-6, 'iteration 0 1': 104e-6,
             'iteration 1 1': 110e-6, 'iteration 2 1': 112e-6}
  model = aot.step_costs(seconds, batch=8, max_gamma=2, temperature=1.0)
  assert model.batch_size == 8 and model.max_gamma == 2
  assert model.target_ms == pytest.approx({1: 0.1, 2: 0.101, 3: 0.103})
  assert model.draft_ms == pytest.approx({1: 0.005, 2: 0.006}) and model.batch_ms == 0.04
  assert model.corrections == pytest.approx({0: 1.04, 1: 0.110 / 0.107, 2: 0.112 / 0.114})
  for gamma in range(3):  # per token at acceptance 0: one iteration, as estimated
    assert model.ms_per_position(gamma, 0.0) == pytest.approx(
        seconds[f'iteration {gamma} 1'] * 1e3)


@pytest.mark.parametrize('flags', [['--alpha', '0.9'], ['--mesh', '1x4'],
                                   ['--topology', 'v5e:2x2', '--beam_size', '4'],
                                   ['--topology', 'v5e:2x2', '--alpha', '1.5']])
def test_compile_only_flags_are_checked(tmp_path, flags, capsys):
  with pytest.raises(SystemExit):
    calibrate.parse_args(['--output_dir', str(tmp_path)] + flags)
  assert 'error:' in capsys.readouterr().err


@pytest.mark.skipif(not HAS_LIBTPU, reason='libtpu not installed')
def test_compile_only_calibration_schedules_from_xla_tpu(tmp_path):
  results = calibrate.main(['--topology', 'v5e:2x2', '--alpha', '0.9', '--batch_sizes', '1',
                            '--max_gamma', '2', '--input_length', '16', '--output_dir',
                            str(tmp_path)])
  block = results['batch_sizes'][1]
  assert set(block['predicted_ms_per_position']) == {0, 1, 2}
  assert all(0 < v < 1 for v in block['predicted_ms_per_position'].values())
  loaded = costs.load_calibration(tmp_path / 'calibration.json')
  assert loaded.schedule[1] == block['best'] and loaded.alphas[1] == 0.9
  assert 'gamma_schedule = {1: ' in (tmp_path / 't5x_schedule.gin').read_text()
  assert 'Compile-only' in (tmp_path / 'calibration.md').read_text()


def test_a_program_that_does_not_fit_is_one_line():
  message = ('RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO '
             'temporaries (15.48G) exceeds available HBM (15.25G).')

  def build():
    raise RuntimeError('jax.errors.JaxRuntimeError\n' + message + '\nmore detail')

  with pytest.raises(aot.DoesNotFit, match=r'^Ran out of memory on HBM.*\(15\.25G\)\.$'):
    aot.compile_program(build)
  with pytest.raises(ValueError):  # anything else is not a fit
    aot.compile_program(lambda: (_ for _ in ()).throw(ValueError('bad shape')))
  results = {'meta': {'command': 'c', 'machine': 'm', 'libtpu': 'x', 'input_length': 512,
                      'output_length': 128, 'param_dtype': 'bfloat16', 'gamma': 4},
             'blocks': {'v4:1x1x1 xxl 1x2 b32': {'does_not_fit': message[20:]}}}
  text = scale.markdown(results)
  assert '| v4:1x1x1 xxl 1x2 b32 |  | does not fit: Ran out of memory' in text
