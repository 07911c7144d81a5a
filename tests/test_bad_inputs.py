"""Bad input to the infer job, the translate command and the benchmarks (a missing optional
dependency): one line `error: <cause>`, exit 1.

Each case runs the command's own main() in-process (its flags, its gin parsing, its error
handling), so the whole table costs seconds; tests/test_infer.py keeps the subprocess cases
that prove the same of a real process (no traceback on stderr, exit status 1).
"""

import math
import re
import shutil
import sys

import pytest

import speculative_t5x
from speculative_t5x import data
from speculative_t5x import gin_utils
from speculative_t5x import infer
from speculative_t5x import inputs
from speculative_t5x import translate
from speculative_t5x.errors import InferError
import conftest
import infer_hooks
from test_infer import _infer, _model, setup  # noqa: F401  (setup: a fixture)


def _run_infer(args, capsys):
  """(exit status, stderr) of `speculative-t5x-infer ARGS`, in this process."""
  return conftest.run_command(infer.main, infer._define_flags,  # pylint: disable=protected-access
                              'speculative-t5x-infer', args, capsys)


def _assert_one_error_line(status, err, expected):
  lines = [line for line in err.splitlines() if line.strip()]
  errors = [line for line in lines if line.startswith('error: ')]
  assert status == 1, (status, err[-2000:])
  assert len(errors) == 1 and lines[-1] == errors[0], err[-2000:]
  assert expected in errors[0], errors[0]
  assert 'Traceback' not in err and ' at 0x' not in errors[0], err[-2000:]


def _infer_args(setup, output_dir, input_file, *bindings, gin_files=()):
  return [f'--gin_file={setup / "tiny.gin"}', *[f'--gin_file={f}' for f in gin_files],
          f"--gin.INFER_OUTPUT_DIR='{output_dir}'", f"--gin.INPUT_FILE='{input_file}'",
          '--gin.infer_script.infer.progress=False', *bindings]


@pytest.fixture(scope='module')
def bad_files(setup, tmp_path_factory):  # noqa: F811
  """Inputs and checkpoints that are wrong in one way each."""
  root = tmp_path_factory.mktemp('bad')
  (root / 'empty.txt').write_bytes(b'')
  (root / 'blank.txt').write_text('\n   \n\t\n', encoding='utf-8')
  (root / 'binary.txt').write_bytes(b'Ein Hund\n\xff\xfe\x00\x01 rennt\n')
  (root / 'fields.tsv').write_text('Ein Hund.\tA dog.\textra\n', encoding='utf-8')
  (root / 'notab.tsv').write_text('Ein Hund.\tA dog.\nEine Katze.\n', encoding='utf-8')
  # A draft whose vocabulary file beside it is not a list of token ids.
  shutil.copytree(setup / 'draft', root / 'draft')
  (root / 'draft.vocabulary.json').write_text('{"token_ids": "all"}', encoding='utf-8')
  return root


INFER_CASES = {
    # name: (input file or None for the good one, extra bindings, gin files, expected text)
    'empty input': ('empty.txt', [], [], 'no examples to decode'),
    'blank input': ('blank.txt', [], [], 'no examples to decode'),
    'binary input': ('binary.txt', [], [], 'undecodable bytes'),
    'missing input': ('missing.txt', [], [], 'input file not found'),
    'extra TSV fields': ('fields.tsv', [], [], '3 tab-separated fields'),
    'TSV line without a tab': ('notab.tsv', [], [], 'notab.tsv:2: no tab; a TSV line is '
                               'input<TAB>target'),
    'gin value that never ends': (None, ['--gin.infer_script.infer.batch_size=[1'], [],
                                  "binding 'infer_script.infer.batch_size = [1'"),
    'unknown gin binding': (None, ['--gin.infer_script.infer.bogus=1'], [], 'bogus'),
    'gamma below 1': (None, ['--gin.decoding.speculative_sample.gamma=0'], [], 'gamma must be'),
    'negative temperature': (None, ['--gin.decoding.speculative_sample.temperature=-1.0'], [],
                             'temperature must be a number >= 0'),
    'negative topk': (None, ['--gin.decoding.speculative_sample.topk=-1'], [], 'topk must be'),
    'topp above 1': (None, ['--gin.decoding.speculative_sample.topp=1.5'], [], 'topp must be'),
    'topp below 0': (None, ['--gin.decoding.speculative_sample.topp=-0.1'], [], 'topp must be'),
    # Sampling at batch 32 starts with the target alone, which never reads it: checked up front.
    'unknown verifier': (None, ["--gin.decoding.speculative_sample.verification='blok'"],
                         ['gin_configs/decoding/speculative_sampling.gin'],
                         "verification must be 'auto', 'token' or 'block', got 'blok'"),
    'beam size 0': (None, ['--gin.infer_script.infer.num_decodes=0'],
                    ['gin_configs/decoding/beam_search.gin'], 'the beam size'),
    'batch size 0': (None, ['--gin.infer_script.infer.batch_size=0'], [], 'batch_size must be'),
    'negative batch size': (None, ['--gin.infer_script.infer.batch_size=-2'], [],
                            'batch_size must be'),
    'shard id out of range': (None, ['--gin.infer_script.infer.shard_id=3',
                                     '--gin.infer_script.infer.num_shards=2'], [], 'shard_id 3'),
    'missing feature length': (None, ["--gin.TASK_FEATURE_LENGTHS={'inputs': 32}"], [],
                               "needs a length for 'targets'"),
    'unknown input format': (None, ["--gin.infer_script.infer.input_format='xml'"], [],
                             'input_format must be'),
    'missing checkpoint': (None, ["--gin.TARGET_CHECKPOINT_PATH='/nonexistent/ckpt'"], [],
                           'target checkpoint not found'),
    'checkpoint of the other model': (None, ['--gin.TARGET_CHECKPOINT_PATH=%DRAFT_CHECKPOINT_PATH'],
                                      [], 'target checkpoint'),
    'unwritable output': (None, [], [], 'not writable'),
    'malformed draft vocabulary': (None, ["--gin.DRAFT_CHECKPOINT_PATH='{bad}/draft'"], [],
                                   'draft vocabulary'),
    'calibration that is not one': (None, ["--gin.infer_script.infer.calibration="
                                           "'{bad}/blank.txt'"], [],
                                    'infer_script.infer.calibration: '),
}


@pytest.mark.parametrize('case', list(INFER_CASES))
def test_infer_bad_input_is_one_error_line(case, setup, bad_files, tmp_path, capsys):  # noqa: F811
  input_name, bindings, gin_files, expected = INFER_CASES[case]
  input_file = setup / 'in.txt' if input_name is None else bad_files / input_name
  output_dir = tmp_path / 'out'
  if case == 'unwritable output':
    output_dir = tmp_path / 'file'
    output_dir.write_text('a file, not a folder')
    output_dir = output_dir / 'out'
  bindings = [b.replace('{bad}', str(bad_files)) for b in bindings]
  status, err = _run_infer(_infer_args(setup, output_dir, input_file, *bindings,
                                       gin_files=gin_files), capsys)
  _assert_one_error_line(status, err, expected)
  assert not list(tmp_path.rglob('*.COMPLETED'))


# Command lines without the test's run config: (arguments, what the error line must say).
INFER_CONFIG_CASES = {
    'no flags': ([], ['no gin file given', '--gin_file=gin_configs/runs/infer_multi30k.gin',
                      '--gin.INFER_OUTPUT_DIR="\'/tmp/infer\'"', 'see --help']),
    'no run config': (['--gin_file=gin_configs/decoding/speculative_greedy.gin'],
                      ['infer_script.infer.{model, output_dir, target_checkpoint_path, '
                       'task_feature_lengths} not bound (gin_configs/runs/infer.gin binds them)',
                       '--gin_file=gin_configs/runs/infer_multi30k.gin']),
    'no output folder': (['--gin_file=gin_configs/runs/infer_multi30k.gin'],
                         ['INFER_OUTPUT_DIR is required and not set: add '
                          '--gin.INFER_OUTPUT_DIR=VALUE']),
    'unquoted string binding': (['--gin_file=gin_configs/runs/infer_multi30k.gin',
                                 '--gin.INFER_OUTPUT_DIR=/tmp/x'],
                                ["binding 'INFER_OUTPUT_DIR = /tmp/x'", 'a string value needs '
                                 'quotes: --gin.INFER_OUTPUT_DIR="\'/tmp/x\'"']),
}


@pytest.mark.parametrize('case', list(INFER_CONFIG_CASES))
def test_infer_missing_or_malformed_config_is_one_error_line(case, capsys):
  args, expected = INFER_CONFIG_CASES[case]
  status, err = _run_infer(args, capsys)
  for fragment in expected:
    _assert_one_error_line(status, err, fragment)


def test_infer_help_lists_flags_gin_files_macros_and_settings(capsys):
  with pytest.raises(SystemExit) as exit_info:
    infer.run(['speculative-t5x-infer', '--help'])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  for name in ('--gin_file', '--gin_bindings', '--gin_search_paths', '--coordinator_address',
               '--process_count', '--process_index', *infer.RUN_MACROS, *infer.DECODING_BINDINGS,
               'gin_configs/runs/infer_multi30k.gin', 'gin_configs/pairs/multi30k.gin',
               'gin_configs/decoding/speculative_greedy.gin', 'gin_configs/decoding/bild.gin',
               'batch_size=32', 'max_gamma=4', *infer.EXAMPLE_ARGS):
    assert name in out, name


def test_help_macros_are_those_of_the_run_config():
  """--help's table of macros follows gin_configs/runs/infer.gin."""
  text = (gin_utils.GIN_CONFIGS_DIR / 'runs' / 'infer.gin').read_text(encoding='utf-8')
  assert set(re.findall(r'^([A-Z_]+) =', text, re.MULTILINE)) == set(infer.RUN_MACROS)


def test_tsv_header_row_is_skipped_and_only_the_first_line_is_a_header(tmp_path):
  source = tmp_path / 'with_header.tsv'
  source.write_text('inputs\ttargets\nEin Hund.\tA dog.\ninputs\ttargets\n', encoding='utf-8')
  examples = inputs.read_input_file(source)
  assert [(e.index, e.inputs, e.targets) for e in examples] == [
      (1, 'Ein Hund.', 'A dog.'), (2, 'inputs', 'targets')]
  source.write_text('inputs\ttarget\n', encoding='utf-8')  # not exactly the header: an example
  assert [(e.index, e.inputs) for e in inputs.read_input_file(source)] == [(0, 'inputs')]


def test_batch_size_must_divide_over_the_mesh_and_the_processes():
  """The check every job runs before loading anything (a 1-device machine cannot build the
  mismatched mesh itself, so the mesh here is a stand-in with 2 data shards)."""

  class TwoDataShards:
    data_size = 2

  job = lambda batch, processes: infer.Job(
      name='x', input_file='x', input_format='auto', task=None, task_module=None, split='test',
      input_length=8, target_length=8, input_length_step=0, batch_size=batch,
      checkpoint_period=1, shard_id=0, num_shards=1, partitioner=TwoDataShards(), process=0,
      num_processes=processes)
  infer._check_batching(job(4, 2))
  with pytest.raises(InferError, match='batch_size 3 must be a multiple of the mesh data size 2'):
    infer._check_batching(job(3, 1))
  with pytest.raises(InferError, match='process count 4'):
    infer._check_batching(job(6, 4))


def test_nan_temperature_from_python_is_refused(setup, tmp_path):  # noqa: F811
  """Gin cannot write NaN; a model built in Python can."""
  model = _model(decode_kwargs={'gamma': 2, 'temperature': math.nan})
  with pytest.raises(InferError, match='temperature must be a number >= 0'):
    _infer(setup, tmp_path / 'out', setup / 'in.txt', model=model)
  assert not list(tmp_path.rglob('*.COMPLETED'))


def test_truncated_checkpoint_fails_a_resume_without_damaging_its_chunks(
    setup, tmp_path, capsys, monkeypatch):  # noqa: F811
  """A job stopped after its first chunk, then resumed (same config) after its target
  checkpoint was truncated: one error line, and the committed chunk is intact."""
  shutil.copytree(setup / 'target', tmp_path / 'target')
  output_dir = tmp_path / 'out'
  args = _infer_args(setup, output_dir, setup / 'in.txt',
                     f"--gin.TARGET_CHECKPOINT_PATH='{tmp_path / 'target'}'",
                     '--gin.infer_script.infer.chunk_hook=@stop_after_chunk')
  monkeypatch.setenv('STOP_AFTER_CHUNK', '0')
  with pytest.raises(infer_hooks.Stopped):
    _run_infer(args, capsys)
  chunk = next(output_dir.glob('tmp-*/chunk00000-process00000.jsonl'))
  before = chunk.read_bytes()
  for file in (tmp_path / 'target').rglob('*'):
    if file.is_file() and file.stat().st_size > 100:
      file.write_bytes(file.read_bytes()[:file.stat().st_size // 2])
  monkeypatch.delenv('STOP_AFTER_CHUNK')
  status, err = _run_infer(args, capsys)
  _assert_one_error_line(status, err, 'target checkpoint')
  assert chunk.read_bytes() == before and not list(output_dir.glob('*.COMPLETED'))


# ------------------------------------------------------------------------------------------------
# The translate command.


TRANSLATE_CASES = {
    'gamma 0': (['--gamma', '0', 'Ein Hund.'], "--gamma must be 'auto' or a whole number >= 1"),
    'negative gamma': (['--gamma', '-3', 'Ein Hund.'],
                       "--gamma must be 'auto' or a whole number >= 1 (draft tokens per target "
                       "call), got '-3'"),
    'gamma not a number': (['--gamma', 'abc', 'Ein Hund.'], "--gamma must be 'auto' or a whole "
                           "number >= 1 (draft tokens per target call), got 'abc'"),
    'batch size 0': (['--batch_size', '0', 'Ein Hund.'],
                     "--batch_size must be a whole number >= 1, got '0'"),
    'batch size not a number': (['--batch_size', 'abc', 'Ein Hund.'],
                                "--batch_size must be a whole number >= 1, got 'abc'"),
    'file and sentences': (['--file', '{root}/blank.txt', 'Ein Hund.'],
                           'give sentences as arguments or --file FILE, not both'),
    'file is a directory': (['--file', '{root}'], 'is a directory: give a file with one German '
                            'sentence per line'),
    'missing file': (['--file', '{root}/missing.de'], 'cannot read --file'),
    'binary file': (['--file', '{root}/binary.txt'], 'cannot read --file'),
    'empty file': (['--file', '{root}/empty.txt'], 'has no sentences'),
    'missing weights': (['--target', '{root}/missing.msgpack', 'Ein Hund.'],
                        'cannot load the model weights'),
    'truncated weights': (['--target', '{root}/truncated.msgpack', 'Ein Hund.'],
                          'cannot load the model weights'),
}


@pytest.mark.parametrize('case', list(TRANSLATE_CASES))
def test_translate_bad_input_is_one_error_line(case, bad_files, tmp_path):
  args, expected = TRANSLATE_CASES[case]
  weights = translate.pipeline.EMBEDDED_TARGET.read_bytes()
  (bad_files / 'truncated.msgpack').write_bytes(weights[:len(weights) // 3])
  with pytest.raises(SystemExit) as exit_info:
    translate.main([a.format(root=bad_files) for a in args])
  message = exit_info.value.code  # Python prints a string code on stderr and exits with 1
  assert isinstance(message, str) and message.startswith('error: '), message
  assert expected in message and '\n' not in message, message


# ------------------------------------------------------------------------------------------------
# Optional dependencies.


def test_bleu_without_sacrebleu_names_the_bench_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, 'sacrebleu', None)  # as if not installed: import raises
  with pytest.raises(speculative_t5x.MissingExtraError,
                     match=r"^BLEU scores need: pip install 'speculative_t5x\[bench\]'"):
    data.corpus_bleu(['a'], ['a'])


def test_benchmark_checks_its_extras_before_anything_else(monkeypatch):
  """benchmarks.speed scores BLEU: without sacrebleu it stops as it parses its flags, before
  loading or compiling anything (nothing is loaded: the pair loader would fail the test)."""
  from benchmarks import harness  # pylint: disable=g-import-not-at-top
  from benchmarks import speed  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(sys.modules, 'sacrebleu', None)
  monkeypatch.setattr(harness, 'load_pair', lambda *a, **k: pytest.fail('loaded the pair'))
  with pytest.raises(SystemExit) as exit_info:
    speed.main(['--sentences', '1:2'])
  assert exit_info.value.code == ("error: sacrebleu not installed (BLEU scores): pip install -e "
                                  "'.[bench]' (or pip install 'speculative_t5x[bench]')")
