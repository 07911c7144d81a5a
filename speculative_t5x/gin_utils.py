"""Gin for the command-line jobs, as T5X's `gin_utils`: flags, `--gin.NAME=VALUE`, packaged files.

The gin configs, the embedded weights and the vocabulary ship with the package, so the commands
the README prints work from any directory, from a clone or from an installed wheel. The configs
live beside the package in a clone (`gin_configs/`, as in T5X) and inside it in a wheel
(`speculative_t5x/gin_configs/`, setup.py's package_dir); `GIN_CONFIGS_DIR` is whichever is there:

  --gin_file=gin_configs/runs/infer_multi30k.gin      found relative to the working directory,
                                                      then to GIN_CONFIGS_DIR's parent
  'gin_configs/...' included by a gin file            the same (a gin search path)
  'speculative_t5x/pretrained/...' in a gin file      found relative to the working directory,
                                                      then to the package's parent folder

A file in the working directory always wins, so a user's own `gin_configs/` shadows the packaged
one, as a T5X user's does with `--gin_search_paths`. T5X's own CLI names the configs
'speculative_t5x/gin_configs/t5x/...', which gin finds through the Python path (the package
`speculative_t5x.gin_configs`, installed or editable).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Callable, List, Sequence, Union

from absl import app
from absl import flags
import gin

PACKAGE_DIR = Path(__file__).resolve().parent
# Where packaged files are found for paths that name the package ('speculative_t5x/vocab/...').
_PACKAGE_PARENT = PACKAGE_DIR.parent


def _find_gin_configs() -> Path:
  """The folder of the gin configs: inside the package in an installed wheel, else beside it (a
  clone's root: an editable install, or the package on PYTHONPATH).

  A folder counts only with its `__init__.py`: a stale `speculative_t5x/gin_configs/` left with
  nothing but caches must not hide the clone's configs.
  """
  for folder in (PACKAGE_DIR / 'gin_configs', _PACKAGE_PARENT / 'gin_configs'):
    if (folder / '__init__.py').is_file():
      return folder
  return PACKAGE_DIR / 'gin_configs'  # neither: paths under it come back unresolved


GIN_CONFIGS_DIR = _find_gin_configs()
# How a path names the configs: as on the command line, or as T5X's CLI does (a package path).
_GIN_CONFIGS_PREFIXES = (('gin_configs',), ('speculative_t5x', 'gin_configs'))


def resolve_path(path: Union[str, os.PathLike]) -> Path:
  """`path` itself if it exists or is absolute or remote; else the packaged file it names.

  Tried after the working directory: for 'gin_configs/...' or 'speculative_t5x/gin_configs/...',
  GIN_CONFIGS_DIR only (another distribution's top-level `gin_configs` in site-packages must not
  answer); for other paths the package's parent folder (for 'speculative_t5x/...'), then the
  package folder. A path found nowhere comes back unchanged, so the caller's "not found" error
  names what the user wrote.
  """
  given = Path(path)
  if given.is_absolute() or given.exists() or '://' in str(path):
    return given
  candidates = [_PACKAGE_PARENT / given, PACKAGE_DIR / given]
  for prefix in _GIN_CONFIGS_PREFIXES:
    if given.parts[:len(prefix)] == prefix:
      candidates = [GIN_CONFIGS_DIR.joinpath(*given.parts[len(prefix):])]
      break
  return next((candidate for candidate in candidates if candidate.exists()), given)


def define_gin_flags() -> None:
  """`--gin_file`, `--gin_bindings`, `--gin_search_paths`, once per process (several jobs and
  T5X's own scripts may share one absl flag registry)."""
  if 'gin_file' not in flags.FLAGS:
    flags.DEFINE_multi_string('gin_file', [], 'Gin files to parse, in order (relative paths: '
                              'the working directory, then the packaged gin_configs/).')
  if 'gin_bindings' not in flags.FLAGS:
    flags.DEFINE_multi_string('gin_bindings', [], 'Gin bindings, e.g. infer_script.infer.x = 1.')
  if 'gin_search_paths' not in flags.FLAGS:
    flags.DEFINE_multi_string('gin_search_paths', ['.'], 'Folders searched for gin files and '
                              'includes, before the package.')


def rewrite_gin_args(argv: Sequence[str]) -> List[str]:
  """Turns T5X's `--gin.NAME=VALUE` into `--gin_bindings=NAME = VALUE`.

  Raises:
    ValueError: for `--gin.NAME` without a value.
  """
  out = []
  for arg in argv:
    if arg.startswith('--gin.'):
      name, sep, value = arg[len('--gin.'):].partition('=')
      if not sep or not name:
        raise ValueError(f'{arg}: expected --gin.NAME=VALUE')
      out.append(f'--gin_bindings={name} = {value}')
    else:
      out.append(arg)
  return out


def parse_gin_flags(gin_files: Sequence[str], gin_bindings: Sequence[str],
                    gin_search_paths: Sequence[str] = ('.',)) -> None:
  """Parses the files then the bindings; includes resolve as the files do (see module doc)."""
  # After the user's folders: the one holding gin_configs/ (the package in a wheel, the clone's
  # root otherwise), then the package's parent for 'speculative_t5x/...'.
  packaged = [str(GIN_CONFIGS_DIR.parent), str(_PACKAGE_PARENT)]
  for path in dict.fromkeys(list(gin_search_paths) + packaged):
    gin.add_config_file_search_path(path)
  # gin logs an ERROR line for every search path a file is not under, even when a later one has
  # it; a missing file still raises (and is reported as one line by the jobs).
  logging.disable(logging.ERROR)
  try:
    gin.parse_config_files_and_bindings(list(gin_files), list(gin_bindings))
  finally:
    logging.disable(logging.NOTSET)


def error_line(e: BaseException) -> str:
  """One line for an error: gin appends file/line context on further lines; keep the message
  and the location."""
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  if not lines:
    return type(e).__name__
  # gin's context names the file and line of a binding (kept) or the configurable being
  # called, with its memory address (dropped: it says nothing to a user).
  where = next((line for line in lines[1:] if (line.startswith('In ') or 'line' in line)
                and ' at 0x' not in line), '')
  return f'{lines[0]} ({where})' if where and where != lines[0] else lines[0]


def exit_with_error(message: str) -> None:
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(1)


def run(main: Callable[[Sequence[str]], None], argv: Sequence[str] = None) -> None:
  """`absl.app.run(main)` with the gin flags defined and `--gin.NAME=VALUE` rewritten."""
  define_gin_flags()
  try:
    argv = rewrite_gin_args(sys.argv if argv is None else argv)
  except ValueError as e:
    exit_with_error(str(e))
  app.run(main, argv=argv)
