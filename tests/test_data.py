"""Tests of the Multi30k vocabulary, tokenization, packing and seqio tasks (speculative_t5x.data)."""

import importlib.util
import json

import numpy as np
import pytest

from speculative_t5x import data


def test_vocabulary_follows_t5_conventions():
  sp = data.get_sentencepiece()
  assert sp.get_piece_size() == 8000
  assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (0, 1, 2, -1)
  assert data.padded_vocab_size() == 8064
  assert data.VOCAB_PATH.stat().st_size < 1_000_000


def test_vocabulary_round_trips_text():
  texts = ['Zwei junge Männer stehen vor einem Gebäude und lächeln.',
           'A little girl in a pink dress is climbing stairs.',
           'Ein Mann mit Hut überquert die Straße, während es regnet.']
  ids = data.encode(texts)
  assert all(row[-1] == data.EOS_ID and data.EOS_ID not in row[:-1] for row in ids)
  assert all(min(row) > data.PAD_ID for row in ids)
  assert data.decode(ids) == texts


def test_truncation_keeps_eos():
  (row,) = data.encode(['ein ' * 100], max_length=8)
  assert len(row) == 8 and row[-1] == data.EOS_ID


def test_validation_split_round_trips(multi30k):
  sources, targets = data.load_split('validation', 'de', 'en', multi30k)
  assert len(sources) == len(targets) == 1014
  for lines in (sources, targets):
    decoded = data.decode(data.encode(lines))
    same = np.mean([a == b.strip() for a, b in zip(decoded, lines)])
    # SentencePiece's NFKC normalisation may rewrite a rare character; nothing else may change.
    assert same > 0.99, same
  test_sources, _ = data.load_split('test', 'de', 'en', multi30k)
  assert len(test_sources) == 1000


def test_pad_batch_rounds_the_encoder_width_up_to_the_step():
  rows = [[5, 6, 7, 1], list(range(3, 20)) + [1]]  # 4 and 18 tokens
  fixed = data.pad_batch(rows, None, 64, 32, batch_size=4)
  assert fixed['encoder_input_tokens'].shape == (4, 64)
  rounded = data.pad_batch(rows, None, 64, 32, batch_size=4, length_step=16)
  assert rounded['encoder_input_tokens'].shape == (4, 32)
  assert rounded['decoder_input_tokens'].shape == (4, 32)
  np.testing.assert_array_equal(rounded['encoder_input_tokens'],
                                fixed['encoder_input_tokens'][:, :32])
  assert data.pad_batch(rows[:1], None, 64, 32, length_step=16)[
      'encoder_input_tokens'].shape == (1, 16)
  # Never wider than max_input_length, which also truncates as without a step.
  capped = data.pad_batch([list(range(3, 73))], None, 64, 32, length_step=48)
  assert capped['encoder_input_tokens'].shape == (1, 64)
  np.testing.assert_array_equal(capped['encoder_input_tokens'][0], np.arange(3, 67))


def test_packing_keeps_examples_separate():
  inputs = [[5, 6, 1], [7, 1], [8, 9, 10, 1], [11, 1]]
  targets = [[20, 1], [21, 22, 1], [23, 1], [24, 25, 26, 27, 1]]
  rows = data.pack_examples(inputs, targets, np.arange(4), 8, 8)
  assert sorted(i for row in rows for i in row) == [0, 1, 2, 3]
  batch = data.packed_batch(inputs, targets, rows, 8, 8)
  assert batch['encoder_input_tokens'].shape == (len(rows), 8)
  row0 = rows[0]
  assert row0[:2] == [0, 1]
  np.testing.assert_array_equal(batch['decoder_target_tokens'][0, :5], [20, 1, 21, 22, 1])
  # Each segment's decoder input starts from BOS 0 and is its own targets shifted right.
  np.testing.assert_array_equal(batch['decoder_input_tokens'][0, :5], [0, 20, 0, 21, 22])
  np.testing.assert_array_equal(batch['decoder_segment_ids'][0, :5], [1, 1, 2, 2, 2])
  np.testing.assert_array_equal(batch['encoder_segment_ids'][0, :5], [1, 1, 1, 2, 2])
  for key in ('encoder_input_tokens', 'decoder_target_tokens'):
    for r in range(len(rows)):
      assert np.all((batch[key][r] > 0) == (batch[key.replace('input', 'segment').replace(
          'target', 'segment').replace('_tokens', '_ids')][r] > 0))


def test_packed_batches_resume_to_the_same_stream():
  rng = np.random.default_rng(0)
  inputs = [list(rng.integers(3, 50, rng.integers(1, 6))) + [1] for _ in range(40)]
  targets = [list(rng.integers(3, 50, rng.integers(1, 6))) + [1] for _ in range(40)]
  a = data.PackedBatches(inputs, targets, 2, 16, 16, seed=3)
  stream = [next(a) for _ in range(12)]  # Crosses epoch boundaries.
  b = data.PackedBatches(inputs, targets, 2, 16, 16, seed=3)
  for _ in range(5):
    next(b)
  c = data.PackedBatches(inputs, targets, 2, 16, 16, seed=3)
  c.set_state(b.state)
  for expected in stream[5:]:
    got = next(c)
    for key in expected:
      np.testing.assert_array_equal(got[key], expected[key])


@pytest.mark.skipif(importlib.util.find_spec('seqio') is None, reason='seqio is not installed.')
def test_seqio_tasks(multi30k):
  import seqio  # pylint: disable=g-import-not-at-top
  names = data.register_tasks(multi30k)
  assert set(names) == {'multi30k_de_en', 'multi30k_en_de'}
  task = seqio.get_mixture_or_task('multi30k_de_en')
  vocab = task.output_features['targets'].vocabulary
  assert vocab.vocab_size == 8000 and vocab.eos_id == 1
  ex = next(task.get_dataset(None, split='validation', shuffle=False).as_numpy_iterator())
  sources, targets = data.load_split('validation', 'de', 'en', multi30k)
  np.testing.assert_array_equal(ex['inputs'], data.encode(sources[:1])[0])
  np.testing.assert_array_equal(ex['targets'], data.encode(targets[:1])[0])
  test = task.get_dataset(None, split='test', shuffle=False)
  assert sum(1 for _ in test) == 1000
  assert task.metric_fns[0](targets[:5], targets[:5])['bleu'] == pytest.approx(100.0)


@pytest.mark.skipif(importlib.util.find_spec('seqio') is None, reason='seqio is not installed.')
def test_file_task_mixed_with_a_task(tmp_path):
  import seqio  # pylint: disable=g-import-not-at-top
  from speculative_t5x import errors, tasks  # pylint: disable=g-import-not-at-top
  pairs = [('Ein Hund läuft.', 'A dog runs.'), ('Zwei\tMänner.', 'Two men.')]  # a tab in a caption
  path = tmp_path / 'teacher.jsonl'
  path.write_text(''.join(json.dumps({'inputs': s, 'targets': t}) + '\n' for s, t in pairs))
  name = tasks.mix_with_files('multi30k_de_en', {'train': str(path)}, name='teacher_mix')
  assert name == 'teacher_mix'
  mixture = seqio.get_mixture_or_task(name)
  assert sorted(t.name for t in mixture.tasks) == ['multi30k_de_en', 'teacher_mix_files']
  assert mixture.get_rate(seqio.get_mixture_or_task('teacher_mix_files')) == 1.0
  got = list(seqio.get_mixture_or_task('teacher_mix_files').get_dataset(
      None, split='train', shuffle=False).as_numpy_iterator())
  for ex, ids in zip(got, data.encode([s for s, _ in pairs])):
    np.testing.assert_array_equal(ex['inputs'], ids)
  np.testing.assert_array_equal([ex['targets'] for ex in got][0],
                                data.encode([pairs[0][1]])[0])
  assert tasks.mix_with_files('multi30k_de_en', {'train': str(path)}, name='teacher_mix') == name
  path.write_text(json.dumps({'inputs': 'Ein Hund.'}) + '\n')
  with pytest.raises(errors.InferError, match=r'teacher.jsonl:1: a training example needs a target'):
    list(seqio.get_mixture_or_task('teacher_mix_files').get_dataset(None, split='train'))


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
  """A machine without the data folder: the cache is `tmp_path`, nothing in it yet."""
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
  monkeypatch.delenv(data.DATA_ENV_VAR, raising=False)
  monkeypatch.setattr(data, 'default_data_dir', data.cache_dir)
  return tmp_path


def _mirror(folder, texts):
  """A mirror URL (file://) serving each `name: text` as `<name>.gz`."""
  import gzip
  folder.mkdir()
  for name, text in texts.items():
    (folder / f'{name}.gz').write_bytes(gzip.compress(text.encode()))
  return folder.as_uri() + '/{name}.gz'


def test_a_machine_without_the_data_folder_fetches_a_split_once_and_checks_it(
    empty_cache, monkeypatch, capsys):
  import hashlib
  texts = {'val.de': 'Ein Hund.\nZwei Katzen.\n', 'val.en': 'A dog.\nTwo cats.\n'}
  monkeypatch.setenv(data.URL_ENV_VAR, _mirror(empty_cache / 'mirror', texts))
  monkeypatch.setattr(data, 'MULTI30K_SHA256',
                      {k: hashlib.sha256(v.encode()).hexdigest() for k, v in texts.items()})
  assert data.load_split('validation') == (['Ein Hund.', 'Zwei Katzen.'], ['A dog.', 'Two cats.'])
  assert 'fetching Multi30k val.de' in capsys.readouterr().err
  (empty_cache / 'mirror' / 'val.de.gz').unlink()  # now cached: no second fetch
  assert data.load_split('validation')[0] == ['Ein Hund.', 'Zwei Katzen.']
  assert capsys.readouterr().err == ''
  assert sorted(p.name for p in data.multi30k_dir().iterdir()) == ['val.de', 'val.en']


def test_a_changed_download_is_refused_and_leaves_nothing(empty_cache, monkeypatch):
  monkeypatch.setenv(data.URL_ENV_VAR, _mirror(empty_cache / 'mirror', {'val.de': 'changed\n'}))
  with pytest.raises(data.DataNotFound, match='sha256 .* refused'):
    data.load_split('validation')
  assert not data.multi30k_dir().exists() or not any(data.multi30k_dir().iterdir())


def test_offline_is_one_line_that_says_what_to_do(empty_cache, monkeypatch):
  monkeypatch.setenv(data.URL_ENV_VAR, 'http://127.0.0.1:9/{name}.gz')  # nothing listens
  with pytest.raises(data.DataNotFound) as e:
    data.load_split('test')
  assert '\n' not in str(e.value) and 'offline?' in str(e.value)
  assert data.DATA_ENV_VAR in str(e.value)


def test_an_explicit_data_folder_is_never_fetched_into(tmp_path):
  with pytest.raises(data.DataNotFound, match='not found: .*multi30k/val.de'):
    data.load_split('validation', data_dir=tmp_path)
