"""Sharding target and draft over a ('data', 'model') device mesh with T5X's logical axis rules.

T5X names every parameter axis logically (`network.init_params` returns those names as
`params_axes`) and maps names to mesh axes with `standard_logical_axis_rules`; this module does
the same for both models of a speculative pair and for their `network.DecoderCache`s, then
compiles the whole predict function once with explicit input and output shardings (`jax.jit`
with shardings is what `pjit` became). The batch is split over 'data'; heads, MLP and vocabulary
over 'model'.

Shapes: `batch` rows, `length` positions; a mesh is `data` x `model` devices.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from absl import logging
import flax
import flax.linen as nn
from flax.linen import partitioning as nn_partitioning
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from speculative_t5x import network

LogicalAxisRules = Tuple[Tuple[str, Optional[str]], ...]
PyTree = Any

MESH_AXES = ('data', 'model')

# Where the draft's parameters and cache live (`draft_logical_axis_rules`): split over 'model' by
# the same rules as the target, copied whole onto every device of a model group, or chosen from
# the two models' sizes ('auto', the default).
DRAFT_SHARDED = 'sharded'
DRAFT_REPLICATED = 'replicated'
DRAFT_AUTO = 'auto'
DRAFT_PLACEMENTS = (DRAFT_AUTO, DRAFT_SHARDED, DRAFT_REPLICATED)


def standard_logical_axis_rules(activation_partitioning_dims: int = 1,
                                parameter_partitioning_dims: int = 1,
                                additional_rules: Optional[Sequence[Tuple[str, Optional[str]]]]
                                = None) -> LogicalAxisRules:
  """T5X's default logical-name -> mesh-axis rules, in T5X's order.

  The rules are priority-ordered. Resolving an array's logical names (flax's
  `logical_to_mesh_axes`) walks them once, front to back: a rule assigns its mesh axis to the
  array axis with that name only while that axis is still unassigned and no other axis of the
  same array already uses that mesh axis. Hence the first applicable rule for a name wins, and a
  `(name, None)` rule settles `name` as replicated for good.

  With (1, 1): batch over 'data'; vocab, mlp, heads and joined_kv over 'model'; embed and kv
  replicated. activation_partitioning_dims=2 puts embed over 'model' and
  parameter_partitioning_dims=2 puts embed over 'data' (both: 'model' first, 'data' as the
  fallback). Those embed rules come after mlp/heads/joined_kv, so a kernel [embed, mlp] keeps
  its mlp axis on 'model' and its embed axis only gets a mesh axis that is still free.

  Args:
    activation_partitioning_dims: 1 or 2.
    parameter_partitioning_dims: 1 or 2.
    additional_rules: appended after the standard rules, as T5X does. They can therefore only
      decide what the standard rules leave open: names the standard rules do not mention, or a
      fallback mesh axis for a name whose standard rule found its mesh axis taken (e.g.
      ('embed', 'data') with activation_partitioning_dims=2). They cannot override a standard
      rule; for that, give `Partitioner(logical_axis_rules=...)` a complete list.

  Returns:
    Tuple of (logical name, mesh axis or None) pairs.
  """
  if activation_partitioning_dims not in (1, 2) or parameter_partitioning_dims not in (1, 2):
    raise ValueError('activation_partitioning_dims and parameter_partitioning_dims must be 1 or '
                     f'2, got {activation_partitioning_dims} and {parameter_partitioning_dims}.')
  split_embed = []
  if activation_partitioning_dims == 2:
    split_embed.append(('embed', 'model'))
  if parameter_partitioning_dims == 2:
    split_embed.append(('embed', 'data'))
  rules = [('batch', 'data'), ('vocab', 'model')]
  # Only the 1-D layout pins embed as replicated, before the mlp/heads rules. The 2-D layouts
  # try embed last, so in a kernel [embed, mlp] mlp claims 'model' and embed gets what is left.
  if not split_embed:
    rules.append(('embed', None))
  rules += [('mlp', 'model'), ('heads', 'model'), ('kv', None), ('joined_kv', 'model')]
  rules += split_embed
  rules += [('relpos_buckets', None), ('abspos_buckets', None), ('length', None),
            ('layers', None), ('stack', None), ('mlp_activations', None)]
  rules += [tuple(rule) for rule in additional_rules or ()]
  return tuple(rules)


def num_params(config: network.T5Config) -> int:
  """Parameters of `config`'s network, counted abstractly (nothing is allocated)."""
  shapes, _ = jax.eval_shape(functools.partial(network.init_params, config))
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)))


def replicated_rules(rules: LogicalAxisRules) -> LogicalAxisRules:
  """`rules` with every name but 'batch' replicated: a model placed whole on each device of its
  model group (its batch still split over 'data' as the target's)."""
  return tuple((name, axis if name == 'batch' else None) for name, axis in rules)


def draft_logical_axis_rules(target_config: network.T5Config,
                             draft_config: Optional[network.T5Config], rules: LogicalAxisRules,
                             model_size: int, placement: str = DRAFT_AUTO) -> LogicalAxisRules:
  """The rules for the draft's parameters and cache under `placement`.

  A sharded draft pays the target's collectives on every draft step: three all-reduces per
  layer plus gathers wherever its (few) heads do not divide the 'model' axis, each a round trip
  over the interconnect for a step that reads a few MB of weights. Replicated, a draft step has
  no collective at all, at the cost of holding (and reading) all of its weights on every device.
  'auto' replicates a draft of at most 1/`model_size` of the target's parameters: it then costs
  each device no more memory, and a draft step no more weight reads, than the device's share of
  the target (T5 1.1 small is 1/10 of large and 1/143 of XXL). Measured on 8 devices: see
  docs/scale.md.
  """
  if placement not in DRAFT_PLACEMENTS:
    raise ValueError(f'draft placement must be one of {DRAFT_PLACEMENTS}, got {placement!r}.')
  if placement == DRAFT_AUTO:
    if draft_config is None or model_size == 1:
      return rules
    placement = (DRAFT_REPLICATED if num_params(draft_config) * model_size <=
                 num_params(target_config) else DRAFT_SHARDED)
  return replicated_rules(rules) if placement == DRAFT_REPLICATED else rules


def create_mesh(mesh_shape: Optional[Tuple[int, int]] = None, num_partitions: int = 1,
                devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A 2-D Mesh over ('data', 'model'), laid out on the interconnect as T5X lays it out.

  mesh_shape: (data, model) sizes whose product is the number of devices; default
    (devices / num_partitions, num_partitions). A -1 entry is inferred.
  devices: default `jax.devices()` (all processes' devices).

  The placement follows `device_grid`: on TPU each 'model' group is a compact block of the
  physical torus, on GPU it stays inside a host's NVLink domain when it fits, and on CPU devices
  are taken in process-major order.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if mesh_shape is None:
    if n % num_partitions:
      raise ValueError(f'num_partitions={num_partitions} does not divide the {n} devices.')
    mesh_shape = (n // num_partitions, num_partitions)
  mesh_shape = tuple(int(s) for s in mesh_shape)
  if len(mesh_shape) != 2:
    raise ValueError(f'mesh_shape must be (data, model), got {mesh_shape}.')
  if mesh_shape.count(-1) == 1:
    known = -math.prod(mesh_shape)
    if n % known:
      raise ValueError(f'mesh_shape {mesh_shape} cannot cover {n} devices.')
    mesh_shape = tuple(n // known if s == -1 else s for s in mesh_shape)
  if math.prod(mesh_shape) != n:
    raise ValueError(f'mesh_shape {mesh_shape} needs {math.prod(mesh_shape)} devices, '
                     f'but {n} are available.')
  return Mesh(device_grid(devices, mesh_shape), MESH_AXES)


def device_grid(devices: Sequence[Any], mesh_shape: Tuple[int, int]) -> np.ndarray:
  """The [data, model] object array of `devices` that `create_mesh` builds its Mesh from.

  The layout goals are those of T5X's `default_mesh`, reached through
  `jax.experimental.mesh_utils`: one fast-interconnect domain (a TPU slice; on GPU, one host)
  gets `create_device_mesh`, which maps 'model', the axis with the most traffic, onto whole TPU
  torus axes (T5X's `get_mesh` does this by hand from device coordinates) or onto consecutive
  GPU ids. Several GPU hosts or TPU slices get `create_hybrid_device_mesh` with 'model' inside a
  domain as far as it fits, which is T5X's GPU mesh. CPU devices have no topology and are taken
  process-major, then by id, as in T5X's CPU mesh. Device sets that mesh_utils cannot lay out
  (e.g. a TPU subset that is not a cuboid) fall back to that plain order with a warning.
  """
  # Process-major order: T5X's CPU layout, and the order mesh_utils expects its input in.
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  model = mesh_shape[1]
  platform = devices[-1].platform
  try:
    if platform == 'cpu':
      return mesh_utils.create_device_mesh(mesh_shape, devices)
    domain = ((lambda d: getattr(d, 'slice_index', 0)) if platform == 'tpu'
              else (lambda d: d.process_index))
    num_domains = len({domain(d) for d in devices})
    if num_domains == 1:
      return mesh_utils.create_device_mesh(mesh_shape, devices, allow_split_physical_axes=True)
    per_domain = len(devices) // num_domains
    inner_model = min(model, per_domain)
    if per_domain % inner_model or model % inner_model or num_domains % (model // inner_model):
      raise ValueError(f"'model' size {model} is neither a factor nor a multiple of the "
                       f'{per_domain} devices per host/slice')
    inner = (per_domain // inner_model, inner_model)
    outer = (num_domains // (model // inner_model), model // inner_model)
    return mesh_utils.create_hybrid_device_mesh(
        inner, outer, devices, process_is_granule=platform != 'tpu',
        allow_split_physical_axes=True)
  except (ValueError, NotImplementedError, AssertionError) as e:
    logging.warning('mesh_utils cannot lay out a %s mesh over these %d %s devices (%s); using '
                    'plain device order.', mesh_shape, len(devices), platform, e)
    return np.asarray(devices, dtype=object).reshape(mesh_shape)


def _spec_for_shape(logical: Optional[Sequence[Optional[str]]], shape: Sequence[int],
                    rules: LogicalAxisRules, mesh: Mesh, what: str = '') -> PartitionSpec:
  """Mesh PartitionSpec of an array with logical axis names; undividable axes are replicated.

  T5X would fail on an axis whose size the mesh axis does not divide (e.g. 6 heads over 4
  devices); replicating that one axis keeps the program correct at some memory cost, and the
  warning says so.
  """
  if logical is None:
    return PartitionSpec()
  spec = nn.logical_to_mesh_axes(tuple(logical), rules)
  out = []
  for dim, (size, axis) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
    if axis is None:
      out.append(None)
      continue
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    devices = math.prod(mesh.shape[a] for a in axes)
    if size % devices:
      logging.warning('%s: axis %d (%s, size %d) is not divisible by mesh axis %s (%d devices); '
                      'replicating it.', what or 'array', dim, logical[dim], size, axis, devices)
      out.append(None)
    else:
      out.append(axis)
  while out and out[-1] is None:
    out.pop()
  return PartitionSpec(*out)


def params_logical_axes(config: network.T5Config) -> PyTree:
  """Per-parameter tuples of logical axis names, in the tree of `network.init_params(config)`.

  Computed abstractly (no parameters are materialised), so it also serves checkpoints that
  carry no axis names (T5X legacy, Hugging Face).
  """
  _, params_axes = jax.eval_shape(functools.partial(network.init_params, config))
  return axes_to_names(params_axes)


def axes_to_names(params_axes: PyTree) -> PyTree:
  """T5X `params_axes` (`<name>_axes: AxisMetadata`) -> tuples of names under the params' keys."""
  specs = flax.core.unfreeze(nn_partitioning.get_axis_names(params_axes))
  return jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def params_shardings(params: PyTree, logical_axes: PyTree, mesh: Mesh,
                     rules: Optional[LogicalAxisRules] = None) -> PyTree:
  """NamedSharding per parameter (tree of `params`, whose leaves may be ShapeDtypeStructs)."""
  rules = standard_logical_axis_rules() if rules is None else rules
  flat_names = dict(jax.tree_util.tree_flatten_with_path(
      logical_axes, is_leaf=lambda x: isinstance(x, tuple))[0])

  def sharding(path, leaf):
    names = flat_names.get(path)
    if names is None:
      raise ValueError(f'No logical axis names for parameter {jax.tree_util.keystr(path)}.')
    spec = _spec_for_shape(names, np.shape(leaf), rules, mesh, jax.tree_util.keystr(path))
    return NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(sharding, params)


def cache_shardings(cache: network.DecoderCache, mesh: Mesh,
                    rules: Optional[LogicalAxisRules] = None) -> network.DecoderCache:
  """NamedShardings of a DecoderCache: batch over 'data', heads over 'model' (by `rules`)."""
  rules = standard_logical_axis_rules() if rules is None else rules
  logical = network.DecoderCache.logical_axes()

  def field(name):
    # One set of axis names per field, applied to each of its per-layer leaves.
    return jax.tree_util.tree_map(
        lambda leaf: NamedSharding(mesh, _spec_for_shape(getattr(logical, name), np.shape(leaf),
                                                         rules, mesh, f'cache.{name}')),
        getattr(cache, name))

  return cache.replace(**{name: field(name) for name in cache.__dataclass_fields__})


def constrain_cache(mesh: Mesh, rules: Optional[LogicalAxisRules] = None,
                    draft_config: Optional[network.T5Config] = None,
                    draft_rules: Optional[LogicalAxisRules] = None) -> Callable[[Any], Any]:
  """A function pinning a (traced) DecoderCache to `cache_shardings`; others pass unchanged.

  With `draft_rules`, a cache of the draft's shape (`draft_config`'s decoder layers, heads and
  head size) is pinned by those instead; the caller makes sure that the target's cache has
  another shape (`partition_predict` does).
  """

  def constrain(cache):
    if not isinstance(cache, network.DecoderCache):
      return cache
    use = rules
    if draft_rules is not None and _cache_signature(cache) == _config_signature(draft_config):
      use = draft_rules
    return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh, use))

  return constrain


def _cache_signature(cache: network.DecoderCache) -> Tuple[int, ...]:
  return (len(cache.self_key),) + tuple(np.shape(cache.self_key[0])[1:3])


def _config_signature(config: Optional[network.T5Config]) -> Tuple[int, ...]:
  if config is None:
    return ()
  return (config.num_decoder_layers, config.num_heads, config.head_dim)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Every batch feature [batch, ...] split over 'data' (also every predict output)."""
  return NamedSharding(mesh, PartitionSpec('data'))


def shard_batch(batch: Mapping[str, np.ndarray], mesh: Mesh) -> Dict[str, jax.Array]:
  """Places a batch on the mesh, split over 'data'.

  Single process: `batch` is the global batch. Several processes: each passes its own rows
  (global batch / process count, in process order), as T5X's per-host input pipeline does.
  """
  sharding = batch_sharding(mesh)
  if jax.process_count() == 1:
    return {k: jax.device_put(np.asarray(v), sharding) for k, v in batch.items()}
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in batch.items()}


def shard_params(params: PyTree, shardings: PyTree) -> PyTree:
  """Puts host arrays onto the mesh; each process must hold the full (replicated) values."""
  if jax.process_count() == 1:
    return jax.device_put(params, shardings)
  return jax.tree.map(
      lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda idx: np.asarray(x)[idx]),
      params, shardings)


def pair_shardings(model: Any, mesh: Mesh, rules: Optional[LogicalAxisRules] = None,
                   params: Optional[PyTree] = None, draft_placement: str = DRAFT_AUTO
                   ) -> Dict[str, PyTree]:
  """{'target': shardings, 'draft': shardings} for an `EncoderDecoderModel`'s parameters.

  Shapes come from `params` when given, else from the configs (abstractly). Params that carry
  decode-time variables (`EncoderDecoderModel.with_decode_variables`) get their shardings under
  'decode' too. The draft's follow `draft_placement` (`model_rules`).
  """
  all_rules = model_rules(model, mesh, rules, draft_placement)
  configs = {'target': model.target_config, 'draft': model.draft_config}
  out = {}
  for name, config in configs.items():
    if config is None or (params is not None and name not in params):
      continue
    shapes = params[name] if params is not None else jax.eval_shape(
        functools.partial(network.init_params, config))[0]
    out[name] = params_shardings(shapes, params_logical_axes(config), mesh, all_rules[name])
  if params is not None and 'decode' in params:  # EncoderDecoderModel.with_decode_variables
    out['decode'] = {
        name: params_shardings(variables, network.decode_variables_logical_axes(configs[name]),
                               mesh, all_rules[name])
        for name, variables in params['decode'].items()}
  return out


def model_rules(model: Any, mesh: Mesh, rules: Optional[LogicalAxisRules] = None,
                draft_placement: str = DRAFT_AUTO) -> Dict[str, LogicalAxisRules]:
  """{'target': rules, 'draft': rules} of a model pair under `draft_placement`.

  The draft keeps the target's rules when both decoders have caches of one shape (the cache
  constraint could not tell them apart), or when it would be placed as the target anyway.
  """
  rules = standard_logical_axis_rules() if rules is None else rules
  draft = model.draft_config
  draft_rules = rules
  if draft is not None and _config_signature(draft) != _config_signature(model.target_config):
    draft_rules = draft_logical_axis_rules(model.target_config, draft, rules,
                                           mesh.shape['model'], draft_placement)
  elif draft_placement not in DRAFT_PLACEMENTS:
    raise ValueError(f'draft placement must be one of {DRAFT_PLACEMENTS}, got '
                     f'{draft_placement!r}.')
  return {'target': rules, 'draft': draft_rules}


def partition_predict(model: Any, mesh: Mesh, rules: Optional[LogicalAxisRules] = None,
                      params: Optional[PyTree] = None, draft_placement: str = DRAFT_AUTO,
                      **predict_kwargs
                      ) -> Callable[[PyTree, Mapping[str, jax.Array], jax.Array],
                                    Tuple[jax.Array, Dict[str, Any]]]:
  """`model.predict_batch_with_aux` compiled once for `mesh` with explicit shardings.

  Returns `fn(params, batch, rng) -> (decodes [batch, length], aux)`: params {'target',
  'draft'} sharded by the logical axis rules (`pair_shardings`), every batch feature and every
  output split over 'data', `rng` replicated. Both models' decoder caches are pinned to
  `cache_shardings` where they are created; the draft's parameters and cache are placed by
  `draft_placement` ('auto', 'sharded' or 'replicated': `draft_logical_axis_rules`).
  `predict_kwargs` (decoder_params, num_decodes,
  return_all_decodes, ...) are fixed at compile time. Batch size must be a multiple of the
  'data' size.
  """
  rules = standard_logical_axis_rules() if rules is None else rules
  sharded_model = copy.copy(model)
  all_rules = model_rules(model, mesh, rules, draft_placement)
  sharded_model.constrain_cache = constrain_cache(
      mesh, rules, model.draft_config,
      all_rules['draft'] if all_rules['draft'] != rules else None)
  param_shardings = pair_shardings(model, mesh, rules, params, draft_placement)
  replicated = NamedSharding(mesh, PartitionSpec())

  def predict(params, batch, rng):
    with nn_partitioning.axis_rules(rules):
      return sharded_model.predict_batch_with_aux(params, batch, rng, **predict_kwargs)

  return jax.jit(predict, in_shardings=(param_shardings, batch_sharding(mesh), replicated),
                 out_shardings=batch_sharding(mesh))


class Partitioner:
  """The mesh and rules of one job (gin: `partitioning.Partitioner`, T5X's PjitPartitioner role).

  num_partitions: devices per model replica ('model' size); ignored when `mesh_shape` is given.
  mesh_shape: (data, model); -1 in one entry is inferred from the device count. The mesh is
    built lazily by `create_mesh` (topology-aware, see `device_grid`).
  logical_axis_rules: the complete, priority-ordered rule list (first applicable rule per name
    wins, as in T5X's PjitPartitioner); default `standard_logical_axis_rules()`. Extra rules
    given through `standard_logical_axis_rules(additional_rules=...)` (gin:
    `partitioning.standard_logical_axis_rules.additional_rules`) come after the standard ones,
    exactly as in T5X, so T5X gin files resolve to the same shardings here.
  devices: the mesh's, default `jax.devices()` (a TPU topology's, to compile for it here).
  draft_placement: the draft's parameters and cache split over 'model' like the target's
    ('sharded'), whole on every device ('replicated'), or replicated when the draft has at most
    1/'model' of the target's parameters ('auto', the default): `draft_logical_axis_rules`.
  """

  def __init__(self, num_partitions: int = 1, mesh_shape: Optional[Tuple[int, int]] = None,
               logical_axis_rules: Optional[LogicalAxisRules] = None,
               draft_placement: str = DRAFT_AUTO, devices: Optional[Sequence[Any]] = None):
    self.num_partitions = num_partitions
    self.devices = devices
    self.mesh_shape = tuple(mesh_shape) if mesh_shape is not None else None
    self.logical_axis_rules = (standard_logical_axis_rules() if logical_axis_rules is None
                               else tuple(tuple(r) for r in logical_axis_rules))
    if draft_placement not in DRAFT_PLACEMENTS:
      raise ValueError(f'draft_placement must be one of {DRAFT_PLACEMENTS}, got '
                       f'{draft_placement!r}.')
    self.draft_placement = draft_placement
    self._mesh: Optional[Mesh] = None

  @property
  def mesh(self) -> Mesh:
    if self._mesh is None:
      self._mesh = create_mesh(self.mesh_shape, self.num_partitions, self.devices)
    return self._mesh

  @property
  def data_size(self) -> int:
    """Number of batch shards: the global batch size must be a multiple of it."""
    return self.mesh.shape['data']

  def pair_shardings(self, model: Any, params: Optional[PyTree] = None) -> Dict[str, PyTree]:
    return pair_shardings(model, self.mesh, self.logical_axis_rules, params,
                          self.draft_placement)

  def partition_predict(self, model: Any, params: Optional[PyTree] = None, **predict_kwargs):
    return partition_predict(model, self.mesh, self.logical_axis_rules, params,
                             self.draft_placement, **predict_kwargs)
