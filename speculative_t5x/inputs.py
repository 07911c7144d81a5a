"""A job's inputs: a text, TSV or JSONL file or a seqio task split, read, sharded and tokenized.

Every input keeps its position in the source (`Example.index`), so outputs can be matched to
inputs whatever was skipped; `InputReport` records what reading skipped or cut.

File formats (`input_format` 'auto' picks one by the file's extension):

  text   (.txt, any other)  one input per line.
  tsv    (.tsv)             input<TAB>target on every line (the target may be empty, the tab
                            may not: a line without one is an error naming it). A first line
                            exactly `inputs<TAB>targets` is a header and is skipped; any other
                            first line is an example.
  jsonl  (.jsonl, .json)    one {"inputs": str, "targets": str (optional), "temperature":
                            number >= 0 (optional)} object per line.

In every format an empty (or all-whitespace) line is skipped and counted; a line that is not
UTF-8 is an error naming it.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from pathlib import Path
from typing import Any, List, Optional, Tuple

from absl import logging
import gin

import speculative_t5x
from speculative_t5x import gin_utils
from speculative_t5x.errors import InferError
from speculative_t5x.errors import must_be


@dataclasses.dataclass
class Example:
  """One input: `index` is its position in the source (line number - 1 for files)."""
  index: int
  inputs: str
  targets: Optional[str] = None
  tokens: Optional[List[int]] = None
  temperature: Optional[float] = None  # this input's own sampling temperature (JSONL)


@dataclasses.dataclass
class InputReport:
  """What reading and tokenizing did besides producing examples."""
  skipped_empty: List[int] = dataclasses.field(default_factory=list)
  truncated: List[int] = dataclasses.field(default_factory=list)
  longest_input: int = 0


# The one header row a TSV file may start with (T5X's feature names).
TSV_HEADER = 'inputs\ttargets'


def _input_format(path: Path, input_format: str) -> str:
  if input_format != 'auto':
    if input_format not in ('text', 'tsv', 'jsonl'):
      raise InferError(must_be('input_format', "'auto', 'text', 'tsv' or 'jsonl'", input_format))
    return input_format
  return {'.tsv': 'tsv', '.jsonl': 'jsonl', '.json': 'jsonl'}.get(path.suffix.lower(), 'text')


def read_input_file(path: os.PathLike, input_format: str = 'auto',
                    report: Optional[InputReport] = None) -> List[Example]:
  """Examples of a text, TSV or JSONL file, in order (the formats: the module doc); empty
  inputs are skipped and recorded, a TSV header row skipped.

  Raises InferError naming the line for undecodable bytes (not UTF-8), a TSV line without one
  tab, malformed JSON or a JSON line without a string "inputs".
  """
  path = gin_utils.resolve_path(path)
  report = InputReport() if report is None else report
  try:
    raw = path.read_bytes()
  except FileNotFoundError:
    raise InferError(f'input file not found: {path}') from None
  except OSError as e:
    raise InferError(f'cannot read input file {path}: {e.strerror}') from None
  fmt = _input_format(path, input_format)
  lines = raw.split(b'\n')
  if lines and lines[-1] == b'':
    lines.pop()  # The newline that ends the last line does not start another.
  examples = []
  for i, line in enumerate(lines):
    where = f'{path}:{i + 1}'
    try:
      text = line.decode('utf-8').rstrip('\r')
    except UnicodeDecodeError as e:
      raise InferError(f'{where}: undecodable bytes (not UTF-8) at byte {e.start}: '
                       f'{line[e.start:e.start + 4]!r}') from None
    targets, temperature = None, None
    if fmt == 'tsv':
      if i == 0 and text == TSV_HEADER:
        continue
      text, targets = _tsv_fields(text, where)
    elif fmt == 'jsonl':
      if not text.strip():
        report.skipped_empty.append(i)
        logging.warning('%s: empty line skipped', where)
        continue
      try:
        obj = json.loads(text)
      except json.JSONDecodeError as e:
        raise InferError(f'{where}: invalid JSON ({e.msg} at column {e.colno})') from None
      if not isinstance(obj, dict) or not isinstance(obj.get('inputs'), str):
        raise InferError(f'{where}: a JSON object with a string "inputs" is needed')
      text, targets = obj['inputs'], obj.get('targets')
      if targets is not None and not isinstance(targets, str):
        raise InferError(f'{where}: "targets" must be a string')
      temperature = _temperature(obj.get('temperature'), where)
    if not text.strip():
      report.skipped_empty.append(i)
      logging.warning('%s: empty input skipped', where)
      continue
    examples.append(Example(i, text, targets, temperature=temperature))
  return examples


def read_pairs(path: os.PathLike) -> Tuple[List[str], List[str]]:
  """(inputs, targets) of a TSV or JSONL file of training pairs (`read_input_file`'s formats);
  InferError naming the first line without a target."""
  examples = read_input_file(path)
  untargeted = next((e for e in examples if e.targets is None), None)
  if untargeted is not None:
    raise InferError(f'{path}:{untargeted.index + 1}: a training example needs a target '
                     '(TSV: input<TAB>target; JSONL: "targets").')
  return [e.inputs for e in examples], [e.targets for e in examples]


def _tsv_fields(text: str, where: str) -> Tuple[str, Optional[str]]:
  """(input, target) of a TSV line; an empty line (skipped by the caller) has no target."""
  fields = text.split('\t')
  # Dropping the rest of a line, or reading a line without its target, would change what is
  # decoded or scored silently.
  if len(fields) > 2 or (len(fields) == 1 and text.strip()):
    found = 'no tab' if len(fields) == 1 else f'{len(fields)} tab-separated fields'
    raise InferError(f'{where}: {found}; a TSV line is input<TAB>target (inputs alone, or '
                     "inputs with tabs: a .txt file or input_format 'text')")
  return fields[0], (fields[1] if len(fields) > 1 else None)


def _temperature(value: Any, where: str) -> Optional[float]:
  """A JSONL record's "temperature": absent, or a number >= 0 (0 = greedy)."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
    raise InferError(f'{where}: ' + must_be('"temperature"', 'a number >= 0 (0 = greedy)', value))
  return float(value)


def read_task(name: str, split: str, module: Optional[str] = None) -> List[Example]:
  """The pretokenized examples of a seqio task or mixture split, in order."""
  # seqio and TensorFlow register gin configurables when first imported, which gin refuses
  # once the parsed config is locked.
  with gin.unlock_config():
    if module:
      importlib.import_module(module)
    seqio = speculative_t5x.require('seqio', 'data', 'seqio tasks')  # imports TensorFlow
  try:
    provider = seqio.get_mixture_or_task(name)
  except ValueError:
    raise InferError(f'unknown seqio task or mixture {name!r} (set MIXTURE_OR_TASK_MODULE to '
                     'the module that registers it)') from None
  ds = provider.get_dataset(sequence_length=None, split=split, shuffle=False, num_epochs=1)
  examples = []
  for i, ex in enumerate(ds.as_numpy_iterator()):
    text = ex.get('inputs_pretokenized', b'')
    target = ex.get('targets_pretokenized')
    as_str = lambda v: v.decode('utf-8') if isinstance(v, bytes) else v
    examples.append(Example(i, as_str(text), as_str(target) if target is not None else None))
  return examples


def tokenize(examples: List[Example], vocabulary: Any, max_length: int,
             report: InputReport) -> None:
  """Fills `tokens` (ids + EOS); longer inputs are cut to max_length - 1 ids + EOS, as seqio."""
  eos = vocabulary.eos_id
  for ex in examples:
    ids = vocabulary.encode(ex.inputs)
    report.longest_input = max(report.longest_input, len(ids) + 1)
    if len(ids) + 1 > max_length:
      report.truncated.append(ex.index)
      ids = ids[:max_length - 1]
    ex.tokens = ids + [eos]
  if report.truncated:
    logging.warning('%d input(s) longer than %d tokens were truncated (first: example %d).',
                    len(report.truncated), max_length, report.truncated[0])


def read_examples(input_file: Optional[str], input_format: str, task: Optional[str],
                  split: str, task_module: Optional[str], vocabulary: Any, max_length: int,
                  shard_id: int = 0, num_shards: int = 1) -> Tuple[List[Example], InputReport]:
  """This shard's non-empty examples of a file or a seqio task split, tokenized, and the report.

  Raises InferError when nothing is left to decode.
  """
  report = InputReport()
  if input_file is not None:
    examples = read_input_file(input_file, input_format, report)
  else:
    examples = read_task(task, split, task_module)
    report.skipped_empty += [ex.index for ex in examples if not ex.inputs.strip()]
    examples = [ex for ex in examples if ex.inputs.strip()]
  examples = examples[shard_id::num_shards]
  tokenize(examples, vocabulary, max_length, report)
  if not examples:
    raise InferError(f'no examples to decode in {input_file or task} '
                     f'({len(report.skipped_empty)} empty skipped)')
  return examples, report
