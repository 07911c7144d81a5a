"""The wheel carries what the README's commands need: weights, vocabulary, gin configs, sample,
console scripts; optional dependencies fail with one line naming their extra."""

import importlib.metadata
import importlib.util
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

import speculative_t5x
from speculative_t5x import gin_utils

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / 'speculative_t5x'
CONFIGS = REPO / 'gin_configs'  # shipped as speculative_t5x/gin_configs (setup.py's package_dir)


# Not sources: pip builds a folder in place, and setuptools packs whatever its build/lib already
# holds, so a build left there would keep shipping a file that setup.py no longer includes.
_NOT_SOURCES = ('.git', 'build', 'dist', 'runs', 'out', '.pytest_cache')


def _ignore_non_sources(folder, names):
  ignored = {n for n in names if n == '__pycache__' or n.endswith('.egg-info')}
  if pathlib.Path(folder) == REPO:
    ignored |= {n for n in names if n in _NOT_SOURCES or 'venv' in n}
  return ignored


@pytest.fixture(scope='module')
def wheel(tmp_path_factory):
  source = tmp_path_factory.mktemp('source') / 'speculative_t5x'
  shutil.copytree(REPO, source, ignore=_ignore_non_sources)
  out = tmp_path_factory.mktemp('wheel')
  # Without build isolation where this environment has pyproject.toml's setuptools (saves
  # fetching it); --no-deps: only this wheel.
  try:
    local_backend = int(importlib.metadata.version('setuptools').split('.')[0]) >= 64
  except importlib.metadata.PackageNotFoundError:
    local_backend = False
  flags = ['--no-build-isolation'] if local_backend else []
  result = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '-q', *flags, '-w',
                           str(out), str(source)], capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  wheels = list(out.glob('speculative_t5x-*.whl'))
  assert len(wheels) == 1, wheels
  return zipfile.ZipFile(wheels[0])


def test_wheel_carries_models_vocabulary_configs_and_sample(wheel):
  names = set(wheel.namelist())
  shipped = {}  # name in the wheel -> file in the clone
  for pattern in ('pretrained/*.msgpack', 'pretrained/*.json', 'vocab/*.model', 'samples/*.txt'):
    found = list(PACKAGE.glob(pattern))
    assert found, pattern
    shipped.update({path.relative_to(REPO).as_posix(): path for path in found})
  # The configs and the __init__.py files that make them packages for gin's Python-path reader.
  configs = [p for p in CONFIGS.glob('**/*') if p.suffix == '.gin' or p.name == '__init__.py']
  assert len([p for p in configs if p.suffix == '.gin']) >= 25
  assert CONFIGS / 't5x' / '__init__.py' in configs
  shipped.update({f'speculative_t5x/gin_configs/{path.relative_to(CONFIGS).as_posix()}': path
                  for path in configs})
  for name, path in shipped.items():
    assert name in names, f'{name} missing from the wheel'
    assert wheel.read(name) == path.read_bytes(), name
  assert not any(n.startswith(('gin_configs/', 'tests/', 'scripts/', 'benchmarks/', 'results/',
                               '.ci/')) for n in names)


def test_wheel_declares_the_console_scripts(wheel):
  entry_points = next(n for n in wheel.namelist() if n.endswith('entry_points.txt'))
  text = wheel.read(entry_points).decode()
  for script, target in (('speculative-t5x-translate', 'speculative_t5x.translate:main'),
                         ('speculative-t5x-infer', 'speculative_t5x.infer:run'),
                         ('speculative-t5x-train', 'speculative_t5x.train:run')):
    assert f'{script} = {target}' in text


def test_packaged_paths_resolve_from_any_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # outside the repository
  assert gin_utils.GIN_CONFIGS_DIR == CONFIGS
  for name in ('gin_configs/runs/infer.gin', 'speculative_t5x/gin_configs/runs/infer.gin'):
    assert gin_utils.resolve_path(name) == CONFIGS / 'runs' / 'infer.gin', name
  assert gin_utils.resolve_path('speculative_t5x/vocab/multi30k_8k.model') == (
      PACKAGE / 'vocab' / 'multi30k_8k.model')
  # A file in the working directory wins over the packaged one; unknown paths come back as given.
  (tmp_path / 'gin_configs' / 'runs').mkdir(parents=True)
  (tmp_path / 'gin_configs' / 'runs' / 'infer_multi30k.gin').write_text('')
  assert gin_utils.resolve_path('gin_configs/runs/infer_multi30k.gin') == pathlib.Path(
      'gin_configs/runs/infer_multi30k.gin')
  for name in ('nope/x.gin', 'gin_configs/nope.gin'):
    assert gin_utils.resolve_path(name) == pathlib.Path(name)


def test_wheel_layout_resolves_configs_inside_the_package(wheel, tmp_path, monkeypatch):
  """The wheel's own gin_utils, unpacked (not installed: this process already imported the
  clone's package), finds speculative_t5x/gin_configs/ from outside both, and prefers it to a
  top-level gin_configs/ beside the package (site-packages may hold another project's)."""
  site = tmp_path / 'site'
  wheel.extractall(site)
  (site / 'gin_configs' / 'runs').mkdir(parents=True)
  (site / 'gin_configs' / '__init__.py').write_text('')
  (site / 'gin_configs' / 'runs' / 'infer.gin').write_text('')
  spec = importlib.util.spec_from_file_location(
      'wheel_gin_utils', site / 'speculative_t5x' / 'gin_utils.py')
  wheel_gin_utils = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(wheel_gin_utils)
  configs = site / 'speculative_t5x' / 'gin_configs'
  monkeypatch.chdir(tmp_path)
  assert wheel_gin_utils.GIN_CONFIGS_DIR == configs.resolve()
  resolved = wheel_gin_utils.resolve_path('gin_configs/runs/infer.gin')
  assert resolved == configs.resolve() / 'runs' / 'infer.gin'
  assert resolved.read_bytes() == (CONFIGS / 'runs' / 'infer.gin').read_bytes()


def test_t5x_package_paths_find_the_configs_through_the_python_path(tmp_path, monkeypatch):
  """T5X's CLI includes 'speculative_t5x/gin_configs/t5x/...': gin imports the folder as a
  package, which the editable install maps to the clone's gin_configs/ (setup.py's package_dir)."""
  from gin import resource_reader  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(tmp_path)
  assert resource_reader.system_path_file_exists(
      'speculative_t5x/gin_configs/t5x/vocab_multi30k.gin'), (
          'not found through the Python path: a clone needs `pip install -e .`')
  origin = pathlib.Path(importlib.util.find_spec('speculative_t5x.gin_configs.t5x').origin)
  assert origin == CONFIGS / 't5x' / '__init__.py'


def test_missing_extra_is_one_line_naming_it():
  with pytest.raises(speculative_t5x.MissingExtraError) as e:
    speculative_t5x.require('no_such_module_for_test', 'data', 'seqio tasks')
  message = str(e.value)
  assert '\n' not in message
  assert message.startswith("seqio tasks need: pip install 'speculative_t5x[data]'")
  assert speculative_t5x.require('json', 'data', 'unused').dumps(1) == '1'
