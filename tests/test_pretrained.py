"""The embedded Multi30k pair: speculative greedy and beam search equal the target's own, and HF
parity."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import data_dir
from conftest import shared_files
from speculative_t5x import beam_search
from speculative_t5x import checkpoints
from speculative_t5x import data
from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import pipeline
from speculative_t5x import policy

PRETRAINED = Path(data.__file__).resolve().parent / 'pretrained'
LENGTH = 32  # input and output tokens
# Used when ../shared/data is absent (a fresh clone); Multi30k-style captions.
FALLBACK_SENTENCES = [
    'Ein Mann fährt mit dem Fahrrad eine Straße entlang.',
    'Zwei Hunde spielen im Schnee.',
    'Eine Frau liest ein Buch auf einer Bank im Park.',
    'Ein kleines Mädchen in einem roten Kleid läuft über das Gras.',
    'Mehrere Menschen stehen vor einem Gebäude.',
    'Ein Junge springt in einen See.',
]


@pytest.fixture(scope='module')
def sentences():
  lines = data_dir() / 'multi30k' / 'test_2016_flickr.de'
  if lines.is_file():
    return lines.read_text(encoding='utf-8').splitlines()[:6]
  return FALLBACK_SENTENCES


@pytest.fixture(scope='module')
def loaded():
  """The embedded pair as `pipeline.load_pair` loads it: float32, decode variables prepared."""
  return pipeline.load_pair()


@pytest.fixture(scope='module')
def pair(loaded):
  """(target_config, draft_config, {'target', 'draft', 'decode'})."""
  return loaded.target_config, loaded.draft_config, loaded.params


def _batch(sentences):
  batch = data.pad_batch(data.encode(sentences, LENGTH), None, LENGTH, LENGTH)
  return {k: jnp.asarray(v) for k, v in batch.items()}


def _greedy(pair, batch, decode_fn, kwargs):
  target_config, draft_config, params = pair
  model = models.EncoderDecoderModel(target_config, draft_config, decode_fn=decode_fn,
                                     decode_kwargs=kwargs, eos_id=data.EOS_ID)
  return np.asarray(jax.jit(model.predict_batch)(params, batch))


@pytest.fixture(scope='module')
def target_greedy(pair, sentences):
  return _greedy(pair, _batch(sentences), decoding.temperature_sample, {'temperature': 0.0})


def test_speculative_greedy_equals_target_greedy(pair, sentences, target_greedy):
  speculative = _greedy(pair, _batch(sentences), decoding.speculative_sample,
                        {'temperature': 0.0, 'gamma': 4})
  np.testing.assert_array_equal(speculative, target_greedy)
  # Real translations, not an agreement on empty or runaway outputs.
  assert target_greedy.shape == (6, LENGTH)
  assert ((target_greedy > 1).any(axis=1)).all()
  assert ((target_greedy == data.EOS_ID).any(axis=1)).all()
  assert all(text.strip() for text in data.decode(target_greedy))


def test_pipeline_decodes_strings_to_the_target_greedy_texts(loaded, sentences, target_greedy):
  """The string-level entry: texts in, the target's greedy translations out, for the
  speculative decoder (fixed and automatic gamma) and the target alone."""
  pipe = pipeline.Pipeline(loaded, batch_size=4, max_input_length=LENGTH,
                           max_output_length=LENGTH)
  want = data.decode(target_greedy)
  speculative = pipe.decode(sentences, 'speculative', gamma=2)
  np.testing.assert_array_equal(speculative.tokens, target_greedy)
  assert speculative.texts == want and all(want)
  assert speculative.schedule == {4: {None: 2}}  # 6 sentences: 2 batches of 4 rows
  assert speculative.stats['target_calls'].shape == (6,)
  assert (speculative.stats['accepted'] > 0).any()
  auto = pipe.decode(sentences)  # gamma='auto': the fallback, then the plain decoder
  assert policy.FALLBACK_GAMMA == 2
  assert auto.texts == want and auto.schedule == {4: {2: 1, 0: 1}}
  assert auto.policy['setting'] == 'gamma' and set(auto.policy['measured']) == {'0', '2'}
  assert pipe.decode(sentences).texts == want  # the policy goes on measuring across calls
  # compile() compiles every gamma ahead, so that no later decode compiles (the translate
  # command times decode calls).
  assert pipe.compile(sentences) > 0
  _, predictor = pipe.prepare('speculative', {}, 4)
  assert {choice for choice, _ in predictor._compiled} == set(range(policy.MAX_GAMMA + 1))
  compiled = predictor.compile_seconds
  for _ in range(3):
    pipe.decode(sentences)
  assert predictor.compile_seconds == compiled and pipe.compile(sentences) == 0
  assert pipe.decode(sentences, 'target').texts == want
  with pytest.raises(ValueError, match='unknown decoder'):
    pipe.decode(sentences, 'nonsense')


def test_rounded_encoder_width_keeps_the_outputs(pair, sentences, target_greedy):
  """Encoding only up to the longest input rounded up to 8 (benchmark and translate round to
  16): the padding the encoder skips is masked, so greedy tokens stay those of the full width."""
  ids = data.encode(sentences, LENGTH)
  short = [i for i, row in enumerate(ids) if len(row) <= 24]
  assert len(short) >= 3
  batch = data.pad_batch([ids[i] for i in short], None, LENGTH, LENGTH, length_step=8)
  assert batch['encoder_input_tokens'].shape[1] <= 24
  speculative = _greedy(pair, {k: jnp.asarray(v) for k, v in batch.items()},
                        decoding.speculative_sample, {'temperature': 0.0, 'gamma': 2})
  np.testing.assert_array_equal(speculative, target_greedy[short])


def test_speculative_beam_search_equals_beam_search(pair, sentences):
  """Beam 4, T5X's brevity penalty: the same beams and scores, in fewer target calls."""
  target_config, draft_config, params = pair
  batch = _batch(sentences[:3])
  outputs = {}
  for name, fn in (('beam', beam_search.beam_search),
                   ('speculative', beam_search.speculative_beam_search)):
    model = models.EncoderDecoderModel(target_config, draft_config, decode_fn=fn,
                                       decode_kwargs={'alpha': 0.6}, eos_id=data.EOS_ID)
    outputs[name] = jax.jit(functools.partial(model.predict_batch_with_aux, num_decodes=4,
                                              return_all_decodes=True))(params, batch)
  (beams, aux), (spec_beams, spec_aux) = outputs['beam'], outputs['speculative']
  np.testing.assert_array_equal(np.asarray(spec_beams), np.asarray(beams))
  np.testing.assert_allclose(spec_aux['scores'], aux['scores'], rtol=1e-5, atol=1e-4)
  stats = spec_aux['stats']
  # One target call per beam step for beam_search; fewer here, each over the whole tree.
  assert (stats['target_calls'] < stats['emitted']).all()


def test_hf_export_of_target(pair, sentences, target_greedy):
  torch = pytest.importorskip('torch')
  pytest.importorskip('transformers')
  from speculative_t5x import hf  # pylint: disable=g-import-not-at-top
  from speculative_t5x import network  # pylint: disable=g-import-not-at-top

  config, _, params = pair
  enc = np.asarray(_batch(sentences[:3])['encoder_input_tokens'])
  ours = target_greedy[:3]
  model = hf.to_hf_model(config, params['target'])

  # Teacher-forced logits on our greedy outputs, up to and including EOS (where nothing is
  # padding, so both models see the same decoder positions).
  dec_in = np.concatenate([np.zeros((3, 1), ours.dtype), ours[:, :-1]], axis=1)
  logits = np.asarray(network.Transformer(config).apply(
      {'params': params['target']}, jnp.asarray(enc), jnp.asarray(dec_in), jnp.asarray(ours)))
  with torch.no_grad():
    theirs = model(input_ids=torch.tensor(enc, dtype=torch.long),
                   attention_mask=torch.tensor(enc > 0),
                   decoder_input_ids=torch.tensor(dec_in, dtype=torch.long)).logits.numpy()
  upto_eos = np.cumsum(ours == data.EOS_ID, axis=1) - (ours == data.EOS_ID) == 0
  assert (ours[upto_eos] > 0).all()
  scale = np.abs(theirs[upto_eos]).max()
  np.testing.assert_allclose(logits[upto_eos], theirs[upto_eos], atol=1e-4 * scale, rtol=0)

  # transformers 5.x sizes generate()'s own decoder cache by num_layers (the encoder's 5) and
  # fails on this 6-layer decoder; a lazily grown cache works.
  from transformers import cache_utils  # pylint: disable=g-import-not-at-top
  # HF's assistant is a whole T5: the separate draft (the default one reads the target's encoder).
  with pytest.raises(ValueError, match='no Hugging Face T5 form'):
    hf.to_hf_model(pair[1], params['draft'])
  draft = hf.to_hf_model(*pipeline.load_model(pipeline.EMBEDDED_SEPARATE_DRAFT))

  def generate(rows, assistant):
    with torch.no_grad():
      out = model.generate(
          torch.tensor(rows, dtype=torch.long), attention_mask=torch.tensor(rows > 0),
          max_new_tokens=LENGTH, do_sample=False, num_beams=1, assistant_model=assistant,
          cache=cache_utils.EncoderDecoderCache(cache_utils.DynamicCache(),
                                                cache_utils.DynamicCache())).numpy()
    assert (out[:, 0] == 0).all()
    aligned = np.zeros((len(rows), LENGTH), ours.dtype)
    aligned[:, :out.shape[1] - 1] = out[:, 1:]
    return aligned

  np.testing.assert_array_equal(generate(enc, None), ours)
  # HF's assisted generation takes one sequence at a time.
  assisted = np.concatenate([generate(enc[i:i + 1], draft) for i in range(len(enc))])
  np.testing.assert_array_equal(assisted, ours)


def test_the_embedded_drafts(loaded, sentences, target_greedy):
  """The default draft has no encoder: its cross-attention reads the target's encoder output.
  The separate draft (its own encoder) also ships; speculative greedy with either is the
  target's greedy output, and both propose from the captions' vocabulary only (a cut that keeps
  outputs exact)."""
  config = loaded.draft_config
  assert (config.num_encoder_layers, config.num_decoder_layers) == (0, 2)
  assert config.encoded_width == loaded.target_config.emb_dim
  assert 'encoder' not in loaded.params['draft']
  separate = pipeline.load_pair(draft=pipeline.EMBEDDED_SEPARATE_DRAFT)
  assert (separate.draft_config.num_encoder_layers, separate.draft_config.encoded_width) == (3, 0)
  for pair in (loaded, separate):
    kept = pair.params['decode']['draft']['decoder']['logits_index'] >= 0
    assert 3900 < int(kept.sum()) < pair.draft_config.vocab_size
  speculative = _greedy((separate.target_config, separate.draft_config, separate.params),
                        _batch(sentences), decoding.speculative_sample,
                        {'temperature': 0.0, 'gamma': 4})
  np.testing.assert_array_equal(speculative, target_greedy)


def test_the_drafts_vocabulary_files_are_the_training_captions_tokens(tmp_path):
  """scripts/train_pair.sh writes each shipped draft's `.vocabulary.json` byte for byte."""
  shared_files('multi30k/train.en')
  vocabulary = data.caption_vocabulary(data_dir=data_dir())
  written = checkpoints.write_draft_vocabulary(tmp_path / 'draft.msgpack', vocabulary,
                                               data.CAPTION_VOCABULARY_SOURCE)
  for draft in (pipeline.EMBEDDED_DRAFT, pipeline.EMBEDDED_SEPARATE_DRAFT):
    shipped = Path(str(draft) + checkpoints.DRAFT_VOCABULARY_SUFFIX)
    assert written.read_bytes() == shipped.read_bytes(), shipped
  assert np.array_equal(checkpoints.load_draft_vocabulary(tmp_path / 'draft.msgpack'), vocabulary)
