"""The recipes in scripts/: each runs as its header says (their smallest settings, or the
commands they would run, checked against the programs that take them).

scripts/train_pair.sh is checked in tests/test_gin_configs.py (its stages' gin files) and
scripts/accelerator_check.sh in tests/test_scale.py (it runs there on tiny configs);
scripts/device_run.sh runs here on tiny configs (TINY=1)."""

import importlib
import json
import os
import pathlib
import shlex
import subprocess
import sys
from typing import Dict, List

import pytest

from conftest import data_dir

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / 'scripts'


def _script(name: str, *args: str, **env: str) -> subprocess.CompletedProcess:
  return subprocess.run(['bash', str(SCRIPTS / name), *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=120,
                        env={**os.environ, 'PYTHON': sys.executable, **env})


def _commands(proc: subprocess.CompletedProcess) -> List[List[str]]:
  assert proc.returncode == 0, proc.stderr
  return [shlex.split(line) for line in proc.stdout.splitlines()]


def test_reproduce_results_runs_each_benchmark_with_flags_it_takes(tmp_path):
  commands = _commands(_script('reproduce_results.sh', str(tmp_path), DRY_RUN='1'))
  names = [c[c.index('-m') + 1] for c in commands]
  assert names == ['speculative_t5x.calibrate'] * 3 + ['benchmarks.speed'] * 4 + [
      'benchmarks.verifiers', 'benchmarks.vs_ctranslate2'] + ['benchmarks.drafts'] * 3 + [
      'benchmarks.speed', 'benchmarks.policy_sim', 'benchmarks.policy_sim']  # vs_t5x: T5X_PYTHON
  written = []
  for name, command in zip(names, commands):
    argv = command[command.index('-m') + 2:]
    assert argv[-2] in ('--out_dir', '--output_dir') and argv[-1].startswith(f'{tmp_path}/')
    assert argv[-1] not in written  # each run its own folder
    if '--calibration' in argv:  # an earlier run writes it; a benchmark loads it when parsing
      i = argv.index('--calibration')
      assert str(pathlib.Path(argv[i + 1]).parent) in written[:3], argv[i + 1]
      del argv[i:i + 2]
    written.append(argv[-1])
    importlib.import_module(name).parse_args(argv)  # a flag the program does not take exits here


def test_reproduce_results_only_names_known_runs():
  proc = _script('reproduce_results.sh', DRY_RUN='1', ONLY='speed_greedy bogus')
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith("error: ONLY names 'bogus'; known: ")


def test_t5x_recipe_writes_the_pair_then_runs_t5x_infer_with_shipped_gin_files(tmp_path):
  write, infer = _commands(_script('t5x_infer.sh', str(tmp_path), DRY_RUN='1'))
  assert write[1:] == ['-m', 'speculative_t5x.t5x_adapter', f'--output_dir={tmp_path}/pair']
  assert infer[1:3] == ['-m', 't5x.infer']
  bindings: Dict[str, str] = dict(a[len('--gin.'):].split('=', 1) for a in infer
                                  if a.startswith('--gin.'))
  assert bindings['CHECKPOINT_PATH'] == f"'{tmp_path}/pair/checkpoint_0'"
  # T5X's gin finds these through the Python path; they ship as gin_configs/t5x/.
  ours = [a.split('=', 1)[1] for a in infer if a.startswith('--gin_file=speculative_t5x/')]
  assert len(ours) == 3
  for path in ours:
    assert (ROOT / 'gin_configs' / path[len('speculative_t5x/gin_configs/'):]).is_file(), path


def test_t5x_recipe_without_t5x_is_one_line(tmp_path):
  try:
    importlib.import_module('t5x.infer')
    pytest.skip('T5X is installed here')
  except ImportError:
    pass
  proc = _script('t5x_infer.sh', str(tmp_path))
  assert proc.returncode == 1 and not (tmp_path / 'pair').exists()
  assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
  assert proc.stderr.startswith('error: T5X is not installed')


def test_t5x_recipe_names_an_unknown_decoding_file():
  proc = _script('t5x_infer.sh', DECODING='greedy.gin', DRY_RUN='1')
  assert proc.returncode == 1
  assert proc.stderr.startswith('error: DECODING=greedy.gin is not one of gin_configs/t5x/')


@pytest.mark.parametrize('script', ['t5x_train_check.sh', 't5x_distill_check.sh'])
def test_t5x_check_without_t5x_is_one_line(tmp_path, script):
  env = {k: v for k, v in os.environ.items() if k != 'T5X_PYTHON'}
  proc = subprocess.run(['bash', str(SCRIPTS / script), str(tmp_path / 'out')],
                        cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
  assert proc.returncode == 1 and proc.stderr.strip().startswith('error: set T5X_PYTHON')
  assert not (tmp_path / 'out').exists()


def test_device_run_dry_runs_every_part_on_the_cpu(tmp_path):
  """scripts/device_run.sh with TINY=1: the XL parts on tiny configs (the fixed-acceptance loop,
  looped and unrolled, under XLA's defaults and with while loops in command buffers), then the
  embedded pair's parts where the test captions are."""
  parts = 'xl pair' if (data_dir() / 'multi30k').exists() else 'xl'
  proc = subprocess.run(['bash', str(SCRIPTS / 'device_run.sh')], cwd=ROOT, capture_output=True,
                        text=True, timeout=600,
                        env={**os.environ, 'PYTHON': sys.executable, 'OUT': str(tmp_path),
                             'TINY': '1', 'PARTS': parts})
  log = (tmp_path / 'log').read_text()
  names = ['xl_default', 'xl_while'] + (['pair_default', 'pair_while'] if 'pair' in parts else [])
  for name in names:
    assert f'== {name}: exit 0' in log, proc.stdout[-2000:]
  default = json.loads((tmp_path / 'xl_default' / 'accelerator.json').read_text())
  captured = json.loads((tmp_path / 'xl_while' / 'accelerator.json').read_text())
  assert default['meta']['alpha'] == 0.75
  assert '+WHILE' in captured['meta']['xla_flags'] and '+WHILE' not in default['meta']['xla_flags']
  assert set(default['blocks']['tiny b1']['loops']) == {
      'target-only', 'gamma 4 alpha 0.75', 'gamma 4 alpha 0.75 unrolled'}
  assert "the paper's formula" in (tmp_path / 'xl_default' / 'accelerator.md').read_text()
