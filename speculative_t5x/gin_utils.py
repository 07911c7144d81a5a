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
import re
import sys
import textwrap
import tokenize
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

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
    flags.DEFINE_multi_string('gin_bindings', [], "Gin bindings, after the files, e.g. "
                              "'infer_script.infer.batch_size = 8'; --gin.NAME=VALUE is the same "
                              '(T5X\'s form). String values need quotes: --gin.NAME="\'text\'".')
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
  """Parses the files then the bindings; includes resolve as the files do (see module doc).

  Raises:
    ValueError: one line naming the file or binding that does not parse (with the fix for a
      string binding without quotes), or the macro still bound to %gin.REQUIRED.
  """
  # After the user's folders: the one holding gin_configs/ (the package in a wheel, the clone's
  # root otherwise), then the package's parent for 'speculative_t5x/...'.
  packaged = [str(GIN_CONFIGS_DIR.parent), str(_PACKAGE_PARENT)]
  for path in dict.fromkeys(list(gin_search_paths) + packaged):
    gin.add_config_file_search_path(path)
  # gin logs an ERROR line for every search path a file is not under, even when a later one has
  # it; a missing file still raises (and is reported as one line by the jobs).
  logging.disable(logging.ERROR)
  try:
    # One file and one binding at a time (gin.parse_config_files_and_bindings's order), so that
    # a syntax error names the one it is in: gin's own error says only "line 1".
    for path in gin_files:
      _parse_one(gin.parse_config_file, path, f'file {path}')
    for binding in gin_bindings:
      _parse_one(gin.parse_config, binding, f'binding {binding!r}', _quote_hint(binding),
                 also=(ValueError,))
    try:
      gin.finalize()
    except ValueError as e:
      raise ValueError(_required_macro_line(e)) from None
  finally:
    logging.disable(logging.NOTSET)


def _parse_one(parse: Callable[[str], object], text: str, what: str, hint: str = '',
               also: Tuple[Type[Exception], ...] = ()) -> None:
  """parse(text); a syntax error, or one of the `also` errors, as one ValueError line naming
  `what` (or the file and line an included file's error is at)."""
  try:
    parse(text)
  except (SyntaxError, tokenize.TokenError, *also) as e:
    if isinstance(e, SyntaxError) and e.filename:
      what = f'file {e.filename}, line {e.lineno} ({(e.text or "").strip()})'
    message = e.msg if isinstance(e, SyntaxError) else str(e.args[0] if e.args else e)
    # gin's messages may go on with context lines and Python object addresses: keep the
    # first line that says something to a user.
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    first = next((line for line in lines if ' at 0x' not in line), type(e).__name__)
    raise ValueError(f'{what}: {first.rstrip(".")}{hint}') from None


def _quote_hint(binding: str) -> str:
  """The fix for a binding whose value may be a string without quotes ('' for other values):
  gin reads `--gin.DIR=/tmp/x` as the unparseable expression /tmp/x."""
  name, _, value = binding.partition('=')
  name, value = name.strip(), value.strip()
  if not value or value[0] in '\'"([{%@-' or value[0].isdigit():
    return ''
  return f'; a string value needs quotes: --gin.{name}="\'{value}\'"'


_REQUIRED_MACRO = re.compile(r'^(\w+)/macro\.value set to `%gin\.REQUIRED`')


def _required_macro_line(e: ValueError) -> str:
  """gin's error for a macro left at %gin.REQUIRED, as what to set; other errors as they are."""
  match = _REQUIRED_MACRO.match(str(e))
  if not match:
    return error_line(e)
  name = match.group(1)
  return (f'{name} is required and not set: add --gin.{name}=VALUE (a string value in quotes: '
          f'--gin.{name}="\'...\'")')


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


# The flags that print a job's help (absl's own --help lists only flags that the __main__
# module defines: none of a console script's).
HELP_ARGS = ('-h', '--help', '--helpshort', '-?')
_HELP_WIDTH = 100
_HELP_INDENT = 26


def help_entry(name: str, text: str) -> str:
  """One entry of a help listing: `name`, then `text` wrapped beside it (below a long name)."""
  indent = ' ' * _HELP_INDENT
  head = f'  {name}'
  if len(head) > _HELP_INDENT - 2:
    return head + '\n' + textwrap.fill(text, _HELP_WIDTH, initial_indent=indent,
                                       subsequent_indent=indent)
  return textwrap.fill(text, _HELP_WIDTH, initial_indent=head.ljust(_HELP_INDENT),
                       subsequent_indent=indent)


def flags_help(names: Sequence[str]) -> str:
  """The absl flags `names` as a help listing: each one's help text, default, repeatability."""
  entries = []
  for name in names:
    flag = flags.FLAGS[name]
    notes = ['repeatable'] if isinstance(flag, flags.MultiFlag) else []
    if flag.default not in (None, [], ''):
      notes.append(f'default: {flag.default!r}')
    note = f' ({"; ".join(notes)})' if notes else ''
    # absl appends its own "repeat this option ..." sentence to a multi flag's help.
    text = re.sub(r';\s*repeat this option.*', '', flag.help, flags=re.DOTALL)
    entries.append(help_entry(f'--{name}', f'{text}{note}'))
  return '\n'.join(entries)


def gin_files_help(folders: Sequence[str]) -> str:
  """The packaged gin files of `folders` (under gin_configs/) as a help listing, each with the
  first sentence of its opening comment: the listing follows the files as they change."""
  entries = []
  for folder in folders:
    for path in sorted((GIN_CONFIGS_DIR / folder).glob('*.gin')):
      comment = []
      for line in path.read_text(encoding='utf-8').splitlines():
        if not line.startswith('#'):
          break
        comment.append(line.lstrip('#').strip())
      # A sentence ends at a period before a capital ("et al. 2023" goes on).
      first = re.split(r'(?<=\.)\s+(?=[A-Z])', ' '.join(comment), maxsplit=1)[0]
      entries.append(help_entry(f'gin_configs/{folder}/{path.name}',
                                textwrap.shorten(first, 130, placeholder=' ...')))
  return '\n'.join(entries)


# The flags of a job that may run as several processes (multi-host, jax.distributed).
PROCESS_FLAGS = {
    'coordinator_address': 'host:port of process 0 for jax.distributed (multi-host), or '
                           "'auto' where JAX discovers the cluster (Cloud TPU, SLURM).",
    'process_count': 'Number of processes (jax.distributed).',
    'process_index': 'This process (jax.distributed).',
}


def define_process_flags() -> None:
  for name, help_text in PROCESS_FLAGS.items():
    if name not in flags.FLAGS:
      flags.DEFINE_string(name, None, help_text)


def initialize_processes() -> None:
  """Joins the job's processes (jax.distributed) when --coordinator_address is given."""
  address = flags.FLAGS.coordinator_address
  if not address:
    return
  import jax  # pylint: disable=g-import-not-at-top  (this module is otherwise JAX-free)
  # CPU processes need a collectives implementation to run one program together (tests, CPU
  # clusters); TPU and GPU ignore this setting.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if address == 'auto':
    jax.distributed.initialize()  # Cloud TPU / SLURM: JAX discovers the cluster itself.
  else:
    jax.distributed.initialize(address, int(flags.FLAGS.process_count),
                               int(flags.FLAGS.process_index))


def exit_with_error(message: str) -> None:
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(1)


def run(main: Callable[[Sequence[str]], None], argv: Optional[Sequence[str]] = None,
        help_text: Optional[Callable[[], str]] = None) -> None:
  """`absl.app.run(main)` for a job's command: the gin flags defined, `--gin.NAME=VALUE`
  rewritten, --help printing `help_text()` (exit 0), JAX's backend probing kept off stderr."""
  define_gin_flags()
  argv = list(sys.argv if argv is None else argv)
  if help_text is not None and any(arg in HELP_ARGS for arg in argv[1:]):
    print(help_text(), flush=True)
    sys.exit(0)
  # JAX logs at INFO why each backend it probes is absent ("Unable to initialize backend
  # 'tpu'"); absl's handler, which app.run installs, would print that before a job's own output
  # and errors. Its warnings (a missing GPU build) still show.
  logging.getLogger('jax').setLevel(logging.WARNING)
  try:
    argv = rewrite_gin_args(argv)
  except ValueError as e:
    exit_with_error(str(e))
  app.run(main, argv=argv)


def bound_arguments(fn: Union[Callable, str]) -> Dict[str, Any]:
  """The arguments gin binds to `fn`: a configurable as gin hands one to a constructor (e.g.
  `@spec_decoding.speculative_sample` under dynamic registration) or its name
  ('decoding.speculative_sample'); {} where gin binds none."""
  try:
    return dict(gin.get_bindings(fn))
  except ValueError:  # not in gin's registry: a plain function or partial
    return {}
