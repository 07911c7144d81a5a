"""The infer job: outputs, summary, kill-and-resume, and one-line errors for bad input."""

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

import speculative_t5x
from speculative_t5x import beam_search
from speculative_t5x import checkpoints
from speculative_t5x import data
from speculative_t5x import decoding
from speculative_t5x import gin_utils
from speculative_t5x import infer
from speculative_t5x import inputs
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import policy
from speculative_t5x import trees
from conftest import data_dir
from fast_params import random_params
import infer_hooks

REPO = pathlib.Path(__file__).resolve().parents[1]
VOCAB = REPO / 'speculative_t5x' / 'vocab' / 'multi30k_8k.model'
OTHER_VOCAB = data_dir() / 't5_vocab' / 'spiece.model'
LINES = data_dir() / 'multi30k' / 'test_2016_flickr.de'


def _german_lines(n):
  """n input lines: Multi30k test sentences, or generated ones where the data is absent."""
  if LINES.exists():
    return LINES.read_text(encoding='utf-8').splitlines()[:n]
  subjects = ['Ein Mann', 'Eine Frau', 'Zwei Kinder', 'Ein Hund', 'Drei Männer', 'Ein Mädchen']
  verbs = ['läuft über', 'sitzt auf', 'spielt neben', 'steht vor', 'schaut auf']
  places = ['der Straße', 'einem Boot', 'dem Gras', 'einer Mauer', 'dem Markt', 'dem Wasser']
  return [f'{subjects[i % 6]} {verbs[i % 5]} {places[(i // 5) % 6]} Nummer {i}.'
          for i in range(n)]

TARGET = network.T5Config(vocab_size=8064, emb_dim=16, num_heads=2, head_dim=8,
                          num_encoder_layers=1, num_decoder_layers=2, mlp_dim=32,
                          mlp_activations=('gelu', 'linear'), dropout_rate=0.0)
DRAFT = dataclasses.replace(TARGET, num_decoder_layers=1)

_GIN = """
include 'gin_configs/runs/infer.gin'
include 'gin_configs/decoding/speculative_greedy.gin'
{scoped}
TARGET_CONFIG = @tiny_target/network.T5Config()
DRAFT_CONFIG = @tiny_draft/network.T5Config()
VOCABULARY = @vocabularies.SentencePieceVocabulary()
vocabularies.SentencePieceVocabulary.sentencepiece_model_file = '{vocab}'
TASK_FEATURE_LENGTHS = {{'inputs': 32, 'targets': 10}}
TARGET_CHECKPOINT_PATH = '{ckpt}/target'
DRAFT_CHECKPOINT_PATH = '{ckpt}/draft'
infer_script.infer.batch_size = 2
infer_script.infer.checkpoint_period = 1
infer_script.infer.output_ids = True
"""


def _scoped(scope, config):
  lines = []
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if field.name == 'dtype':
      value = str(value)
    lines.append(f'{scope}/network.T5Config.{field.name} = {value!r}')
  return '\n'.join(lines)


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  """Tiny target and draft checkpoints, a gin file, and an input file of 12 lines."""
  root = tmp_path_factory.mktemp('infer')
  target = random_params(TARGET, 0)
  draft = random_params(DRAFT, 1)
  # Shared embedding and logits make the draft agree with the target sometimes.
  draft['token_embedder'] = target['token_embedder']
  draft['decoder']['logits_dense'] = target['decoder']['logits_dense']
  checkpoints.save_params(root / 'target', target)
  checkpoints.save_params(root / 'draft', draft)
  gin_file = root / 'tiny.gin'
  gin_file.write_text(_GIN.format(scoped=_scoped('tiny_target', TARGET) + '\n' +
                                  _scoped('tiny_draft', DRAFT), vocab=VOCAB, ckpt=root))
  (root / 'in.txt').write_text('\n'.join(_german_lines(12)) + '\n', encoding='utf-8')
  return root


def _cli(setup, output_dir, *extra, input_file=None, env=None, popen=False):
  cmd = [sys.executable, '-m', 'speculative_t5x.infer', f'--gin_file={setup / "tiny.gin"}',
         f"--gin.INFER_OUTPUT_DIR='{output_dir}'",
         f"--gin.INPUT_FILE='{input_file or setup / 'in.txt'}'", *extra]
  env = dict(os.environ, **(env or {}))
  if popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _outputs(output_dir):
  files = sorted(pathlib.Path(output_dir).glob('*.jsonl-00000-of-00001'))
  assert len(files) == 1, files
  return [json.loads(l) for l in files[0].read_text(encoding='utf-8').splitlines()]


def _model(**kwargs):
  vocab = infer.SentencePieceVocabulary(str(VOCAB))
  args = dict(decode_fn=decoding.speculative_sample,
              decode_kwargs={'gamma': 3, 'temperature': 0.0}, input_vocabulary=vocab,
              output_vocabulary=vocab)
  args.update(kwargs)
  return models.EncoderDecoderModel(TARGET, DRAFT, **args)


def _infer(setup, output_dir, input_file, **kwargs):
  args = dict(model=_model(), output_dir=str(output_dir),
              target_checkpoint_path=str(setup / 'target'),
              draft_checkpoint_path=str(setup / 'draft'),
              task_feature_lengths={'inputs': 32, 'targets': 10}, input_file=str(input_file),
              batch_size=2, checkpoint_period=1, progress=False)
  args.update(kwargs)
  return infer.infer(**args)


# ------------------------------------------------------------------------------------------------
# A full run in-process: output shape, skipped and truncated inputs, summary, configs.


def test_run_outputs_summary_skips_and_truncation(setup, tmp_path):
  lines = _german_lines(5)
  long_line = ' '.join(lines)  # far more than 32 tokens
  text = '\n'.join([lines[0], '', long_line, '   ', lines[1], lines[2]]) + '\n'
  source = tmp_path / 'in.tsv'
  source.write_text('\n'.join(f'{l}\tref {i}' if l.strip() else l
                              for i, l in enumerate(text.splitlines())) + '\n', encoding='utf-8')
  summary = _infer(setup, tmp_path / 'out', source, output_ids=True)
  records = _outputs(tmp_path / 'out')
  # Lines 1 and 3 (0-based) are empty: skipped, counted, everything else once, in order.
  assert [r['index'] for r in records] == [0, 2, 4, 5]
  assert summary['skipped_empty'] == {'count': 2, 'indices': [1, 3]}
  assert summary['truncated_inputs']['count'] == 1
  assert summary['truncated_inputs']['indices'] == [2]
  assert summary['truncated_inputs']['longest_input_tokens'] > 32
  first = records[0]
  assert first['inputs'] == {'inputs_pretokenized': lines[0], 'targets_pretokenized': 'ref 0'}
  assert isinstance(first['prediction'], str)
  assert 0 < len(first['prediction_tokens']) <= 10
  stats = first['aux']['stats']
  assert stats['emitted'] >= 1 and stats['target_calls'] >= 1
  assert summary['examples'] == 4
  total_emitted = sum(r['aux']['stats']['emitted'] for r in records)
  total_calls = sum(r['aux']['stats']['target_calls'] for r in records)
  assert summary['tokens_per_target_call'] == pytest.approx(total_emitted / total_calls)
  assert summary['alpha'] == pytest.approx(
      sum(r['aux']['stats']['accepted'] for r in records) /
      sum(r['aux']['stats']['proposed'] for r in records))
  for key in ('sentences_per_second', 'tokens_per_second', 'wall_seconds', 'compile_seconds'):
    assert summary[key] > 0, key
  assert summary['config']['decode_fn'] == 'speculative_sample'
  assert summary['config']['target']['num_decoder_layers'] == 2
  # A finished job leaves its documented files only (docs/infer.md): no chunk folder.
  output = 'in.tsv-predict_with_aux.jsonl-00000-of-00001'
  assert sorted(p.name for p in (tmp_path / 'out').iterdir()) == sorted([
      output, f'{output}.summary.json', f'{output}.COMPLETED', 'config.gin',
      'operative_config.gin'])
  # The speculative output is the target's greedy output: check against plain decoding.
  baseline = _infer(setup, tmp_path / 'base', source,
                    model=_model(decode_fn=decoding.temperature_sample,
                                 decode_kwargs={'temperature': 0.0}))
  assert baseline['config']['draft'] is None
  assert [r['prediction'] for r in _outputs(tmp_path / 'base')] == [
      r['prediction'] for r in records]
  # A second call finds the completed output and does nothing.
  again = _infer(setup, tmp_path / 'out', source, output_ids=True)
  assert again == json.loads(next((tmp_path / 'out').glob('*.summary.json')).read_text())


def test_input_length_step_keeps_the_predictions(setup, tmp_path):
  """Batches padded only to their longest input, rounded up to 8, decode as at the full width,
  also with gamma='auto' choosing per batch among batches of different widths (compiled as met)."""
  lines = _german_lines(6)
  source = tmp_path / 'in.txt'
  source.write_text('\n'.join([lines[0], ' '.join(lines[1:3]), lines[3], lines[4][:10],
                               lines[5], ' '.join(lines)]) + '\n', encoding='utf-8')
  full = _infer(setup, tmp_path / 'full', source)
  rounded = _infer(setup, tmp_path / 'rounded', source, input_length_step=8, max_gamma=1,
                   model=_model(decode_kwargs={'gamma': 'auto', 'temperature': 0.0}))
  assert full['config']['input_length_step'] == 0
  assert rounded['config']['input_length_step'] == 8
  assert sorted(rounded['policy']['measured']) == ['0', '1']  # both gammas ran batches
  assert [r['prediction'] for r in _outputs(tmp_path / 'rounded')] == [
      r['prediction'] for r in _outputs(tmp_path / 'full')]
  examples = inputs.read_input_file(source)
  inputs.tokenize(examples, _model().input_vocabulary, 32, inputs.InputReport())
  widths = {data.input_width([ex.tokens for ex in examples[b:b + 2]], 32, 8)
            for b in range(0, 6, 2)}
  assert len(widths) > 1, widths  # the job met several widths


def test_beam_size_reaches_the_decoder(setup, tmp_path, monkeypatch):
  """num_decodes is the beam size; the job writes each example's best beam (exact decoders)."""
  # An untried tree is due at once, so that this 8-example job tries one (the exploration
  # budget would otherwise keep a short job on beam_search) and each example records its own.
  monkeypatch.setattr(policy, 'EXPLORE_EVERY', 1)
  source = tmp_path / 'in.txt'
  source.write_text('\n'.join(_german_lines(8)) + '\n', encoding='utf-8')
  outputs = {}
  for name, fn, branching in (('beam', beam_search.beam_search, None),
                              ('speculative_beam', beam_search.speculative_beam_search, (8,)),
                              ('auto', beam_search.speculative_beam_search, 'auto')):
    kwargs = {'alpha': 0.6, **({'branching': branching} if branching else {})}
    model = _model(decode_fn=fn, decode_kwargs=kwargs)
    summary = _infer(setup, tmp_path / name, source, model=model, num_decodes=3, output_ids=True)
    assert summary['config']['num_decodes'] == 3
    outputs[name] = [r['prediction_tokens'] for r in _outputs(tmp_path / name)]
  assert outputs['speculative_beam'] == outputs['beam'] == outputs['auto']
  # branching='auto': beam_search itself first, then a tree; each example records its choice.
  trees = [r['aux']['stats']['branching'] for r in _outputs(tmp_path / 'auto')]
  assert trees[0] == [] and len({tuple(t) for t in trees}) >= 2
  assert summary['policy']['setting'] == 'branching'
  examples = inputs.read_input_file(source)
  inputs.tokenize(examples, _model().input_vocabulary, 32, inputs.InputReport())
  enc = np.zeros((len(examples), 32), np.int32)
  for row, ex in enumerate(examples):
    enc[row, :len(ex.tokens)] = ex.tokens
  params = {'target': checkpoints.load_checkpoint(setup / 'target', TARGET)}
  decodes = _model(decode_fn=beam_search.beam_search, decode_kwargs={'alpha': 0.6}).predict_batch(
      params, {'encoder_input_tokens': enc,
               'decoder_input_tokens': np.zeros((len(examples), 10), np.int32)}, num_decodes=3)
  direct = [[int(t) for t in row if t] for row in np.asarray(decodes)]
  assert outputs['beam'] == direct


def test_block_verification_and_trees_run_in_the_job(setup, tmp_path):
  """The job takes verification='block' and tree_speculative_sample like any decoder; greedy,
  both write the chain's predictions, which are the target's."""
  source = tmp_path / 'in.txt'
  source.write_text('\n'.join(_german_lines(6)) + '\n', encoding='utf-8')
  outputs = {}
  for name, fn, kwargs in (
      ('chain', decoding.speculative_sample, {'gamma': 3, 'temperature': 0.0}),
      ('block', decoding.speculative_sample, {'gamma': 3, 'temperature': 0.0,
                                              'verification': 'block'}),
      ('tree', trees.tree_speculative_sample, {'branching': (2, 1), 'temperature': 0.0})):
    summary = _infer(setup, tmp_path / name, source, output_ids=True,
                     model=_model(decode_fn=fn, decode_kwargs=kwargs))
    assert summary['tokens_per_target_call'] >= 1.0
    outputs[name] = [r['prediction_tokens'] for r in _outputs(tmp_path / name)]
  assert outputs['block'] == outputs['chain'] == outputs['tree']


def test_a_decoder_only_draft_runs_in_the_job(setup, tmp_path):
  """A draft checkpoint with no encoder (it reads the target's): the job loads it by its config
  and writes the target's greedy predictions."""
  reader = dataclasses.replace(DRAFT, num_encoder_layers=0, encoded_width=TARGET.emb_dim)
  params = checkpoints.load_checkpoint(setup / 'draft', DRAFT)
  checkpoints.save_params(tmp_path / 'reader', {k: v for k, v in params.items() if k != 'encoder'})
  source = tmp_path / 'in.txt'
  source.write_text('\n'.join(_german_lines(4)) + '\n', encoding='utf-8')
  predictions = {}
  for name, draft_config, path in (('separate', DRAFT, setup / 'draft'),
                                   ('reader', reader, tmp_path / 'reader')):
    model = models.EncoderDecoderModel(TARGET, draft_config, decode_fn=decoding.speculative_sample,
                                       decode_kwargs={'gamma': 3, 'temperature': 0.0},
                                       input_vocabulary=_model().input_vocabulary,
                                       output_vocabulary=_model().output_vocabulary)
    summary = _infer(setup, tmp_path / name, source, model=model, output_ids=True,
                     draft_checkpoint_path=str(path))
    assert summary['tokens_per_target_call'] >= 1.0
    predictions[name] = [r['prediction_tokens'] for r in _outputs(tmp_path / name)]
  assert predictions['reader'] == predictions['separate']


# ------------------------------------------------------------------------------------------------
# Kill and resume.


def test_sigkill_and_resume_equals_uninterrupted_run(setup, tmp_path):
  """The job is SIGKILLed right after committing chunk 2 (a chunk hook, not a race): chunks 0-2
  survive, nothing is marked complete, and the rerun decodes the rest to the uninterrupted
  run's output."""
  lines = _german_lines(120)
  source = tmp_path / 'many.txt'
  source.write_text('\n'.join(lines) + '\n', encoding='utf-8')
  # A persistent compilation cache spares the second and third runs the compile.
  env = {'JAX_COMPILATION_CACHE_DIR': str(tmp_path / 'jax_cache'),
         'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
         'PYTHONPATH': os.pathsep.join([str(REPO / 'tests'), os.environ.get('PYTHONPATH', '')])}
  hook = (f'--gin_file={tmp_path / "hook.gin"}')
  # A fixed gamma: under 'auto' each batch's gamma (so its decode statistics, not its
  # prediction) depends on measured times, and this test compares whole records.
  (tmp_path / 'hook.gin').write_text('import infer_hooks\n'
                                     'infer_script.infer.chunk_hook = @kill_after_chunk\n'
                                     'decoding.speculative_sample.gamma = 2\n')
  killed_dir = tmp_path / 'killed'
  killed = _cli(setup, killed_dir, hook, input_file=source, env={**env, 'KILL_AFTER_CHUNK': '2'})
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  tmp_dir = killed_dir / 'tmp-many.txt-00000-of-00001'
  assert sorted(p.name for p in tmp_dir.glob('chunk*.jsonl')) == [
      f'chunk{c:05}-process00000.jsonl' for c in range(3)]
  assert not list(killed_dir.glob('*.COMPLETED'))

  resumed = _cli(setup, killed_dir, hook, input_file=source, env=env)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  summary = json.loads(next(killed_dir.glob('*.summary.json')).read_text())
  assert summary['resumed_chunks'] == 3 and summary['chunks'] == 60
  full_dir = tmp_path / 'full'
  full = _cli(setup, full_dir, hook, input_file=source, env=env)
  assert full.returncode == 0, full.stderr[-2000:]
  got, want = _outputs(killed_dir), _outputs(full_dir)
  assert [r['index'] for r in got] == list(range(120))
  assert got == want


def test_stopped_sampling_job_resumes_to_the_uninterrupted_samples(setup, tmp_path):
  """Sampling (temperature 1): each batch's key depends only on its chunk and batch numbers,
  so a job stopped after chunk 1 and resumed writes exactly the uninterrupted job's samples."""

  def stop_after_chunk_1(chunk):
    if chunk == 1:
      raise infer_hooks.Stopped(chunk)

  sampling = lambda: _model(decode_kwargs={'gamma': 3, 'temperature': 1.0})
  with pytest.raises(infer_hooks.Stopped):
    _infer(setup, tmp_path / 'stopped', setup / 'in.txt', model=sampling(),
           chunk_hook=stop_after_chunk_1)
  resumed = _infer(setup, tmp_path / 'stopped', setup / 'in.txt', model=sampling())
  assert resumed['resumed_chunks'] == 2
  _infer(setup, tmp_path / 'full', setup / 'in.txt', model=sampling())
  got, want = _outputs(tmp_path / 'stopped'), _outputs(tmp_path / 'full')
  assert got == want and len(got) == 12
  _infer(setup, tmp_path / 'greedy', setup / 'in.txt')
  assert [r['prediction'] for r in got] != [r['prediction'] for r in _outputs(tmp_path / 'greedy')]


def test_per_row_temperature_from_the_input_records(setup, tmp_path):
  """JSONL records may carry their own "temperature": rows at 0 decode greedily (the greedy
  job's predictions), rows at 1 sample; rows without one use the decoder's temperature."""
  lines = (setup / 'in.txt').read_text(encoding='utf-8').splitlines()
  temperatures = [0.0, 1.0, None] * 4
  records = [{'inputs': line, **({} if t is None else {'temperature': t})}
             for line, t in zip(lines, temperatures)]
  source = tmp_path / 'rows.json'  # JSONL; a '.jsonl' name would match _outputs' glob twice
  source.write_text(''.join(json.dumps(r) + '\n' for r in records), encoding='utf-8')
  greedy = _infer(setup, tmp_path / 'greedy', setup / 'in.txt')  # the same lines, greedy
  mixed = _infer(setup, tmp_path / 'mixed', source,
                 model=_model(decode_kwargs={'gamma': 3, 'temperature': 0.0}))
  sampled = _infer(setup, tmp_path / 'sampled', source,
                   model=_model(decode_kwargs={'gamma': 3, 'temperature': 1.0}))
  assert greedy['examples'] == mixed['examples'] == sampled['examples'] == 12
  want = [r['prediction'] for r in _outputs(tmp_path / 'greedy')]
  got = [r['prediction'] for r in _outputs(tmp_path / 'mixed')]
  at_zero = [i for i, t in enumerate(temperatures) if t in (0.0, None)]
  assert [got[i] for i in at_zero] == [want[i] for i in at_zero]
  assert any(got[i] != want[i] for i, t in enumerate(temperatures) if t == 1.0)
  # Rows without a temperature follow the decoder's: now 1, so they sample too.
  other = [r['prediction'] for r in _outputs(tmp_path / 'sampled')]
  assert [other[i] for i in range(0, 12, 3)] == [want[i] for i in range(0, 12, 3)]
  assert any(other[i] != want[i] for i in range(2, 12, 3))
  source.write_text(json.dumps({'inputs': 'x', 'temperature': -1}) + '\n')
  with pytest.raises(infer.InferError, match='"temperature" must be a number >= 0'):
    _infer(setup, tmp_path / 'bad', source)


# ------------------------------------------------------------------------------------------------
# Two processes joined by jax.distributed (CPU collectives) = one process.


def test_two_processes_merge_to_the_single_process_output(setup, tmp_path):
  import socket
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  env = {'JAX_COMPILATION_CACHE_DIR': str(tmp_path / 'jax_cache'),
         'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0', 'JAX_PLATFORMS': 'cpu'}
  multi = tmp_path / 'multi'
  procs = [_cli(setup, multi, f'--coordinator_address=localhost:{port}', '--process_count=2',
                f'--process_index={i}', env=env, popen=True) for i in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  # Each process wrote its own rows of every chunk (process 0's merge refuses chunks that do
  # not cover the input exactly); once merged, the chunk folder is gone.
  assert not (multi / 'tmp-in.txt-00000-of-00001').exists()
  single = _cli(setup, tmp_path / 'single', env=env)
  assert single.returncode == 0, single.stderr[-3000:]
  got, want = _outputs(multi), _outputs(tmp_path / 'single')
  assert [r['index'] for r in got] == list(range(12))
  # gamma='auto': process 0's choice for every batch, so both processes run one program; the
  # gamma of a batch (and so its decode statistics) depends on measured times, its tokens not.
  fields = lambda records: [(r['index'], r['prediction'], r['prediction_tokens']) for r in records]
  assert fields(got) == fields(want)
  gammas = [r['aux']['stats']['gamma'] for r in got]
  assert all(gammas[i] == gammas[i + 1] for i in range(0, 12, 2))  # one gamma per batch
  summary = json.loads(next(multi.glob('*.summary.json')).read_text())
  assert summary['config']['processes'] == 2 and summary['config']['devices'] == 2


# ------------------------------------------------------------------------------------------------
# Bad input: one line on stderr, exit status 1, no traceback.


def _assert_one_line_error(proc, *fragments, alone=False):
  """alone: nothing else on stderr (no log line of JAX's backend probing before the error)."""
  assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
  errors = [l for l in proc.stderr.splitlines() if l.startswith('error: ')]
  assert len(errors) == 1, proc.stderr[-3000:]
  assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  if alone:
    assert proc.stderr.strip() == errors[0], proc.stderr[-3000:]
  for fragment in fragments:
    assert fragment in errors[0], errors[0]
  return errors[0]


def test_cli_undecodable_bytes(setup, tmp_path):
  """Also: the error (met after JAX started its backend) is all there is on stderr."""
  bad = tmp_path / 'bad.txt'
  bad.write_bytes(b'Ein Hund.\nEin \xff\xfe Mann.\n')
  _assert_one_line_error(_cli(setup, tmp_path / 'out', input_file=bad),
                         'bad.txt:2', 'not UTF-8', 'byte 4', alone=True)


def test_cli_without_flags_names_the_run_config():
  proc = subprocess.run([sys.executable, '-m', 'speculative_t5x.infer'], cwd=REPO,
                        capture_output=True, text=True, timeout=600)
  _assert_one_line_error(proc, 'no gin file given',
                         '--gin_file=gin_configs/runs/infer_multi30k.gin', alone=True)


def test_cli_unknown_and_missing_gin_bindings(setup, tmp_path):
  _assert_one_line_error(_cli(setup, tmp_path / 'o1', '--gin.infer_script.infer.bogus=1'),
                         "doesn't have a parameter named 'bogus'")
  _assert_one_line_error(_cli(setup, tmp_path / 'o2', '--gin.nonexistent.thing=1'),
                         "No configurable matching 'nonexistent'")
  _assert_one_line_error(_cli(setup, tmp_path / 'o3', '--gin.TARGET_CONFIG=%gin.REQUIRED'),
                         'TARGET_CONFIG')


def test_cli_draft_eos_mismatch(setup, tmp_path):
  _assert_one_line_error(
      _cli(setup, tmp_path / 'out', '--gin.models.EncoderDecoderModel.draft_eos_id=2'),
      'EOS ids differ', 'target eos_id 1, draft eos_id 2')


def test_cli_unwritable_output_dir(setup, tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('')
  _assert_one_line_error(_cli(setup, blocker / 'out'), 'not writable', str(blocker / 'out'))


def test_cli_checkpoint_config_mismatch(setup, tmp_path):
  _assert_one_line_error(
      _cli(setup, tmp_path / 'out', '--gin.tiny_target/network.T5Config.num_heads=4'),
      'target checkpoint', 'does not match T5Config', 'mis-shaped')


# In-process variants of the remaining checks (no subprocess start-up).


def test_draft_vocabulary_mismatch(setup, tmp_path):
  if not OTHER_VOCAB.exists():
    pytest.skip('no second vocabulary available')
  model = _model(draft_output_vocabulary=infer.SentencePieceVocabulary(str(OTHER_VOCAB)))
  with pytest.raises(infer.InferError, match='draft and target vocabularies differ'):
    _infer(setup, tmp_path / 'out', setup / 'in.txt', model=model)


def test_draft_vocab_size_mismatch(setup, tmp_path):
  with pytest.raises(ValueError, match='vocabularies differ: target vocab_size 8064, draft '
                                       'vocab_size 8192'):
    models.EncoderDecoderModel(TARGET, dataclasses.replace(DRAFT, vocab_size=8192), eos_id=1)


def test_draft_checkpoint_mismatch(setup, tmp_path):
  with pytest.raises(infer.InferError, match='draft checkpoint: checkpoint does not match'):
    _infer(setup, tmp_path / 'out', setup / 'in.txt', draft_checkpoint_path=str(setup / 'target'))


def test_missing_checkpoint_and_input(setup, tmp_path):
  with pytest.raises(infer.InferError, match='target checkpoint not found'):
    _infer(setup, tmp_path / 'o1', setup / 'in.txt', target_checkpoint_path='/nonexistent/x')
  with pytest.raises(infer.InferError, match='input file not found'):
    _infer(setup, tmp_path / 'o2', tmp_path / 'missing.txt')
  with pytest.raises(infer.InferError, match='exactly one of MIXTURE_OR_TASK_NAME'):
    _infer(setup, tmp_path / 'o3', setup / 'in.txt', mixture_or_task_name='multi30k_de_en')


def test_seqio_task_without_the_data_extra_names_it(setup, tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'seqio', None)  # as if not installed: import raises
  with pytest.raises(speculative_t5x.MissingExtraError,
                     match=r"^seqio tasks need: pip install 'speculative_t5x\[data\]'"):
    infer.infer(model=_model(), output_dir=str(tmp_path / 'out'),
                target_checkpoint_path=str(setup / 'target'), mixture_or_task_name='multi30k_de_en',
                task_feature_lengths={'inputs': 32, 'targets': 10}, progress=False)


def test_read_input_formats(tmp_path):
  jsonl = tmp_path / 'x.jsonl'
  jsonl.write_text('{"inputs": "a b", "targets": "c"}\n\n{"inputs": "d"}\n', encoding='utf-8')
  report = inputs.InputReport()
  examples = inputs.read_input_file(jsonl, report=report)
  assert [(e.index, e.inputs, e.targets) for e in examples] == [(0, 'a b', 'c'), (2, 'd', None)]
  assert report.skipped_empty == [1]
  jsonl.write_text('{"inputs": "a"}\n{"inputs": 3}\n', encoding='utf-8')
  with pytest.raises(infer.InferError, match=r'x.jsonl:2: a JSON object with a string "inputs"'):
    inputs.read_input_file(jsonl)
  jsonl.write_text('{"inputs": "a"\n', encoding='utf-8')
  with pytest.raises(infer.InferError, match=r'x.jsonl:1: invalid JSON'):
    inputs.read_input_file(jsonl)
  crlf = tmp_path / 'y.txt'
  crlf.write_bytes('Grüße\r\nzwei\r\n'.encode('utf-8'))
  assert [e.inputs for e in inputs.read_input_file(crlf)] == ['Grüße', 'zwei']


def test_changed_config_does_not_mix_with_partial_run(setup, tmp_path):
  out = tmp_path / 'out'
  tmp_dir = out / 'tmp-in.txt-00000-of-00001'
  tmp_dir.mkdir(parents=True)
  (tmp_dir / 'run_key').write_text('0123456789abcdef')
  with pytest.raises(infer.InferError, match='partial run with a different config'):
    _infer(setup, out, setup / 'in.txt')


def test_rewrite_gin_args():
  assert gin_utils.rewrite_gin_args(['prog', '--gin.A=1', '--gin_file=x', "--gin.b.c='d=e'"]) == [
      'prog', '--gin_bindings=A = 1', '--gin_file=x', "--gin_bindings=b.c = 'd=e'"]
  with pytest.raises(ValueError, match='expected --gin.NAME=VALUE'):
    gin_utils.rewrite_gin_args(['--gin.A'])
