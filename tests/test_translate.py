"""The main command's pieces on a tiny model: input selection and the out-of-domain score."""

import argparse
import dataclasses
import io

import jax
import numpy as np

from speculative_t5x import checkpoints
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import pipeline
from speculative_t5x import translate
from conftest import apply
from fast_params import random_params

CONFIG = network.T5Config(vocab_size=64, emb_dim=16, num_heads=2, head_dim=8,
                          num_encoder_layers=1, num_decoder_layers=1, mlp_dim=32,
                          mlp_activations=('gelu', 'linear'), dropout_rate=0.0)


def _args(**kwargs):
  return argparse.Namespace(**{'sentences': [], 'file': None, **kwargs})


def test_inputs_arguments_then_file_then_stdin_then_the_bundled_sample(tmp_path, monkeypatch):
  assert translate._read_sentences(_args(sentences=[' a ', '', 'b'])) == ['a', 'b']
  (tmp_path / 'in.de').write_text('x\n\n y\n', encoding='utf-8')
  assert translate._read_sentences(_args(file=str(tmp_path / 'in.de'))) == ['x', 'y']
  monkeypatch.setattr('sys.stdin', io.StringIO('Ein Satz.\n'))
  assert translate._read_sentences(_args()) == ['Ein Satz.']
  monkeypatch.setattr('sys.stdin', io.StringIO(''))  # nothing piped: the sample
  sample = translate._read_sentences(_args())
  assert sample == translate.SAMPLE.read_text(encoding='utf-8').split('\n')[:len(sample)]
  assert len(sample) == 8


def test_mean_token_log_probs_is_the_targets_per_token_mean():
  params = {'target': random_params(CONFIG, 0)}
  model = models.EncoderDecoderModel(CONFIG, CONFIG)
  rng = np.random.default_rng(0)
  encoder_input_tokens = rng.integers(3, 64, (3, 6)).astype(np.int32)
  decodes = rng.integers(3, 64, (3, 5)).astype(np.int32)
  decodes[0, 2:] = [1, 0, 0]  # EOS at 2, then padding
  decodes[1, 4] = 1
  got = translate.mean_token_log_probs(model, params, encoder_input_tokens, decodes)

  decoder_input_tokens = np.pad(decodes[:, :-1], ((0, 0), (1, 0)))
  logits = apply(model.module, {'params': params['target']}, encoder_input_tokens,
                 decoder_input_tokens, decodes)
  log_probs = np.asarray(jax.nn.log_softmax(logits))
  for row, length in enumerate((3, 5, 5)):
    expect = np.mean([log_probs[row, i, decodes[row, i]] for i in range(length)])
    np.testing.assert_allclose(got[row], expect, rtol=1e-5)


def test_main_translates_batches_of_different_widths(tmp_path, capsys):
  """The command end to end (tiny random weights given as --target/--draft files): three
  sentences in batches of two whose encoder widths differ."""
  target = dataclasses.replace(CONFIG, vocab_size=8064)
  draft = dataclasses.replace(target, num_decoder_layers=1)
  checkpoints.export_weights(random_params(target, 0), target, tmp_path / 'target.msgpack')
  checkpoints.export_weights(random_params(draft, 1), draft, tmp_path / 'draft.msgpack')
  sentences = ['Zwei Hunde spielen im Schnee.', 'Ein Hund rennt.',
               'Ein Mann mit einem roten Hut und einer blauen Jacke steht neben einem Auto.' * 2]
  weights = ['--target', str(tmp_path / 'target.msgpack'),
             '--draft', str(tmp_path / 'draft.msgpack')]
  translate.main(['--batch_size', '2', '--gamma', '1', *weights, *sentences])
  captured = capsys.readouterr()
  # What it does while it shows nothing else: on stderr, before the translations.
  assert captured.err.splitlines() == [
      'compiling greedy speculative (gamma 1) and target-only decoding for 3 sentences ...',
      'decoding, then timing speculative vs target-only: 5 alternating runs of each ...']
  out = captured.out.splitlines()
  assert [line for line in out if not line.startswith('  -> ')][:3] == sentences
  assert len([line for line in out if line.startswith('  -> ')]) == 3
  assert out[-1].startswith('3 sentences, gamma=1: alpha='), out[-1]
  assert out[-1].endswith('outputs identical to target-only greedy: True')


def _decoded(stats, schedule, measured):
  tokens = np.ones((2, 3), np.int32)
  return pipeline.Decoded(texts=['a', 'b'], tokens=tokens, scores=np.zeros(2), stats=stats,
                          schedule=schedule, policy={'measured': measured,
                                                     'fallback_only': False})


def test_summary_says_when_auto_turned_speculation_off(capsys):
  """gamma='auto' ran the target alone on every batch: the summary says so and why, not
  alpha=0.000 (which reads as a draft that never agrees)."""
  measured = {'0': {'batches': 3, 'ms_per_position': 1.1},
              '2': {'batches': 1, 'ms_per_position': 1.6},
              '1': {'batches': 1, 'ms_per_position': 1.4}}
  off = _decoded({}, {2: {0: 1}}, measured)
  translate._print_statistics(2, 'auto', {'speculative': off, 'target-only': off},
                              {'speculative': 0.05, 'target-only': 0.05}, 5)
  line = capsys.readouterr().out.strip()
  assert ('gamma=auto at batch size 2: 0 x1; ms per output position 0: 1.10, 2: 1.60, 1: 1.40: '
          'speculation off: gamma 0 (the target alone) measured faster than gamma 1 on these '
          'batches, speculative 50 ms') in line, line
  assert 'alpha' not in line
  on = _decoded({'proposed': np.array([4, 4]), 'accepted': np.array([2, 1]),
                 'emitted': np.array([5, 4]), 'target_calls': np.array([2, 2])},
                {2: {2: 1}}, measured)
  translate._print_statistics(2, 'auto', {'speculative': on, 'target-only': on},
                              {'speculative': 0.04, 'target-only': 0.05}, 5)
  assert 'alpha=0.375, 2.25 tokens per target call' in capsys.readouterr().out
