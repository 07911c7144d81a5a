"""The wheel carries what the README's commands need: weights, vocabulary, gin configs, sample,
console scripts; optional dependencies fail with one line naming their extra."""

import importlib.metadata
import pathlib
import subprocess
import sys
import zipfile

import pytest

import speculative_t5x
from speculative_t5x import gin_utils

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / 'speculative_t5x'


@pytest.fixture(scope='module')
def wheel(tmp_path_factory):
  out = tmp_path_factory.mktemp('wheel')
  # Without build isolation where this environment has pyproject.toml's setuptools (saves
  # fetching it); --no-deps: only this wheel.
  try:
    local_backend = int(importlib.metadata.version('setuptools').split('.')[0]) >= 64
  except importlib.metadata.PackageNotFoundError:
    local_backend = False
  flags = ['--no-build-isolation'] if local_backend else []
  result = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '-q', *flags, '-w',
                           str(out), str(REPO)], capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  wheels = list(out.glob('speculative_t5x-*.whl'))
  assert len(wheels) == 1, wheels
  return zipfile.ZipFile(wheels[0])


def test_wheel_carries_models_vocabulary_configs_and_sample(wheel):
  names = set(wheel.namelist())
  shipped = [p for pattern in ('pretrained/*.msgpack', 'vocab/*.model', 'gin_configs/**/*.gin',
                               'samples/*.txt') for p in PACKAGE.glob(pattern)]
  assert len([p for p in shipped if p.suffix == '.gin']) >= 25
  for path in shipped:
    name = path.relative_to(REPO).as_posix()
    assert name in names, f'{name} missing from the wheel'
    assert wheel.read(name) == path.read_bytes(), name
  assert not any(n.startswith(('tests/', 'scripts/', 'results/')) for n in names)


def test_wheel_declares_the_console_scripts(wheel):
  entry_points = next(n for n in wheel.namelist() if n.endswith('entry_points.txt'))
  text = wheel.read(entry_points).decode()
  for script, target in (('speculative-t5x-translate', 'speculative_t5x.translate:main'),
                         ('speculative-t5x-infer', 'speculative_t5x.infer:run'),
                         ('speculative-t5x-train', 'speculative_t5x.train:run')):
    assert f'{script} = {target}' in text


def test_packaged_paths_resolve_from_any_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert gin_utils.resolve_path('gin_configs/runs/infer_multi30k.gin') == (
      PACKAGE / 'gin_configs' / 'runs' / 'infer_multi30k.gin')
  assert gin_utils.resolve_path('speculative_t5x/vocab/multi30k_8k.model') == (
      PACKAGE / 'vocab' / 'multi30k_8k.model')
  # A file in the working directory wins over the packaged one; unknown paths come back as given.
  (tmp_path / 'gin_configs' / 'runs').mkdir(parents=True)
  (tmp_path / 'gin_configs' / 'runs' / 'infer_multi30k.gin').write_text('')
  assert gin_utils.resolve_path('gin_configs/runs/infer_multi30k.gin') == pathlib.Path(
      'gin_configs/runs/infer_multi30k.gin')
  assert gin_utils.resolve_path('nope/x.gin') == pathlib.Path('nope/x.gin')


def test_missing_extra_is_one_line_naming_it():
  with pytest.raises(speculative_t5x.MissingExtraError) as e:
    speculative_t5x.require('no_such_module_for_test', 'data', 'seqio tasks')
  message = str(e.value)
  assert '\n' not in message
  assert message.startswith("seqio tasks need: pip install 'speculative_t5x[data]'")
  assert speculative_t5x.require('json', 'data', 'unused').dumps(1) == '1'
