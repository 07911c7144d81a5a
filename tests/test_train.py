"""Tests of training, resumption and distillation (speculative_t5x.train, .evaluation) on tiny
configs."""

import json
import os
import pathlib
import subprocess
import sys

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speculative_t5x import checkpoints
from speculative_t5x import data
from speculative_t5x import evaluation
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import partitioning
from speculative_t5x import gin_utils
from speculative_t5x import train as train_lib
import conftest

LENGTH = 16


@pytest.fixture(autouse=True)
def _no_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def _tiny_config(**overrides) -> network.T5Config:
  values = dict(vocab_size=data.padded_vocab_size(), emb_dim=16, num_heads=2, head_dim=8,
                num_encoder_layers=1, num_decoder_layers=1, mlp_dim=32,
                mlp_activations=('gelu', 'linear'), dropout_rate=0.1, logits_via_embedding=True)
  values.update(overrides)
  return network.T5Config(**values)


def _run(model_dir, data_dir, steps, **overrides):
  kwargs = dict(model_dir=str(model_dir), config=_tiny_config(), data_dir=str(data_dir),
                max_input_length=LENGTH, max_target_length=LENGTH, batch_size=4,
                num_train_steps=steps, learning_rate_scale=0.1, warmup_steps=1, log_every=1,
                checkpoint_every=2, eval_every=0, final_eval_splits=(), max_train_examples=200)
  kwargs.update(overrides)
  return train_lib.train(**kwargs)


def _records(model_dir):
  lines = (pathlib.Path(model_dir) / 'metrics.jsonl').read_text().splitlines()
  return [json.loads(l) for l in lines]


def _losses(model_dir):
  return [r['cross_entropy'] for r in _records(model_dir) if 'loss' in r]


def test_schedule_is_t5x_rsqrt():
  schedule = train_lib.rsqrt_schedule(1.0, 100)
  assert float(schedule(0)) == pytest.approx(0.1)
  assert float(schedule(100)) == pytest.approx(0.1)
  assert float(schedule(400)) == pytest.approx(0.05)


def test_z_loss_and_label_smoothing():
  logits = jnp.array([[[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]]])
  targets = jnp.array([[0, 2]])
  weights = jnp.array([[1.0, 0.0]])
  loss, metrics = evaluation.cross_entropy_with_z_loss(logits, targets, weights, z_loss=1e-4)
  log_z = jax.nn.logsumexp(logits[0, 0])
  assert float(loss) == pytest.approx(float(log_z - 2.0 + 1e-4 * log_z**2), rel=1e-6)
  assert float(metrics['tokens']) == 1.0
  # A perfect prediction of the smoothed distribution has zero smoothed loss.
  smooth = 0.1
  probs = jnp.array([1 - smooth, smooth / 2, smooth / 2])
  perfect = jnp.log(probs)[None, None]
  loss, _ = evaluation.cross_entropy_with_z_loss(perfect, jnp.array([[0]]), jnp.array([[1.0]]),
                                                 0.0, smooth)
  assert float(loss) == pytest.approx(0.0, abs=1e-5)


def test_training_decreases_loss_and_resumes_exactly(multi30k, tmp_path):
  full = _run(tmp_path / 'full', multi30k, 6)
  losses = _losses(tmp_path / 'full')
  assert len(losses) == 6
  assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.1, losses
  # A run stopped at step 3 (as if killed after its checkpoint) and restarted ends in the same
  # state: params, optimizer slots, step, and (through the data position) the same batches.
  _run(tmp_path / 'resumed', multi30k, 3, checkpoint_every=3)
  resumed = _run(tmp_path / 'resumed', multi30k, 6)
  assert int(resumed['state']['step']) == int(full['state']['step']) == 6
  assert (jax.tree_util.tree_structure(full['state']) ==
          jax.tree_util.tree_structure(resumed['state']))
  for a, b in zip(jax.tree_util.tree_leaves(full['state']),
                  jax.tree_util.tree_leaves(resumed['state'])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  assert _losses(tmp_path / 'resumed')[3:] == pytest.approx(losses[3:], rel=1e-6)


def _reference_greedy(config, params, tokens, max_length):
  """Greedy decoding by repeated full (uncached, teacher-forced) forward passes."""
  forward = jax.jit(network.Transformer(config).apply)
  enc = jnp.asarray(data.pad_batch([tokens], None, LENGTH, LENGTH)['encoder_input_tokens'])
  out = []
  for _ in range(max_length):
    dec_in = jnp.asarray([[0] + out + [0] * (max_length - 1 - len(out))], jnp.int32)
    logits = forward({'params': params}, enc, dec_in, jnp.ones_like(dec_in))
    out.append(int(jnp.argmax(logits[0, len(out)])))
    if out[-1] == data.EOS_ID:
      break
  return out


def test_sequence_distillation_data_is_the_teachers_greedy_output(multi30k, tmp_path):
  teacher_config = _tiny_config(dropout_rate=0.0, num_decoder_layers=2)
  params, _ = network.init_params(teacher_config, jax.random.PRNGKey(1))
  weights = tmp_path / 'teacher.msgpack'
  checkpoints.export_weights(params, teacher_config, weights)
  loaded_config, loaded, _ = checkpoints.load_weights(weights)
  assert loaded_config == teacher_config
  assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(params)
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(loaded))

  cache = tmp_path / 'distill.npz'
  _run(tmp_path / 'draft', multi30k, 1, distillation='sequence', teacher=str(weights),
       distillation_cache=str(cache), max_train_examples=24, eval_batch_size=8)
  cached = np.load(cache)
  sources, _ = data.load_split('train', 'de', 'en', multi30k)
  inputs = data.encode(sources[:24], LENGTH)
  for i, tokens in enumerate(inputs[:6]):
    expected = _reference_greedy(loaded_config, loaded, tokens, LENGTH)
    if expected[-1] != data.EOS_ID:
      expected = expected[:LENGTH - 1] + [data.EOS_ID]
    assert cached['tokens'][i, :cached['lengths'][i]].tolist() == expected
  # The cache is reused as is.
  again = evaluation.sequence_distillation_targets(loaded_config, loaded, inputs, LENGTH, LENGTH,
                                                   cache)
  assert again == [cached['tokens'][i, :n].tolist() for i, n in enumerate(cached['lengths'])]


@pytest.mark.parametrize('divergence', evaluation.DIVERGENCES)
def test_distillation_divergences_in_closed_form(divergence):
  """Each divergence on two 3-token distributions, against numpy; zero when they agree."""
  p, q = np.array([0.7, 0.2, 0.1]), np.array([0.2, 0.5, 0.3])
  m = (p + q) / 2
  want = {'forward_kl': np.sum(p * np.log(p / q)), 'reverse_kl': np.sum(q * np.log(q / p)),
          'jsd': 0.5 * np.sum(p * np.log(p / m)) + 0.5 * np.sum(q * np.log(q / m)),
          'tv': 0.5 * np.sum(np.abs(p - q))}[divergence]
  teacher, student = (jnp.log(jnp.asarray(d, jnp.float32))[None, None] for d in (p, q))
  weights = jnp.ones((1, 1))
  got = evaluation.distillation_loss(student, teacher, weights, 1.0, divergence)
  assert float(got) == pytest.approx(want, rel=1e-5)
  same = evaluation.distillation_loss(teacher, teacher, weights, 1.0, divergence)
  assert float(same) == pytest.approx(0.0, abs=1e-6)
  if divergence == 'tv':  # 1 - TV is the speculative acceptance sum(min(p, q))
    assert 1.0 - float(got) == pytest.approx(np.minimum(p, q).sum(), rel=1e-5)


def test_an_unknown_divergence_is_one_line():
  with pytest.raises(ValueError, match='kd_divergence must be one of'):
    train_lib._Distillation('token', 'teacher.msgpack', 1.0, 1.0, None, 'hellinger')


def test_token_distillation_runs(multi30k, tmp_path):
  teacher_config = _tiny_config(dropout_rate=0.0)
  params, _ = network.init_params(teacher_config, jax.random.PRNGKey(2))
  weights = tmp_path / 'teacher.msgpack'
  checkpoints.export_weights(params, teacher_config, weights)
  _run(tmp_path / 'draft', multi30k, 1, distillation='token', teacher=str(weights), kd_weight=0.5)
  kd_losses = [r['kd_loss'] for r in _records(tmp_path / 'draft') if 'kd_loss' in r]
  assert len(kd_losses) == 1, kd_losses  # log_every=1: the one step's record has its KD loss
  # A random student against a random teacher: the KL is positive (0 only if they agree).
  assert all(np.isfinite(kd) and kd > 0 for kd in kd_losses), kd_losses


@pytest.mark.parametrize('sequences', ['data', 'teacher', 'both',
                                       'data+teacher_samples+student_samples'])
def test_token_distillation_sequences(multi30k, tmp_path, sequences):
  """kd_sequences picks the pairs token distillation trains on: the real targets, the teacher's
  greedy outputs (the cache sequence distillation writes), the teacher's or the student's own
  samples (each in its own cache), or each input once per source."""
  teacher_config = _tiny_config(dropout_rate=0.0)
  params, _ = network.init_params(teacher_config, jax.random.PRNGKey(3))
  weights = tmp_path / 'teacher.msgpack'
  checkpoints.export_weights(params, teacher_config, weights)
  student = (_tiny_config(), network.init_params(_tiny_config(), jax.random.PRNGKey(4))[0], None)
  cache = tmp_path / 'distill.npz'
  distill = train_lib._Distillation('token', str(weights), 1.0, 1.0, str(cache), 'forward_kl',
                                    sequences)
  dataset = train_lib._Dataset('de', 'en', LENGTH, LENGTH, str(multi30k), None, 4, False, 0)
  batches, num_pairs, _ = train_lib._training_data(dataset, _tiny_config(), distill, 12, 8,
                                                   student, tmp_path / 'run')
  _, _, inputs, targets = dataset.load('train', max_examples=12)
  teacher = distill.load_teacher(_tiny_config())

  def decoded(model, temperature):  # as training decodes them: 8 rows a batch, seed 0
    return evaluation.sequence_distillation_targets(*model, inputs, LENGTH, LENGTH, None, 8,
                                                    temperature=temperature, seed=0)

  sources = {'data': targets, 'teacher': decoded(teacher, 0.0),
             'teacher_samples': decoded(teacher, 1.0), 'student_samples': decoded(student[:2], 1.0)}
  names = ('data+teacher' if sequences == 'both' else sequences).split('+')
  expected = [row for name in names for row in sources[name]]
  assert num_pairs == len(expected) == 12 * len(names)
  assert cache.exists() == ('teacher' in names)
  assert (tmp_path / 'distill.npz.teacher_samples.npz').exists() == ('teacher_samples' in names)
  assert (tmp_path / 'run' / 'student_samples.npz').exists() == ('student_samples' in names)
  assert sorted(map(tuple, batches.targets)) == sorted(map(tuple, expected))


def test_sampled_targets_are_seeded_and_cached_by_temperature(multi30k, tmp_path):
  """Samples at T=1 differ from the greedy outputs, repeat with their seed, differ with another;
  the cache holds one temperature and seed and is recomputed for another."""
  config = _tiny_config(dropout_rate=0.0)
  params, _ = network.init_params(config, jax.random.PRNGKey(5))
  sources, _ = data.load_split('train', 'de', 'en', multi30k)
  inputs = data.encode(sources[:16], LENGTH)
  cache = tmp_path / 'samples.npz'

  def targets(temperature, seed):
    return evaluation.sequence_distillation_targets(config, params, inputs, LENGTH, LENGTH, cache,
                                                    8, temperature=temperature, seed=seed)

  greedy, sampled = targets(0.0, 0), targets(1.0, 0)
  assert sampled != greedy and all(row[-1] == data.EOS_ID for row in sampled)
  assert float(np.load(cache)['temperature']) == 1.0
  assert targets(1.0, 0) == sampled and targets(1.0, 1) != sampled
  assert targets(0.0, 7) == greedy  # the seed of greedy outputs is no part of their key


def test_unknown_kd_sequences_is_one_line():
  with pytest.raises(ValueError, match='kd_sequences must be one of'):
    train_lib._Distillation('token', 't.msgpack', 1.0, 1.0, None, 'forward_kl', 'beam')
  with pytest.raises(ValueError, match='kd_sequences must be one of'):
    train_lib._Distillation('token', 't.msgpack', 1.0, 1.0, None, 'forward_kl', 'data+beam')
  with pytest.raises(ValueError, match='kd_sample_temperature must be > 0'):
    train_lib._Distillation('token', 't.msgpack', 1.0, 1.0, None, 'forward_kl',
                            'teacher_samples', 0.0)


def test_a_decoder_only_draft_trains_over_a_frozen_encoder(multi30k, tmp_path, capsys):
  """train.encoder: the target's encoder runs frozen inside the step and the evaluation;
  init_partial takes a separate draft's decoder; the export loads as a pair's draft."""
  target_config = _tiny_config(dropout_rate=0.0, emb_dim=24)
  target, _ = network.init_params(target_config, jax.random.PRNGKey(4))
  target_path = tmp_path / 'target.msgpack'
  checkpoints.export_weights(target, target_config, target_path)
  separate, _ = network.init_params(_tiny_config(), jax.random.PRNGKey(5))
  separate_path = tmp_path / 'separate.msgpack'
  checkpoints.export_weights(separate, _tiny_config(), separate_path)
  config = _tiny_config(num_encoder_layers=0, encoded_width=24)
  with pytest.raises(ValueError, match='needs train.encoder'):
    _run(tmp_path / 'none', multi30k, 1, config=config)
  with pytest.raises(ValueError, match='has emb_dim 16, but the config reads encoder outputs '
                     'of width 24'):
    _run(tmp_path / 'wrong', multi30k, 1, config=config, encoder=str(separate_path))
  with pytest.raises(ValueError, match='only for a decoder-only config'):
    _run(tmp_path / 'extra', multi30k, 1, encoder=str(target_path))
  out = tmp_path / 'draft.msgpack'
  _run(tmp_path / 'draft', multi30k, 6, config=config, encoder=str(target_path),
       init_from=str(separate_path), init_partial=True, eval_every=3, eval_bleu_examples=4,
       export_path=str(out), learning_rate_scale=1.0)
  losses = _losses(tmp_path / 'draft')
  assert losses[-1] < losses[0], losses
  evals = [r for r in _records(tmp_path / 'draft') if 'eval' in r]
  assert evals and 'bleu' in evals[0]['eval']['validation']
  draft_config, draft = checkpoints.load_model(out)
  assert draft_config == config and 'encoder' not in draft
  # All of the separate draft's decoder was taken but the cross-attention keys and values,
  # which read width 24 here.
  fresh = ('decoder/layers_0/encoder_decoder_attention/key/kernel, '
           'decoder/layers_0/encoder_decoder_attention/value/kernel')
  assert f'15 of 17 parameters taken; fresh: {fresh}' in capsys.readouterr().out
  key = draft['decoder']['layers_0']['encoder_decoder_attention']['key']['kernel']
  assert key.shape == (24, 16)
  # An on-policy round: the exported draft's own samples, drawn over the target's encoder.
  _run(tmp_path / 'round', multi30k, 1, config=config, encoder=str(target_path),
       init_from=str(out), distillation='token', teacher=str(target_path),
       kd_sequences='student_samples', max_train_examples=8, eval_batch_size=8)
  cached = np.load(tmp_path / 'round' / 'student_samples.npz')
  sources, _ = data.load_split('train', 'de', 'en', multi30k)
  want = evaluation.sequence_distillation_targets(
      config, draft, data.encode(sources[:8], LENGTH), LENGTH, LENGTH, None, 8, temperature=1.0,
      encoder=(target_config, target))
  assert [cached['tokens'][i, :n].tolist() for i, n in enumerate(cached['lengths'])] == want


def test_previous_positions_stay_inside_packed_segments():
  x = jnp.arange(1, 7, dtype=jnp.float32).reshape(1, 6, 1)
  segments = jnp.array([[1, 1, 1, 2, 2, 0]])
  moved = evaluation.previous_positions(x, segments)[0, :, 0]
  np.testing.assert_array_equal(moved, [0, 1, 2, 0, 4, 0])


def test_a_feature_draft_trains_on_its_target_s_features(multi30k, tmp_path):
  """Token distillation over the target's features and, in a second pass, its own; the export
  loads as a pair's feature draft."""
  target_config = _tiny_config(dropout_rate=0.0, emb_dim=24)
  target, _ = network.init_params(target_config, jax.random.PRNGKey(4))
  target_path = str(tmp_path / 'target.msgpack')
  checkpoints.export_weights(target, target_config, target_path)
  config = _tiny_config(num_encoder_layers=0, encoded_width=24, feature_width=24)
  reads = dict(config=config, encoder=target_path, teacher=target_path)
  with pytest.raises(ValueError, match='is for a feature draft'):
    _run(tmp_path / 'plain', multi30k, 1, feature_passes=2)
  with pytest.raises(ValueError, match='learns by token distillation'):
    _run(tmp_path / 'none', multi30k, 1, **reads)
  with pytest.raises(ValueError, match='cannot decode alone'):
    _run(tmp_path / 'eval', multi30k, 1, distillation='token', eval_every=2, **reads)
  out = tmp_path / 'draft.msgpack'
  _run(tmp_path / 'draft', multi30k, 6, distillation='token', feature_passes=2,
       export_path=str(out), learning_rate_scale=1.0, **reads)
  records = [r for r in _records(tmp_path / 'draft') if 'loss' in r]
  assert {'kd_loss_pass_1', 'kd_loss_pass_2', 'agreement_pass_2'} <= set(records[0])
  assert records[-1]['kd_loss_pass_1'] < records[0]['kd_loss_pass_1'], records
  draft_config, draft = checkpoints.load_model(out)
  assert draft_config == config and 'input_projection' in draft['decoder']
  models.EncoderDecoderModel(target_config, draft_config)  # (a pair: the widths agree)


def _eight_devices(*args):
  """`train_sharding_worker.py args` on 8 simulated CPU devices (the flag must precede JAX's
  initialisation, hence a subprocess); its RESULT line."""
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=(
      os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip(),
             PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get('PYTHONPATH')])))
  worker = pathlib.Path(__file__).with_name('train_sharding_worker.py')
  proc = subprocess.run([sys.executable, str(worker), *map(str, args)], env=env, cwd=root,
                        capture_output=True, text=True, timeout=900)
  lines = [l for l in proc.stdout.splitlines() if l.startswith('RESULT ')]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  return json.loads(lines[-1][len('RESULT '):])


def test_training_on_a_mesh_equals_one_device_resumes_and_reports_its_memory(tmp_path):
  """One subprocess of 8 CPU devices (its start is most of the cost): a distillation step on
  meshes (1, 8), (2, 4), (8, 1) against one device; a run on the (2, 4) mesh stopped and
  resumed; the distillation step's memory per mesh (benchmarks.scale --distill)."""
  report = _eight_devices(tmp_path / 'runs', _pairs_file(tmp_path / 'train.tsv', PAIRS * 4),
                          '1x8', '2x4', '8x1')
  step = report['step']
  assert step['devices'] == 8
  for name, result in step['results'].items():
    assert result['grad_scale'] > 1e-3, (name, result)  # gradients worth comparing
    for shape, shards in (('1x8', 8), ('2x4', 4), ('8x1', 1)):
      if name == 'decoder_only_draft' and shape != '8x1':
        continue  # the worker runs it on the last mesh only
      got = result[shape]
      assert got['query_shards'] == got['teacher_query_shards'] == shards, (name, shape, got)
      assert got['loss'] <= 1e-5 * abs(result['loss']), (name, shape, got)
      assert got['grads'] <= 1e-5 * result['grad_scale'] + 1e-7, (name, shape, got)
      assert got['params_after_step'] <= 1e-5, (name, shape, got)
  # Resumed on the mesh: the same losses and state as straight through; close to one device.
  resume = report['resume']
  assert resume['steps'] == 4
  assert resume['losses'] == resume['state'] == 0.0, resume
  assert resume['one_device_losses'] < 1e-4, resume
  # Splitting the frozen teacher over 'model' lowers what a device holds, for both students.
  blocks = report['distill_memory']
  assert set(blocks) == {'cpu tiny 1x8 b8', 'cpu tiny 8x1 b8'}
  for draft in ('small', 'small-dec2'):
    split, whole = (blocks[f'cpu tiny {m} b8']['drafts'][draft]['fit']['bytes']
                    for m in ('1x8', '8x1'))
    assert 0 < split < whole, (draft, split, whole)


def test_a_batch_the_mesh_cannot_split_is_one_line(multi30k, tmp_path):
  class ThreeWay(partitioning.Partitioner):
    data_size = 3  # as a (3, 1) mesh's, on this one device

  partitioner = ThreeWay()
  with pytest.raises(ValueError, match='batch_size 4 must be a multiple'):
    _run(tmp_path, multi30k, 1, partitioner=partitioner)


# ------------------------------------------------------------------------------------------------
# Training data from files, and bad settings: one line.

PAIRS = [('Ein Hund rennt.', 'A dog runs.'), ('Zwei Katzen schlafen.', 'Two cats sleep.'),
         ('Ein Mann fährt Rad.', 'A man rides a bike.')] * 4


def _pairs_file(path, pairs=PAIRS):
  if path.suffix == '.jsonl':
    path.write_text(''.join(json.dumps({'inputs': s, **({'targets': t} if t else {})}) + '\n'
                            for s, t in pairs), encoding='utf-8')
  else:
    path.write_text('inputs\ttargets\n' + ''.join(f'{s}\t{t}\n' for s, t in pairs),
                    encoding='utf-8')
  return str(path)


def test_training_reads_tsv_and_jsonl_files(tmp_path):
  files = {'train': _pairs_file(tmp_path / 'train.tsv'),
           'validation': _pairs_file(tmp_path / 'dev.jsonl')}
  results = _run(tmp_path / 'run', None, 2, data_files=files, max_train_examples=None)
  assert int(results['state']['step']) == 2
  sources, references, inputs, targets = train_lib.load_examples(
      'train', 'de', 'en', LENGTH, LENGTH, data_file=files['train'])
  assert (sources, references) == tuple(map(list, zip(*PAIRS)))
  assert inputs[0] == data.encode([PAIRS[0][0]], LENGTH)[0]
  assert targets[1] == data.encode([PAIRS[1][1]], LENGTH)[0]


def _train_cli(args, capsys):
  """(exit status, stderr) of `speculative-t5x-train ARGS`, in this process."""
  def define_flags():
    gin_utils.define_gin_flags()
    gin_utils.define_process_flags()

  return conftest.run_command(train_lib.main, define_flags, 'speculative-t5x-train', args, capsys)


@pytest.fixture
def tiny_run(tmp_path):
  """A gin file of a tiny run over a TSV file: [--gin_file=...] plus its model folder."""
  config = _tiny_config()
  lines = [f'network.T5Config.{f} = {getattr(config, f)!r}'
           for f in ('vocab_size', 'emb_dim', 'num_heads', 'head_dim', 'num_encoder_layers',
                     'num_decoder_layers', 'mlp_dim', 'mlp_activations', 'logits_via_embedding')]
  train_file = _pairs_file(tmp_path / 'train.tsv')
  lines += ['train.config = @network.T5Config()', f"train.model_dir = '{tmp_path / 'run'}'",
            f"train.data_files = {{'train': '{train_file}', 'validation': '{train_file}'}}",
            'train.batch_size = 4', 'train.num_train_steps = 1', 'train.eval_every = 0',
            'train.final_eval_splits = []', f'train.max_input_length = {LENGTH}',
            f'train.max_target_length = {LENGTH}']
  (tmp_path / 'tiny.gin').write_text('\n'.join(lines) + '\n')
  return [f'--gin_file={tmp_path / "tiny.gin"}']


def _teacher_of_another_vocabulary(tmp_path):
  config = _tiny_config(vocab_size=256)
  params, _ = network.init_params(config, jax.random.PRNGKey(0))
  path = tmp_path / 'teacher.msgpack'
  checkpoints.export_weights(params, config, path, {})
  return path


def test_bad_training_settings_are_one_line(tiny_run, tmp_path, capsys):
  no_target = _pairs_file(tmp_path / 'no_target.jsonl',
                          [('Ein Hund.', 'A dog.'), ('Eine Katze.', '')])
  one = _pairs_file(tmp_path / 'one.tsv', PAIRS[:1])
  cases = {
      'unknown binding': (['--gin.train.bogus=1'], 'bogus'),
      'missing teacher': (["--gin.train.distillation='token'",
                           "--gin.train.teacher='/nonexistent/teacher.msgpack'"], 'nonexistent'),
      'teacher of another vocabulary': (
          ["--gin.train.distillation='token'",
           f"--gin.train.teacher='{_teacher_of_another_vocabulary(tmp_path)}'"],
          'share the (padded) vocabulary'),
      'fewer examples than a batch': (
          [f"--gin.train.data_files={{'train': '{one}', 'validation': '{one}'}}"],
          'packs into 1 rows, fewer than one batch of 4'),
      'a training line without a target': (
          [f"--gin.train.data_files={{'train': '{no_target}'}}"],
          'no_target.jsonl:2: a training example needs a target'),
  }
  for name, (args, expected) in cases.items():
    status, err = _train_cli([*tiny_run, *args], capsys)
    lines = [line for line in err.splitlines() if line.startswith('error: ')]
    assert status == 1 and len(lines) == 1 and expected in lines[0], (name, err[-2000:])
    assert 'Traceback' not in err, (name, err[-2000:])


def test_gin_binds_the_partitioner_as_for_the_infer_job(tiny_run, capsys):
  status, err = _train_cli([*tiny_run, '--gin.train.partitioner=@partitioning.Partitioner()',
                            '--gin.partitioning.Partitioner.mesh_shape=(1, 1)'], capsys)
  assert status == 0, err[-2000:]


def test_two_processes_train_as_one(tiny_run, tmp_path):
  """Two jax.distributed processes (one CPU device each) on a (2, 1) mesh, each feeding its rows
  of every batch: the same losses as one process, one log, one export, evaluations on both."""
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  common = [sys.executable, '-m', 'speculative_t5x.train', *tiny_run,
            '--gin.train.num_train_steps=3', '--gin.train.log_every=1',
            '--gin.train.eval_every=2', "--gin.train.final_eval_splits=['validation']"]
  multi = [*common, f"--gin.train.model_dir='{tmp_path / 'multi'}'",
           f"--gin.train.export_path='{tmp_path / 'multi.msgpack'}'",
           '--gin.train.partitioner=@partitioning.Partitioner()',
           '--gin.partitioning.Partitioner.mesh_shape=(2, 1)',
           f'--coordinator_address=localhost:{port}', '--process_count=2']
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  procs = [subprocess.Popen([*multi, f'--process_index={i}'], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  for proc in procs:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
  # The same run in this process (one device; tiny_run's settings).
  train_file = str(tmp_path / 'train.tsv')
  train_lib.train(model_dir=str(tmp_path / 'single'), config=_tiny_config(),
                  data_files={'train': train_file, 'validation': train_file}, batch_size=4,
                  max_input_length=LENGTH, max_target_length=LENGTH, num_train_steps=3,
                  log_every=1, eval_every=2, final_eval_splits=['validation'])
  losses = {name: [r['loss'] for r in _records(tmp_path / name) if 'loss' in r]
            for name in ('multi', 'single')}
  assert len(losses['multi']) == 3  # one process logs
  np.testing.assert_allclose(losses['multi'], losses['single'], rtol=1e-5)
  assert (tmp_path / 'multi.msgpack').is_file()
  evals = [r for r in _records(tmp_path / 'multi') if 'eval' in r]
  assert [r['step'] for r in evals] == [2, 3]
