"""The main command's pieces on a tiny model: input selection and the out-of-domain score."""

import argparse
import dataclasses
import io

import jax
import numpy as np

from speculative_t5x import checkpoints
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import translate
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
  logits = model.module.apply({'params': params['target']}, encoder_input_tokens,
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
  out = capsys.readouterr().out.splitlines()
  assert [line for line in out if not line.startswith('  -> ')][:3] == sentences
  assert len([line for line in out if line.startswith('  -> ')]) == 3
  assert out[-1].startswith('3 sentences, gamma=1: alpha='), out[-1]
  assert out[-1].endswith('outputs identical to target-only greedy: True')
