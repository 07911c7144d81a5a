"""Importing this module registers the Multi30k seqio tasks (T5X style: `import` it in gin files).

  import speculative_t5x.tasks
  MIXTURE_OR_TASK_NAME = 'multi30k_de_en'

Imports seqio (and so TensorFlow); the data folder comes from $SPECULATIVE_T5X_DATA or
`<repo>/../shared/data` (call `speculative_t5x.data.register_tasks(path)` to use another).

`file_task` and `mix_with_files` make seqio tasks of TSV or JSONL files of (input, target) text,
for example each training input with the target's greedy output (what `python -m t5x.infer`
writes), so `python -m t5x.train` distils on the teacher's sequences as `speculative-t5x-train`'s
kd_sequences='both' does (gin_configs/t5x/multi30k_distill_teacher.gin).
"""

from typing import Mapping

import speculative_t5x
from speculative_t5x import data
from speculative_t5x import inputs

# Without the data extra: one line naming it (MissingExtraError), not an ImportError's traceback.
seqio = speculative_t5x.require('seqio', 'data', 'seqio tasks')
TASK_NAMES = data.register_tasks()


def _file_dataset_fn(files: Mapping[str, str]):
  """A seqio FunctionDataSource dataset_fn over the (input, target) pairs of one file a split."""

  def dataset_fn(split: str, shuffle_files: bool, seed=None):
    del shuffle_files, seed  # One file a split: nothing to shuffle; seqio shuffles examples.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top  (seqio brings it)
    sources, targets = inputs.read_pairs(files[split])
    return tf.data.Dataset.from_tensor_slices({'inputs': sources, 'targets': targets})

  return dataset_fn


def file_task(name: str, files: Mapping[str, str], like: str = TASK_NAMES[0]) -> str:
  """Registers seqio task `name` over TSV or JSONL files by split ({'train': 'teacher.tsv'}),
  with the vocabulary, preprocessors and metrics of task (or a mixture's first task) `like`;
  returns `name`."""
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)  # Gin calls this once per dataset config.
  template = seqio.get_subtasks(seqio.get_mixture_or_task(like))[0]
  seqio.TaskRegistry.add(
      name, source=seqio.FunctionDataSource(_file_dataset_fn(dict(files)), splits=tuple(files)),
      preprocessors=template.preprocessors, output_features=template.output_features,
      metric_fns=template.metric_fns)
  return name


def mix_with_files(task: str, files: Mapping[str, str], name: str = '') -> str:
  """Registers the mixture of `task` and `file_task(files)` in equal shares (each training
  input once with its real target and once with the file's); returns its name."""
  name = name or f'{task}_and_files'
  if name in seqio.MixtureRegistry.names():
    seqio.MixtureRegistry.remove(name)
  seqio.MixtureRegistry.add(name, [(task, 1.0), (file_task(f'{name}_files', files, task), 1.0)])
  return name
