"""A job's outputs on disk, in T5X's layout, written so that a killed job loses nothing.

  <name>-predict_with_aux.jsonl-<shard>-of-<n>             the merged predictions, example order
  <that>.summary.json, <that>.COMPLETED                     written last, in that order
  tmp-<name>-<shard>-of-<n>/run_key                         what the chunks below were made from
  tmp-<name>-<shard>-of-<n>/chunk<c>-process<p>.jsonl       one committed chunk of one process

A chunk's records are written to a temporary file and renamed into place: the rename is the
commit. A rerun of the same job (same `run_key`) skips committed chunks; a job with another key
refuses the folder rather than mixing its chunks with these. Once the COMPLETED mark is written
the tmp- folder is removed: a finished job leaves only its documented files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from absl import logging

from speculative_t5x.errors import InferError

MODE = 'predict_with_aux'


def atomic_write(path: Path, text: str) -> None:
  """Writes `text` to `path` so that readers see either nothing or all of it."""
  tmp = path.with_name(f'{path.name}.tmp-{os.getpid()}')
  with open(tmp, 'w', encoding='utf-8') as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def check_writable(directory: Path) -> None:
  """Creates `directory` and proves a file can be written there (InferError if not)."""
  try:
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f'.write-test-{os.getpid()}'
    probe.write_text('')
    probe.unlink()
  except OSError as e:
    raise InferError(f'output directory {directory} is not writable: '
                     f'{e.strerror or e}') from None


def run_key(config: str, indices: Sequence[int], tokens: Sequence[Sequence[int]],
            num_processes: int, num_decodes: int) -> str:
  """What fixes a job's chunks: its config, its examples and these numbers."""
  return hashlib.sha256(json.dumps({
      'gin': config, 'indices': list(indices),
      'tokens': hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest(),
      'processes': num_processes, 'num_decodes': num_decodes},
                                   sort_keys=True).encode()).hexdigest()[:16]


def _jsonl(records: Sequence[Dict[str, Any]]) -> str:
  return ''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in records)


class ChunkStore:
  """The output files of one shard of one job, for `num_processes` processes."""

  def __init__(self, output_dir: Path, name: str, shard_id: int, num_shards: int,
               num_processes: int = 1):
    shard = f'{shard_id:05}-of-{num_shards:05}'
    self.output_path = output_dir / f'{name}-{MODE}.jsonl-{shard}'
    self.summary_path = output_dir / f'{self.output_path.name}.summary.json'
    self.completed_path = output_dir / f'{self.output_path.name}.COMPLETED'
    self.tmp_dir = output_dir / f'tmp-{name}-{shard}'
    self.num_processes = num_processes

  def completed_summary(self) -> Optional[Dict[str, Any]]:
    """The summary of a finished run of this job, or None."""
    if self.completed_path.exists() and self.summary_path.exists():
      logging.info('%s is complete; nothing to do.', self.output_path)
      return json.loads(self.summary_path.read_text())
    return None

  def claim(self, key: str, write: bool = True) -> None:
    """Takes the chunk folder for the run `key` (InferError if it holds another run's chunks)."""
    self.tmp_dir.mkdir(exist_ok=True)
    key_file = self.tmp_dir / 'run_key'
    if key_file.exists() and key_file.read_text().strip() != key:
      raise InferError(f'{self.tmp_dir} holds a partial run with a different config or input; '
                       'remove it or use another INFER_OUTPUT_DIR')
    if write and not key_file.exists():
      atomic_write(key_file, key)

  def _chunk(self, c: int, p: int) -> Path:
    return self.tmp_dir / f'chunk{c:05}-process{p:05}.jsonl'

  def _meta(self, c: int, p: int) -> Path:
    return self.tmp_dir / f'chunk{c:05}-process{p:05}.meta.json'

  def committed(self, c: int) -> bool:
    """Whether every process has committed chunk c."""
    return all(self._chunk(c, p).exists() for p in range(self.num_processes))

  def commit(self, c: int, process: int, records: Sequence[Dict[str, Any]],
             decode_seconds: float) -> None:
    """Writes this process's records of chunk c; the chunk file's rename is the commit point."""
    atomic_write(self._meta(c, process), json.dumps({'decode_seconds': decode_seconds,
                                                     'examples': len(records)}))
    atomic_write(self._chunk(c, process), _jsonl(records))

  def merge(self, num_chunks: int, indices: Sequence[int]) -> Tuple[List[Dict[str, Any]], float]:
    """Every chunk's records in example order, and the decode seconds they took (summed over
    chunks, averaged over processes, which decode in parallel). InferError unless the records
    are exactly the examples `indices`."""
    merged, decode_seconds = [], 0.0
    for c in range(num_chunks):
      for p in range(self.num_processes):
        lines = self._chunk(c, p).read_text(encoding='utf-8').splitlines()
        merged += [json.loads(line) for line in lines]
        meta = json.loads(self._meta(c, p).read_text())
        decode_seconds += meta['decode_seconds'] / self.num_processes
    merged.sort(key=lambda r: r['index'])
    if [r['index'] for r in merged] != list(indices):
      raise InferError(f'chunk files in {self.tmp_dir} do not cover the input exactly; remove it')
    return merged, decode_seconds

  def finish(self, records: Sequence[Dict[str, Any]], summary: Dict[str, Any],
             operative_config: str) -> None:
    """The merged predictions, the summary, the operative config, then the COMPLETED mark."""
    atomic_write(self.output_path, _jsonl(records))
    atomic_write(self.summary_path, json.dumps(summary, indent=2))
    atomic_write(self.output_path.parent / 'operative_config.gin', operative_config)
    atomic_write(self.completed_path, '')
    # After the mark: a job killed before it still has its chunks to resume from. The other
    # processes are past their last read of the folder (infer syncs them before the merge).
    shutil.rmtree(self.tmp_dir, ignore_errors=True)
