"""Multi30k data: the project's SentencePiece vocabulary, seqio tasks and a TensorFlow-free path.

Two ways to the same examples:

  * seqio (T5X's way): `register_tasks()` registers `multi30k_de_en` and `multi30k_en_de` with
    splits train / validation / test (test = test_2016_flickr), features `inputs` / `targets`
    tokenized with `get_vocabulary()` and EOS appended, and sacrebleu BLEU as the metric, so
    `MIXTURE_OR_TASK_NAME = 'multi30k_de_en'` works in T5X gin files (import
    `speculative_t5x.tasks` there). seqio pulls in TensorFlow, so it is imported only inside the
    functions that need it.
  * plain Python (`load_split`, `tokenize_pairs`, `PackedBatches`, `pad_batch`): numpy only, used
    by `speculative_t5x.train` so that CPU training does not depend on tf.data.

Both tokenize identically: SentencePiece ids of the raw line, truncated to leave room for EOS (1),
then EOS; padding is 0 (T5 conventions, no BOS).

The Multi30k data is for non-commercial research and education (Elliott et al. 2016, Multi30K);
models trained on it inherit that restriction.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
from pathlib import Path
import sys
import urllib.error
import urllib.request
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import gin
import numpy as np

import speculative_t5x
from speculative_t5x import errors
from speculative_t5x import gin_utils

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2

# The embedded pair's files, shipped in the package.
VOCAB_PATH = Path(__file__).resolve().parent / 'vocab' / 'multi30k_8k.model'
EMBEDDED_TARGET = Path(__file__).resolve().parent / 'pretrained' / 'multi30k_de_en_target.msgpack'
# The draft the embedded pair decodes with: two decoder layers whose cross-attention reads the
# target's encoder output (no encoder of its own), so a decode runs one encoder; it agrees with
# the target more than the separate draft at every temperature.
EMBEDDED_DRAFT = (Path(__file__).resolve().parent / 'pretrained' /
                  'multi30k_de_en_draft_decoder_only.msgpack')
# The first draft, with an encoder of its own (3 encoder layers, 1 decoder layer), as in the
# papers; the decoder-only draft was trained from it (scripts/train_pair.sh).
EMBEDDED_SEPARATE_DRAFT = (Path(__file__).resolve().parent / 'pretrained' /
                           'multi30k_de_en_draft.msgpack')
DATA_ENV_VAR = 'SPECULATIVE_T5X_DATA'

# Split name -> file stem in multi30k/. seqio/TFDS call the dev split 'validation'.
SPLIT_FILES = {
    'train': 'train',
    'validation': 'val',
    'val': 'val',
    'test': 'test_2016_flickr',
    'test_2016_flickr': 'test_2016_flickr',
}
LANGUAGE_PAIRS = {'multi30k_de_en': ('de', 'en'), 'multi30k_en_de': ('en', 'de')}


# Where a machine without the data folder gets Multi30k (task 1, raw): the dataset's own
# repository, at a commit whose files are those of the shared data folder; the checksums are of
# the decompressed files, so a changed or truncated download is refused, never used.
MULTI30K_URL = ('https://raw.githubusercontent.com/multi30k/dataset/'
                'c9be912dc05a3ebf9ae5bb5f7f58c1791cda43ab/data/task1/raw/{name}.gz')
URL_ENV_VAR = 'SPECULATIVE_T5X_MULTI30K_URL'  # a mirror, with {name} in it
MULTI30K_SHA256 = {
    'test_2016_flickr.de': '4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16',
    'test_2016_flickr.en': '399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182',
    'train.de': '2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72',
    'train.en': '460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6',
    'val.de': '660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660',
    'val.en': '1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227',
}


class DataNotFound(FileNotFoundError):
  """A Multi30k file that is neither in the data folder nor in the cache, and could not be
  fetched; its message is one line that says where it looked and what to do."""


def default_data_dir() -> Path:
  """The data folder: $SPECULATIVE_T5X_DATA, else `<repo>/../shared/data` where it exists, else
  the cache (`cache_dir()`), where Multi30k's files are fetched on first use."""
  env = os.environ.get(DATA_ENV_VAR)
  if env:
    return Path(env)
  shared = Path(__file__).resolve().parents[2] / 'shared' / 'data'
  return shared if (shared / 'multi30k').is_dir() else cache_dir()


def cache_dir() -> Path:
  """`$XDG_CACHE_HOME/speculative_t5x` (default `~/.cache/speculative_t5x`)."""
  base = os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache'
  return Path(base) / 'speculative_t5x'


def multi30k_dir(data_dir: Optional[os.PathLike] = None) -> Path:
  """The `multi30k/` folder under `data_dir` (default `default_data_dir()`)."""
  return Path(data_dir if data_dir is not None else default_data_dir()) / 'multi30k'


def multi30k_file(name: str, data_dir: Optional[os.PathLike] = None) -> Path:
  """The path of Multi30k's file `name` (e.g. 'test_2016_flickr.de'), fetched into the cache
  first if the data folder is the cache and lacks it. Raises DataNotFound (one line)."""
  path = multi30k_dir(data_dir) / name
  if path.exists():
    return path
  if data_dir is not None or default_data_dir() != cache_dir() or name not in MULTI30K_SHA256:
    raise DataNotFound(f'Multi30k file not found: {path} (set {DATA_ENV_VAR} to a folder '
                       f'holding multi30k/{name}, or pass --data_dir)')
  fetch_multi30k(name, path)
  return path


def fetch_multi30k(name: str, path: Path) -> None:
  """Downloads Multi30k's `name` into `path` (a progress line on stderr), checks its sha256 and
  writes it atomically, so an interrupted fetch leaves nothing half-written behind."""
  url = os.environ.get(URL_ENV_VAR, MULTI30K_URL).format(name=name)
  print(f'fetching Multi30k {name} (once) from {url} into {path.parent}', file=sys.stderr)
  try:
    with urllib.request.urlopen(url, timeout=60) as response:
      text = gzip.decompress(response.read())
  except (urllib.error.URLError, OSError, EOFError, ValueError) as e:
    raise DataNotFound(f'cannot fetch Multi30k {name} from {url} ({e}); offline? Put the data '
                       f'folder (multi30k/{name}) at {path.parent.parent} or set '
                       f'{DATA_ENV_VAR}') from None
  digest = hashlib.sha256(text).hexdigest()
  if digest != MULTI30K_SHA256[name]:
    raise DataNotFound(f'Multi30k {name} from {url} has sha256 {digest[:12]}..., not '
                       f'{MULTI30K_SHA256[name][:12]}...: refused')
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.with_name(path.name + f'.partial{os.getpid()}')
  partial.write_bytes(text)
  os.replace(partial, path)
  print(f'fetched Multi30k {name}: {len(text) / 1e3:.0f} kB, sha256 checked', file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# Vocabulary.


def train_vocabulary(data_dir: Optional[os.PathLike] = None, model_prefix: str = '/tmp/multi30k_8k',
                     vocab_size: int = 8000) -> str:
  """Trains the unigram SentencePiece model on train.de + train.en; returns the .model path.

  This is how `vocab/multi30k_8k.model` was made (pad 0, EOS 1, UNK 2, no BOS, as T5). Full
  character coverage so German umlauts and ß never become UNK.
  """
  import sentencepiece as spm
  spm.SentencePieceTrainer.train(
      input=f'{multi30k_file("train.de", data_dir)},{multi30k_file("train.en", data_dir)}', model_prefix=model_prefix,
      model_type='unigram', vocab_size=vocab_size, pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID,
      bos_id=-1, character_coverage=1.0, input_sentence_size=0, shuffle_input_sentence=False,
      num_threads=2, minloglevel=2)
  return model_prefix + '.model'


@functools.lru_cache(maxsize=None)
def get_sentencepiece(path: str = str(VOCAB_PATH)):
  """The project vocabulary as a `sentencepiece.SentencePieceProcessor` (no TensorFlow)."""
  import sentencepiece as spm
  return spm.SentencePieceProcessor(model_file=str(path))


def get_vocabulary(path: str = str(VOCAB_PATH)):
  """The project vocabulary as a `seqio.SentencePieceVocabulary` (no extra ids: 8000 pieces)."""
  seqio = speculative_t5x.require('seqio', 'data', 'seqio vocabularies')  # imports TensorFlow
  return seqio.SentencePieceVocabulary(str(path), extra_ids=0)


def vocab_size(path: str = str(VOCAB_PATH)) -> int:
  return get_sentencepiece(path).get_piece_size()


def padded_vocab_size(path: str = str(VOCAB_PATH), multiple: int = 128) -> int:
  """The model's vocab_size: the vocabulary rounded up to a multiple of 128, as T5 does."""
  return -(-vocab_size(path) // multiple) * multiple


def encode(texts: Sequence[str], max_length: Optional[int] = None,
           path: str = str(VOCAB_PATH)) -> List[List[int]]:
  """Token ids with EOS appended, truncated (before EOS) to fit `max_length` as seqio does."""
  sp = get_sentencepiece(path)
  out = []
  for ids in sp.encode(list(texts)):
    if max_length is not None:
      ids = ids[:max_length - 1]
    out.append(ids + [EOS_ID])
  return out


def decode(ids: Sequence[Sequence[int]], path: str = str(VOCAB_PATH)) -> List[str]:
  """Text of each row of ids (`SentencePieceVocabulary.decode`)."""
  vocabulary = _vocabulary(path)
  return [vocabulary.decode(row) for row in ids]


@gin.configurable(module='vocabularies')
class SentencePieceVocabulary:
  """A SentencePiece vocabulary without TensorFlow (the seqio class's name and arguments).

  Ids: pieces as in the model file (T5: pad 0, EOS 1, UNK 2), then `extra_ids` sentinels.
  A relative path is tried against the working directory, then the package (`gin_utils.resolve_path`).
  """

  def __init__(self, sentencepiece_model_file: str, extra_ids: int = 0):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    path = gin_utils.resolve_path(sentencepiece_model_file)
    if str(sentencepiece_model_file).startswith('gs://') or not path.is_file():
      raise errors.InferError(f'vocabulary file not found: {sentencepiece_model_file} (a local '
                              'path is needed; copy gs:// files first)')
    self.path = path
    self.model_bytes = path.read_bytes()
    self._sp = spm.SentencePieceProcessor(model_proto=self.model_bytes)
    self.extra_ids = extra_ids

  @property
  def eos_id(self) -> int:
    return int(self._sp.eos_id())

  @property
  def unk_id(self) -> int:
    return int(self._sp.unk_id())

  @property
  def vocab_size(self) -> int:
    return int(self._sp.get_piece_size()) + self.extra_ids

  @property
  def digest(self) -> str:
    """Identity of the vocabulary: same pieces and extra ids <=> same digest."""
    return hashlib.sha256(self.model_bytes + str(self.extra_ids).encode()).hexdigest()[:16]

  def encode(self, text: str) -> List[int]:
    return list(self._sp.encode(text))

  def decode(self, ids: Sequence[int]) -> str:
    """Text of ids up to the first EOS; padding (0) and sentinel ids are dropped."""
    ids = [int(i) for i in ids]
    if self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id)]
    size = self._sp.get_piece_size()
    return self._sp.decode([i for i in ids if PAD_ID < i < size])


@functools.lru_cache(maxsize=None)
def _vocabulary(path: str) -> SentencePieceVocabulary:
  return SentencePieceVocabulary(path)


# ------------------------------------------------------------------------------------------------
# Plain-Python examples.


def load_split(split: str, source: str = 'de', target: str = 'en',
               data_dir: Optional[os.PathLike] = None) -> Tuple[List[str], List[str]]:
  """(source lines, target lines) of a Multi30k split ('train', 'validation', 'test')."""
  stem = SPLIT_FILES[split]
  src = multi30k_file(f'{stem}.{source}', data_dir).read_text(encoding='utf-8').splitlines()
  tgt = multi30k_file(f'{stem}.{target}', data_dir).read_text(encoding='utf-8').splitlines()
  if len(src) != len(tgt):
    raise ValueError(f'{stem}.{source} has {len(src)} lines but {stem}.{target} has {len(tgt)}.')
  return src, tgt


CAPTION_VOCABULARY_SOURCE = ('the SentencePiece ids of Multi30k train.en (the English side the '
                             'draft was distilled on) plus pad, eos and unk')


def caption_vocabulary(split: str = 'train', data_dir: Optional[os.PathLike] = None
                       ) -> List[int]:
  """The sorted token ids of a Multi30k split's English side, with pad, EOS and unk: the tokens
  the embedded drafts may propose (their `.vocabulary.json`, `docs/engine.md`)."""
  _, english = load_split(split, data_dir=data_dir)
  return sorted({i for row in encode(english) for i in row} | {PAD_ID, EOS_ID, UNK_ID})


def tokenize_pairs(sources: Sequence[str], targets: Sequence[str], max_input_length: int,
                   max_target_length: int) -> Tuple[List[List[int]], List[List[int]]]:
  """Both sides tokenized with EOS, as the seqio tasks do."""
  return encode(sources, max_input_length), encode(targets, max_target_length)


def input_width(inputs: Sequence[Sequence[int]], max_input_length: int,
                length_step: int = 0) -> int:
  """Encoder width of a batch of `inputs`: max_input_length, or with length_step > 0 the longest
  input rounded up to a multiple of length_step, at most max_input_length."""
  if length_step <= 0:
    return max_input_length
  longest = max((len(ids) for ids in inputs), default=1)
  return min(max_input_length, max(1, -(-longest // length_step)) * length_step)


def pad_batch(inputs: Sequence[Sequence[int]], targets: Optional[Sequence[Sequence[int]]],
              max_input_length: int, max_target_length: int,
              batch_size: Optional[int] = None, length_step: int = 0) -> Dict[str, np.ndarray]:
  """One unpacked batch in T5X's feature names, padded to fixed shapes.

  Returns encoder_input_tokens [batch, input_length] and decoder_input_tokens
  [batch, max_target_length]: with targets, also decoder_target_tokens / decoder_loss_weights;
  without, the all-zero decoder input of a predict batch (its width is the decode length). Rows beyond
  len(inputs) (up to `batch_size`) are all padding, with zero loss weight, so a short last batch
  keeps the compiled shape.

  input_length is `input_width(inputs, max_input_length, length_step)`: with length_step > 0
  the longest input rounded up to a multiple of it, so that the encoder and the cross-attention
  skip most of the padding short inputs leave (captions: ~15 tokens of 64), at one compilation
  per width in use.
  """
  n = len(inputs) if batch_size is None else batch_size
  width = input_width(inputs, max_input_length, length_step)
  enc = np.zeros((n, width), np.int32)
  for i, ids in enumerate(inputs):
    enc[i, :len(ids)] = ids[:width]
  batch = {'encoder_input_tokens': enc}
  if targets is not None:
    tgt = np.zeros((n, max_target_length), np.int32)
    for i, ids in enumerate(targets):
      tgt[i, :len(ids)] = ids[:max_target_length]
    dec_in = np.zeros_like(tgt)
    dec_in[:, 1:] = tgt[:, :-1]  # Shifted right; position 0 holds the BOS id 0.
    batch.update(decoder_input_tokens=dec_in, decoder_target_tokens=tgt,
                 decoder_loss_weights=(tgt > 0).astype(np.float32))
  else:
    batch['decoder_input_tokens'] = np.zeros((n, max_target_length), np.int32)
  return batch


def pack_examples(inputs: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                  order: np.ndarray, max_input_length: int, max_target_length: int,
                  open_rows: int = 16) -> List[List[int]]:
  """Groups examples (in `order`) into rows whose inputs and targets both fit their lengths.

  Multi30k sentences are ~15 tokens, so packing ~4 per 64-token row is what makes CPU training
  affordable (T5X packs too). Greedy first-fit over the last `open_rows` rows: deterministic
  given `order`. Returns lists of example indices, one per row.
  """
  rows: List[List[int]] = []
  used: List[Tuple[int, int]] = []
  first_open = 0
  for idx in order:
    li, lt = len(inputs[idx]), len(targets[idx])
    for r in range(first_open, len(rows)):
      if used[r][0] + li <= max_input_length and used[r][1] + lt <= max_target_length:
        rows[r].append(int(idx))
        used[r] = (used[r][0] + li, used[r][1] + lt)
        break
    else:
      rows.append([int(idx)])
      used.append((li, lt))
      first_open = max(0, len(rows) - open_rows)
  return rows


def packed_batch(inputs: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                 rows: Sequence[Sequence[int]], max_input_length: int,
                 max_target_length: int) -> Dict[str, np.ndarray]:
  """Packed T5X features for `rows` (lists of example indices); every array [rows, length].

  Segment ids (1, 2, ... per example, 0 = padding) keep examples from attending to each other;
  decoder inputs are shifted right within each segment, so each example starts from BOS 0.
  """
  n = len(rows)
  enc = np.zeros((n, max_input_length), np.int32)
  enc_seg = np.zeros_like(enc)
  tgt = np.zeros((n, max_target_length), np.int32)
  dec_in = np.zeros_like(tgt)
  dec_seg = np.zeros_like(tgt)
  for r, row in enumerate(rows):
    pi = pt = 0
    for s, idx in enumerate(row, start=1):
      a, b = inputs[idx], targets[idx]
      enc[r, pi:pi + len(a)] = a
      enc_seg[r, pi:pi + len(a)] = s
      tgt[r, pt:pt + len(b)] = b
      dec_in[r, pt + 1:pt + len(b)] = b[:-1]
      dec_seg[r, pt:pt + len(b)] = s
      pi += len(a)
      pt += len(b)
  return {'encoder_input_tokens': enc, 'encoder_segment_ids': enc_seg,
          'decoder_input_tokens': dec_in, 'decoder_target_tokens': tgt,
          'decoder_segment_ids': dec_seg, 'decoder_loss_weights': (tgt > 0).astype(np.float32)}


class PackedBatches:
  """Deterministic, resumable packed training batches: the position is (epoch, batch_in_epoch).

  Each epoch shuffles the examples with `seed + epoch`, packs them, and yields `batch_size` rows
  at a time; the last incomplete batch of an epoch is dropped so every batch has the same shape
  (no recompilation). Restoring `state` reproduces the same batches an uninterrupted run sees.
  """

  def __init__(self, inputs: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
               batch_size: int, max_input_length: int, max_target_length: int, seed: int = 0,
               pack: bool = True):
    self.inputs, self.targets = inputs, targets
    self.batch_size = batch_size
    self.max_input_length, self.max_target_length = max_input_length, max_target_length
    self.seed, self.pack = seed, pack
    self.epoch, self.batch_in_epoch = 0, 0
    self._rows: Optional[List[List[int]]] = None
    self._rows_epoch = -1

  @property
  def state(self) -> Dict[str, int]:
    return {'epoch': self.epoch, 'batch_in_epoch': self.batch_in_epoch}

  def set_state(self, state: Dict[str, int]) -> None:
    self.epoch, self.batch_in_epoch = int(state['epoch']), int(state['batch_in_epoch'])

  def _epoch_rows(self) -> List[List[int]]:
    if self._rows_epoch != self.epoch:
      order = np.random.default_rng(self.seed + self.epoch).permutation(len(self.inputs))
      if self.pack:
        self._rows = pack_examples(self.inputs, self.targets, order, self.max_input_length,
                                   self.max_target_length)
      else:
        self._rows = [[int(i)] for i in order]
      self._rows_epoch = self.epoch
    return self._rows

  def batches_per_epoch(self) -> int:
    return len(self._epoch_rows()) // self.batch_size

  def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
    return self

  def __next__(self) -> Dict[str, np.ndarray]:
    rows = self._epoch_rows()
    if len(rows) < self.batch_size:
      raise ValueError(f'The training data packs into {len(rows)} rows, fewer than one batch of '
                       f'{self.batch_size}: lower batch_size or give more examples.')
    if (self.batch_in_epoch + 1) * self.batch_size > len(rows):
      self.epoch, self.batch_in_epoch = self.epoch + 1, 0
      rows = self._epoch_rows()
    start = self.batch_in_epoch * self.batch_size
    chosen = rows[start:start + self.batch_size]
    self.batch_in_epoch += 1
    return packed_batch(self.inputs, self.targets, chosen, self.max_input_length,
                        self.max_target_length)


def corpus_bleu(predictions: Sequence[str], references: Sequence[str]) -> float:
  """sacrebleu corpus BLEU (13a tokenization, as sacrebleu's default) of detokenized text."""
  # The bench extra: sacrebleu without the data extra's TensorFlow (the test extra has it too).
  sacrebleu = speculative_t5x.require('sacrebleu', 'bench', 'BLEU scores')
  return float(sacrebleu.corpus_bleu(list(predictions), [list(references)]).score)


# ------------------------------------------------------------------------------------------------
# seqio tasks.


def bleu_metric(targets: Sequence[str], predictions: Sequence[str]) -> Dict[str, float]:
  """seqio metric_fn: {'bleu': sacrebleu corpus BLEU}."""
  return {'bleu': corpus_bleu(predictions, targets)}


def _pair_dataset_fn(source: str, target: str, data_dir: Optional[os.PathLike]):
  """A seqio FunctionDataSource dataset_fn zipping the two line-aligned files of a split."""

  def dataset_fn(split: str, shuffle_files: bool, seed: Optional[int] = None):
    del shuffle_files, seed  # One file per language and split: nothing to shuffle.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    stem = SPLIT_FILES[split]
    src = tf.data.TextLineDataset(str(multi30k_file(f'{stem}.{source}', data_dir)))
    tgt = tf.data.TextLineDataset(str(multi30k_file(f'{stem}.{target}', data_dir)))
    return tf.data.Dataset.zip((src, tgt)).map(lambda s, t: {'inputs': s, 'targets': t})

  return dataset_fn


def register_tasks(data_dir: Optional[os.PathLike] = None, overwrite: bool = True) -> List[str]:
  """Registers `multi30k_de_en` and `multi30k_en_de` in seqio's TaskRegistry; returns the names."""
  seqio = speculative_t5x.require('seqio', 'data', 'seqio tasks')
  vocabulary = get_vocabulary()
  features = {
      'inputs': seqio.Feature(vocabulary=vocabulary, add_eos=True),
      'targets': seqio.Feature(vocabulary=vocabulary, add_eos=True),
  }
  names = []
  for name, (source, target) in LANGUAGE_PAIRS.items():
    if overwrite and name in seqio.TaskRegistry.names():
      seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add(
        name,
        source=seqio.FunctionDataSource(
            _pair_dataset_fn(source, target, data_dir),
            splits=('train', 'validation', 'test')),
        preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
        output_features=features,
        metric_fns=[bleu_metric])
    names.append(name)
  return names
