"""Importing this module registers the Multi30k seqio tasks (T5X style: `import` it in gin files).

  import speculative_t5x.tasks
  MIXTURE_OR_TASK_NAME = 'multi30k_de_en'

Imports seqio (and so TensorFlow); the data folder comes from $SPECULATIVE_T5X_DATA or
`<repo>/../shared/data` (call `speculative_t5x.data.register_tasks(path)` to use another).
"""

from speculative_t5x import data

TASK_NAMES = data.register_tasks()
