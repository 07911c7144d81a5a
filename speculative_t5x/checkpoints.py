"""Reading T5X checkpoints into the network's parameter tree, and the project's own checkpoints.

Formats read by `load_t5x_checkpoint` (detected from what is on disk, not from names given):

  * T5X legacy: a msgpack file (`checkpoint_<step>/checkpoint`, or any single file such as T5X's
    `test_t5_tiny.checkpoint_0`) holding `{'version': 3, 'optimizer': {'target': params,
    'state': ...}}`. Each leaf is either an inline array or a tensorstore spec dict naming a zarr
    array by a path relative to the checkpoint directory (one directory per array, named
    `target.<dotted param path>`).
  * T5X Orbax (`OrbaxCheckpointManagerInterface`, T5X's default): `checkpoint_<step>/` holding
    Orbax's step metadata, a `dataset/` item and `state/`, an Orbax PyTree checkpoint (OCDBT,
    zarr arrays) whose tree is `{'target': params, 'state': {'step': ..., 'param_states': ...}}`.
    Only `target` is returned; the optimizer slots are not even read where Orbax supports
    partial restore.
  * The project's own format (`save_params`): that same Orbax tree written to one directory,
    `{'target': params, 'state': {'step': step}}`, so T5X-side tooling and this loader share one
    reader.

`load_checkpoint` also reads the project's shipped weights files (`export_weights`: one msgpack
file of bfloat16 params plus the config) and training runs (`config.json` + Orbax
`checkpoints/`, read by `restore_params`), and Hugging Face T5 folders (`hf.py`). All weight I/O
of the training and inference jobs is here.

A path may name the checkpoint file, a `checkpoint_<step>` directory, an Orbax tree directory, or
a model directory holding `checkpoint_<step>` directories (the highest step is taken). Both T5X
layouts are tested against checkpoints written by T5X itself. Only local filesystem paths are
supported (a gs:// path is a one-line ValueError). Parameters come back as a nested dict of
numpy arrays in the tree of `network.init_params`, e.g.
`params['encoder']['layers_0']['attention']['query']['kernel']`.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple, Union

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from flax import traverse_util

from speculative_t5x import gin_utils
from speculative_t5x import hf
from speculative_t5x import network

Params = Dict[str, Any]
PathLike = Union[str, os.PathLike]
DTypeLike = Any

# T5X's `get_checkpoint_prefix()` default; temporary directories carry a suffix and never match.
_STEP_DIR = re.compile(r'^checkpoint_(\d+)$')
_MSGPACK_FILE = 'checkpoint'
_ORBAX_ITEM = 'state'
# Files only an Orbax PyTree checkpoint directory has (the second for OCDBT without metadata).
_ORBAX_MARKERS = ('_METADATA', 'manifest.ocdbt')
# T5X's `_DESIRED_CHUNK_SIZE_BYTES`: zarr chunks are kept under this size.
_CHUNK_BYTES = 64 * 1024 * 1024
# A T5X msgpack file starts with a map header (fixmap, map16 or map32); checking this first
# rejects other files without reading them whole.
_MSGPACK_MAP_PREFIXES = set(range(0x80, 0x90)) | {0xde, 0xdf}


# ------------------------------------------------------------------------------------------------
# Public API.


def load_t5x_checkpoint(path: PathLike, config: Optional[network.T5Config] = None,
                        dtype: Optional[DTypeLike] = None) -> Params:
  """Reads the model parameters (`target`) of a T5X checkpoint, legacy or Orbax.

  Args:
    path: the msgpack checkpoint file, a `checkpoint_<step>` directory, an Orbax tree directory
      (`checkpoint_<step>/state` or a `save_params` directory), or a model directory with
      `checkpoint_<step>` directories (the highest step is read).
    config: when given, the tree must have exactly the parameter names and shapes that
      `network.init_params(config)` creates.
    dtype: when given (e.g. 'bfloat16', jnp.float32), floating leaves are cast to it.

  Returns:
    Nested dict of numpy arrays, the `params` collection of `network.Transformer`.

  Raises:
    FileNotFoundError: `path` does not exist.
    ValueError: `path` holds no T5X checkpoint, an array it names cannot be read, or the tree
      does not match `config` (one line naming the first differing parameter).
  """
  source = _find_checkpoint(_local_path(path))
  if _is_orbax_tree(source):
    params = _read_orbax_target(source)
  else:
    params = _read_legacy_target(source)
  return _finish(params, source, config, dtype)


def load_checkpoint(path: PathLike, config: Optional[network.T5Config] = None,
                    dtype: Optional[DTypeLike] = None) -> Params:
  """Reads parameters from any supported checkpoint, detecting the format from the files.

  Formats: everything `load_t5x_checkpoint` reads (T5X legacy, T5X Orbax, `save_params`); a
  weights file of `export_weights` (msgpack with 'config' and 'params'; its stored config must
  agree with `config`); a training run folder of `speculative_t5x.train` (`config.json` +
  `checkpoints/`); a Hugging Face T5 folder (`config.json` + `*.safetensors`
  or `pytorch_model.bin`, see `hf.py`).

  Raises FileNotFoundError for a missing path and a one-line ValueError for anything
  unreadable or not matching `config`.
  """
  path = _local_path(path)
  if not path.exists():
    raise FileNotFoundError(f'No such checkpoint: {path}')
  if path.is_dir() and (path / 'config.json').is_file():
    if (path / 'checkpoints').is_dir():
      run_config, params, _ = restore_params(path)
      return _finish(_check_stored_config(params, run_config, config, path), path, config, dtype)
    if hf.is_hf_checkpoint(path):
      hf_config, params = hf.load_hf_t5(path)
      return _finish(_check_stored_config(params, hf_config, config, path), path, config, dtype)
  if path.is_file():
    contents = _read_msgpack(path)
    if isinstance(contents, dict) and 'params' in contents and 'config' in contents:
      stored = network.T5Config(**json.loads(contents['config']))
      params = jax.tree.map(np.asarray, contents['params'])
      return _finish(_check_stored_config(params, stored, config, path), path, config, dtype)
    return _finish(_read_legacy_target(path, contents), path, config, dtype)
  return load_t5x_checkpoint(path, config, dtype)


# Fields that change what the parameters mean; dtype and dropout do not.
_ARCHITECTURE_FIELDS = ('vocab_size', 'emb_dim', 'num_heads', 'num_encoder_layers',
                        'num_decoder_layers', 'head_dim', 'mlp_dim', 'mlp_activations',
                        'logits_via_embedding', 'encoded_width')


def _check_stored_config(params: Params, stored: network.T5Config,
                         config: Optional[network.T5Config], source: Path) -> Params:
  """Raises a one-line ValueError if a checkpoint's own config disagrees with `config`."""
  if config is not None:
    differ = [f'{f} {getattr(stored, f)!r} in the checkpoint but {getattr(config, f)!r} in the '
              'config' for f in _ARCHITECTURE_FIELDS if getattr(stored, f) != getattr(config, f)]
    if differ:
      raise ValueError(f'checkpoint does not match T5Config: {differ[0]} '
                       f'({len(differ)} field(s) differ) [{source}]')
  return params


def save_params(path: PathLike, params: Params, step: int = 0, overwrite: bool = False) -> Path:
  """Writes `params` to the directory `path` in the project's format; returns `path`.

  The format is T5X's Orbax `state` item without optimizer slots: an Orbax PyTree checkpoint
  (OCDBT) of `{'target': params, 'state': {'step': int32}}`. Leaves may be numpy or (sharded)
  jax arrays. `path` must not exist unless `overwrite` is set.
  """
  path = Path(path).absolute()
  if path.exists() and not overwrite:
    raise FileExistsError(f'Refusing to overwrite existing checkpoint directory {path}')
  checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True))
  checkpointer.save(path, args=ocp.args.PyTreeSave(_orbax_tree(params, step)), force=overwrite)
  return path


def load_params(path: PathLike, config: Optional[network.T5Config] = None,
                dtype: Optional[DTypeLike] = None) -> Params:
  """Reads parameters written by `save_params` (exactly that directory; no step search).

  `config` and `dtype` act as in `load_t5x_checkpoint`. Raises FileNotFoundError for a missing
  path and ValueError for a directory that is not such a checkpoint.
  """
  path = _local_path(path)
  if not path.exists():
    raise FileNotFoundError(f'No such checkpoint: {path}')
  if not _is_orbax_tree(path):
    raise ValueError(f'{path} is not a speculative_t5x params checkpoint (no Orbax tree there)')
  return _finish(_read_orbax_target(path), path, config, dtype)


def save_t5x_legacy_checkpoint(directory: PathLike, params: Params, step: int = 0,
                               use_zarr: bool = True) -> Path:
  """Writes `params` as T5X's legacy checkpoint `<directory>/checkpoint_<step>/`; returns that.

  Layout as T5X's `Checkpointer.save`: a msgpack `checkpoint` file with
  `{'version': 3, 'optimizer': {'target': ..., 'state': {'step': int32, 'param_states': {}}}}`
  whose target leaves are tensorstore specs (relative paths) of zarr v2 arrays
  `target.<dotted path>/` (gzip level 1, '.' chunk keys), or inline arrays if `use_zarr` is
  False. Written to a temporary directory and renamed, as T5X does, so a half-written
  checkpoint is never found. Exists to test the reader; no optimizer slots are written.
  """
  final = Path(directory).absolute() / f'checkpoint_{step}'
  if final.exists():
    raise FileExistsError(f'Refusing to overwrite existing checkpoint directory {final}')
  tmp = final.with_name(f'{final.name}.tmp-{time.time_ns()}')
  tmp.mkdir(parents=True)
  flat = traverse_util.flatten_dict(params)
  target, writes = {}, []
  for key, value in flat.items():
    value = np.asarray(value)
    if not use_zarr or value.ndim == 0:
      target[key] = value
      continue
    spec = _zarr_spec(f"target.{'.'.join(key)}/", value)
    target[key] = spec
    absolute = dict(spec, kvstore=dict(spec['kvstore'], path=str(tmp / spec['kvstore']['path'])))
    store = ts.open(absolute, create=True).result()
    writes.append(store.write(value))
  for write in writes:
    write.result()
  contents = {
      'version': 3,
      'optimizer': {
          'target': traverse_util.unflatten_dict(target),
          'state': {'step': np.asarray(step, np.int32), 'param_states': {}},
      },
  }
  (tmp / _MSGPACK_FILE).write_bytes(flax.serialization.msgpack_serialize(contents))
  tmp.rename(final)
  return final


def save_t5x_orbax_checkpoint(directory: PathLike, params: Params, step: int = 0) -> Path:
  """Writes `params` as T5X's Orbax checkpoint `<directory>/checkpoint_<step>/`; returns that.

  Layout as T5X's `OrbaxCheckpointManagerInterface`: the step directory holds Orbax's step
  metadata (`_CHECKPOINT_METADATA`) and the item `state/`, an OCDBT PyTree checkpoint of
  `{'target': params, 'state': {'step': int32}}` (the tree `save_params` writes on its own).
  Exists to test the reader; no optimizer slots or dataset item are written.
  """
  step_dir = Path(directory).absolute() / f'checkpoint_{step}'
  if step_dir.exists():
    raise FileExistsError(f'Refusing to overwrite existing checkpoint directory {step_dir}')
  # A composite of one item, as T5X's checkpoint manager writes it: the step metadata goes in
  # the step directory, not inside `state/`.
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(
      **{_ORBAX_ITEM: ocp.PyTreeCheckpointHandler(use_ocdbt=True)}))
  # T5X saves jax.Arrays, whose shardings Orbax records (`_sharding`, `array_metadatas/`);
  # numpy leaves would be stored as a different value type. Leaves JAX would change the dtype
  # of (64-bit ones without jax_enable_x64) stay numpy.
  tree = jax.tree.map(
      lambda x: jax.device_put(x) if jax.dtypes.canonicalize_dtype(np.result_type(x)) ==
      np.result_type(x) else x, _orbax_tree(params, step))
  checkpointer.save(step_dir, args=ocp.args.Composite(**{_ORBAX_ITEM: ocp.args.PyTreeSave(tree)}))
  return step_dir


def _orbax_tree(params: Params, step: int) -> Dict[str, Any]:
  return {'target': params, 'state': {'step': np.asarray(step, np.int32)}}


# ------------------------------------------------------------------------------------------------
# The project's weights files (bf16 export, fp32 load) and training runs.


def config_to_dict(config: network.T5Config) -> Dict[str, Any]:
  """`config`'s fields as JSON values: `network.T5Config(**config_to_dict(config)) == config`."""
  cfg = {f.name: getattr(config, f.name) for f in config.__dataclass_fields__.values()}
  cfg['dtype'] = str(jnp.dtype(cfg['dtype']))
  cfg['mlp_activations'] = list(cfg['mlp_activations'])
  return cfg


def config_to_json(config: network.T5Config) -> str:
  """`config` as the JSON text of a run's `config.json` and of a weights file's 'config'."""
  return json.dumps(config_to_dict(config))


def export_weights(params: Params, config: network.T5Config, path: PathLike,
                   extra: Optional[Dict[str, Any]] = None) -> int:
  """Writes params as bfloat16 plus the config in one msgpack file; returns its size in bytes.

  bf16 halves the file (the repository budget is 35 MB for all weights and the vocabulary); the
  loss of precision is ~3 significant digits, which greedy outputs tolerate.
  """
  payload = {
      'config': config_to_json(config),
      'extra': json.dumps(extra or {}),
      'params': jax.tree_util.tree_map(lambda x: np.asarray(x, jnp.bfloat16), params),
  }
  raw = flax.serialization.msgpack_serialize(flax.serialization.to_state_dict(payload))
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  Path(path).write_bytes(raw)
  return len(raw)


def load_weights(path: PathLike) -> Tuple[network.T5Config, Params, Dict[str, Any]]:
  """(config, float32 params, extra metadata) from an `export_weights` file."""
  payload = flax.serialization.msgpack_restore(Path(path).read_bytes())
  config = network.T5Config(**json.loads(payload['config']))
  params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), payload['params'])
  return config, params, json.loads(payload.get('extra', '{}'))


def restore_params(model_dir: PathLike, config: Optional[network.T5Config] = None,
                   step: Optional[int] = None) -> Tuple[network.T5Config, Params, int]:
  """(config, params, step) from the latest (or `step`) Orbax checkpoint of a training run."""
  model_dir = Path(model_dir).resolve()
  if config is None:
    config = network.T5Config(**json.loads((model_dir / 'config.json').read_text()))
  with ocp.CheckpointManager(model_dir / 'checkpoints') as manager:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f'No checkpoint in {model_dir / "checkpoints"}.')
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  params = jax.tree_util.tree_map(jnp.asarray, restored['state']['params'])
  return config, params, int(step)


def load_model(source: PathLike) -> Tuple[network.T5Config, Params]:
  """A model from an exported weights file or a training run's folder (packaged files too, as
  `gin_utils.resolve_path` finds them: 'speculative_t5x/pretrained/...')."""
  source = gin_utils.resolve_path(source)
  if source.is_file():
    config, params, _ = load_weights(source)
  else:
    config, params, _ = restore_params(source)
  return config, params


# The file beside a draft's weights listing the tokens it may propose: {"token_ids": [...]}.
DRAFT_VOCABULARY_SUFFIX = '.vocabulary.json'


def write_draft_vocabulary(path: PathLike, token_ids: Sequence[int], source: str) -> Path:
  """Writes `<path>.vocabulary.json`, the tokens the draft at `path` may propose (read back by
  `load_draft_vocabulary`) and, in words, where they come from; returns the file's path."""
  sidecar = Path(os.fspath(path) + DRAFT_VOCABULARY_SUFFIX)
  sidecar.write_text(json.dumps({'token_ids': [int(i) for i in token_ids], 'source': source},
                                separators=(',', ':')), encoding='utf-8')
  return sidecar


def load_draft_vocabulary(path: Optional[PathLike]) -> Optional[np.ndarray]:
  """The token ids a draft may propose, [n] int32, from `<path>.vocabulary.json` beside its
  weights (`EncoderDecoderModel.with_decode_variables`' draft_vocabulary), or None when there
  is no such file. A malformed file raises a one-line ValueError naming it."""
  if path is None or '://' in os.fspath(path):
    return None
  sidecar = Path(os.fspath(gin_utils.resolve_path(path)) + DRAFT_VOCABULARY_SUFFIX)
  if not sidecar.is_file():
    return None
  try:
    ids = np.asarray(json.loads(sidecar.read_text())['token_ids'], np.int32)
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f'{sidecar}: not a draft vocabulary ({{"token_ids": [...]}}): {e}') from None
  if ids.ndim != 1 or not ids.size or ids.min() < 0 or len(np.unique(ids)) != ids.size:
    raise ValueError(f'{sidecar}: token_ids must be distinct non-negative ids, got {ids.size} '
                     'ids')
  return ids


# ------------------------------------------------------------------------------------------------
# Locating a checkpoint.


def _local_path(path: PathLike) -> Path:
  """`path` as an absolute local path; a one-line ValueError for URLs such as gs://."""
  text = os.fspath(path)
  if '://' in text:
    raise ValueError(f'{text}: only local checkpoint paths are supported; copy the checkpoint '
                     'directory to local disk first')
  return Path(text).expanduser().absolute()


def _is_orbax_tree(path: Path) -> bool:
  return path.is_dir() and any((path / marker).is_file() for marker in _ORBAX_MARKERS)


def _step_dirs(path: Path) -> Iterator[Tuple[int, Path]]:
  for child in path.iterdir():
    match = _STEP_DIR.match(child.name)
    if match and child.is_dir():
      yield int(match.group(1)), child


def _find_checkpoint(path: Path) -> Path:
  """Resolves `path` to a legacy msgpack file or an Orbax tree directory."""
  if not path.exists():
    raise FileNotFoundError(f'No such checkpoint: {path}')
  if path.is_file() or _is_orbax_tree(path):
    return path
  if _is_orbax_tree(path / _ORBAX_ITEM):
    return path / _ORBAX_ITEM
  if (path / _MSGPACK_FILE).is_file():
    return path / _MSGPACK_FILE
  steps = sorted(_step_dirs(path))
  if steps:
    return _find_checkpoint(steps[-1][1])
  raise ValueError(f'{path} is not a T5X checkpoint: no msgpack `checkpoint` file, Orbax '
                   '`state` tree or `checkpoint_<step>` directory in it')


# ------------------------------------------------------------------------------------------------
# Reading.


def _read_msgpack(path: Path) -> Any:
  """The decoded contents of a msgpack checkpoint file (ValueError if it is not one)."""
  not_t5x = f'{path} is not a T5X checkpoint'
  with open(path, 'rb') as f:
    head = f.read(1)
    if not head or head[0] not in _MSGPACK_MAP_PREFIXES:
      raise ValueError(f'{not_t5x} (not a msgpack map)')
    data = head + f.read()
  try:
    return flax.serialization.msgpack_restore(data)
  except Exception as e:  # msgpack signals corrupt input with many unrelated exception types.
    raise ValueError(f'{not_t5x} (msgpack decoding failed: {type(e).__name__})') from e


def _read_legacy_target(path: Path, contents: Any = None) -> Params:
  """Reads `optimizer/target` from a legacy msgpack file, resolving tensorstore specs."""
  not_t5x = f'{path} is not a T5X checkpoint'
  contents = _read_msgpack(path) if contents is None else contents
  optimizer = contents.get('optimizer') if isinstance(contents, dict) else None
  if not isinstance(optimizer, dict) or not isinstance(optimizer.get('target'), dict):
    raise ValueError(f"{not_t5x} (no 'optimizer'/'target' in the msgpack)")

  flat = traverse_util.flatten_dict(optimizer['target'], is_leaf=lambda _, v: _is_ts_spec(v))
  # Start every tensorstore read before waiting on any, so arrays load concurrently.
  pending = {k: _open_spec(v, path.parent, k) for k, v in flat.items() if _is_ts_spec(v)}
  arrays = {}
  for key, value in flat.items():
    if key in pending:
      try:
        value = pending[key].result().read().result()
      except Exception as e:  # tensorstore reports I/O and format errors as ValueError/OSError.
        raise ValueError(f"{path}: cannot read parameter '{'/'.join(key)}' from "
                         f"{_spec_location(flat[key], path.parent)}: {e}") from e
    arrays[key] = np.asarray(value)
  return traverse_util.unflatten_dict(arrays)


def _is_ts_spec(value: Any) -> bool:
  # T5X's own test for a spec leaf (`_is_leaf` in t5x/checkpoints.py).
  return isinstance(value, dict) and {'driver', 'kvstore', 'metadata'} <= set(value)


def _spec_location(spec: Dict[str, Any], checkpoint_dir: Path) -> str:
  return os.path.join(checkpoint_dir, spec['kvstore']['path'])


def _open_spec(spec: Dict[str, Any], checkpoint_dir: Path, key: Tuple[str, ...]) -> ts.Future:
  """Opens a T5X spec leaf from the local checkpoint directory."""
  driver = spec['kvstore'].get('driver')
  # Specs name 'gcs' (dummy bucket) or 'gfile' when written on GCS or by older T5X; the path is
  # relative to the checkpoint directory either way.
  if driver not in ('file', 'gfile', 'gcs'):
    raise ValueError(f"{checkpoint_dir}: parameter '{'/'.join(key)}' uses unsupported "
                     f'tensorstore kvstore driver {driver!r}')
  # Chunking and compression are whatever was written; dropping them lets the stored
  # .zarray decide, as T5X's reader does.
  metadata = {k: v for k, v in spec['metadata'].items() if k not in ('chunks', 'compressor')}
  local = dict(spec, metadata=metadata,
               kvstore={'driver': 'file', 'path': _spec_location(spec, checkpoint_dir)})
  return ts.open(local, open=True)


def _read_orbax_target(path: Path) -> Params:
  """Restores only the `target` subtree of an Orbax PyTree checkpoint, as numpy arrays."""
  checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
  try:
    # The handler's own metadata, not the Checkpointer's: T5X keeps the step metadata one level
    # up (`checkpoint_<step>/_CHECKPOINT_METADATA`), and the Checkpointer warns when it is not
    # inside the item directory.
    metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(path))
  except Exception as e:  # Orbax raises assorted errors for unreadable metadata.
    raise ValueError(f'{path} is not a T5X checkpoint (unreadable Orbax metadata: {e})') from e
  # Orbax versions differ in how much wrapping the metadata tree has.
  tree = getattr(metadata, 'item_metadata', metadata)
  tree = getattr(tree, 'tree', tree)
  if not isinstance(tree, dict) or not isinstance(tree.get('target'), dict):
    raise ValueError(f"{path} is not a T5X checkpoint (Orbax tree has no 'target')")
  as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  if 'partial_restore' in getattr(ocp.args.PyTreeRestore, '__dataclass_fields__', {}):
    # Partial restore skips optimizer slots, which are as large as the model or larger.
    restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
        item={'target': tree['target']}, restore_args={'target': as_numpy['target']},
        partial_restore=True))
  else:  # Orbax before partial_restore: read everything, keep the target.
    restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
  return jax.tree.map(np.asarray, restored['target'])


# ------------------------------------------------------------------------------------------------
# Post-processing and writing helpers.


def _finish(params: Params, source: Path, config: Optional[network.T5Config],
            dtype: Optional[DTypeLike]) -> Params:
  if config is not None:
    network.validate_params(params, config, str(source))
  if dtype is not None:
    target = jnp.dtype(dtype)
    if not jnp.issubdtype(target, jnp.floating):
      raise ValueError(f'dtype must be a floating dtype, got {target}')
    # Integer leaves (none in T5, but e.g. step counters in other trees) keep their type.
    params = jax.tree.map(
        lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
  return params


def _zarr_spec(relative_path: str, value: np.ndarray) -> Dict[str, Any]:
  """A T5X-style tensorstore spec for `value` at `relative_path` (relative to the step dir)."""
  chunks = list(value.shape)
  # Halve the largest axis until a chunk fits the target size, as T5X bounds its chunks.
  while int(np.prod(chunks)) * value.dtype.itemsize > _CHUNK_BYTES:
    axis = int(np.argmax(chunks))
    chunks[axis] = (chunks[axis] + 1) // 2
  return {
      'driver': 'zarr',
      'dtype': jnp.dtype(value.dtype).name,
      'kvstore': {'driver': 'file', 'path': relative_path},
      'metadata': {
          'chunks': chunks,
          'compressor': {'id': 'gzip', 'level': 1},
          'shape': list(value.shape),
      },
  }
