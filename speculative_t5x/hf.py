"""Hugging Face T5 <-> T5X: HF folders as (T5Config, params), and (T5Config, params) as HF folders.

Reading (`load_hf_t5`): a local `save_pretrained` folder with `config.json` and the weights as
`model.safetensors`, sharded `model-xxxxx-of-yyyyy.safetensors` (+ `model.safetensors.index.json`)
or `pytorch_model.bin`. Safetensors files are read here with numpy alone (bfloat16 through
ml_dtypes, which JAX ships); only `pytorch_model.bin` needs torch
(`pip install speculative_t5x[hf]`).
Writing (`save_hf_t5`, `hf_config_from`, `hf_state_dict_from`) needs numpy alone too; `to_hf_model`
builds the `transformers.T5ForConditionalGeneration` in memory (torch + transformers).

Mapping (HF `T5ForConditionalGeneration` <-> T5X `network.Transformer`, one table, `_hf_names`):
`torch.nn.Linear` stores `[out, in]`, T5X kernels are `[in, out]`, so every projection is
transposed; the relative-attention table `[buckets, heads]` of block 0 becomes
`relpos_bias/rel_embedding` `[heads, buckets]`; HF's T5 does not scale queries by 1/sqrt(d) either,
and with tied embeddings scales the decoder output by d_model**-0.5 as T5X's `logits_via_embedding`
does, so no value changes besides transposition. HF's `feed_forward_proj` 'gated-gelu' (gelu_new,
the tanh GELU that flax's `nn.gelu` computes) is T5 1.1's ('gelu', 'linear'); 'relu' is T5 1.0's
('relu',).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import ml_dtypes
import numpy as np
from flax import traverse_util

from speculative_t5x import network

Params = Dict[str, Any]

_SAFETENSORS_DTYPES = {
    'F64': np.float64, 'F32': np.float32, 'F16': np.float16, 'BF16': ml_dtypes.bfloat16,
    'I64': np.int64, 'I32': np.int32, 'I16': np.int16, 'I8': np.int8, 'U8': np.uint8,
    'BOOL': np.bool_,
}
_ACTIVATIONS = {
    'relu': ('relu',), 'gelu': ('gelu',), 'gated-gelu': ('gelu', 'linear'),
    'gated-gelu_new': ('gelu', 'linear'), 'gated-silu': ('silu', 'linear'),
}


def is_hf_checkpoint(path: os.PathLike) -> bool:
  """Whether `path` is a folder with an HF T5 config and weights."""
  path = Path(path)
  if not (path / 'config.json').is_file():
    return False
  try:
    config = json.loads((path / 'config.json').read_text())
  except (json.JSONDecodeError, UnicodeDecodeError):
    return False
  return (isinstance(config, dict) and config.get('model_type') in ('t5', 'mt5') and
          bool(_weight_files(path)))


def _scales_decoder_output(hf_config: Dict[str, Any]) -> bool:
  # transformers >= 5 writes `scale_decoder_outputs` (and always tie_word_embeddings=True);
  # earlier versions used tie_word_embeddings for both tying and scaling (T5 1.0: True).
  if 'scale_decoder_outputs' in hf_config:
    return bool(hf_config['scale_decoder_outputs'])
  return bool(hf_config.get('tie_word_embeddings', True))


def config_from_hf(hf_config: Dict[str, Any], dtype: Any = 'float32',
                   separate_lm_head: bool = False) -> network.T5Config:
  """The network.T5Config of an HF T5/mT5 `config.json` dict (ValueError if unsupported).

  T5X's `logits_via_embedding` is HF's tied-and-scaled output (T5 1.0). Any other combination
  (an own `lm_head`, or the shared embedding without the d_model**-0.5 scale) becomes an
  explicit `logits_dense` kernel; `separate_lm_head` says whether the weights have their own.
  """
  proj = hf_config.get('feed_forward_proj', 'relu')
  if proj == 'gated-gelu' and hf_config.get('dense_act_fn', 'gelu_new') not in (
      'gelu_new', 'gelu_pytorch_tanh', 'gelu'):
    raise ValueError(f"unsupported dense_act_fn {hf_config['dense_act_fn']!r}")
  if proj not in _ACTIVATIONS:
    raise ValueError(f'unsupported feed_forward_proj {proj!r} (known: {sorted(_ACTIVATIONS)})')
  for key, want in (('relative_attention_num_buckets', network.RELPOS_NUM_BUCKETS),
                    ('relative_attention_max_distance', network.RELPOS_MAX_DISTANCE)):
    if hf_config.get(key, want) != want:
      raise ValueError(f'{key} is {hf_config[key]}; this network supports {want} only')
  if not hf_config.get('is_encoder_decoder', True):
    raise ValueError('only encoder-decoder T5 checkpoints are supported')
  num_layers = hf_config['num_layers']
  return network.T5Config(
      vocab_size=hf_config['vocab_size'], dtype=dtype, emb_dim=hf_config['d_model'],
      num_heads=hf_config['num_heads'], num_encoder_layers=num_layers,
      num_decoder_layers=hf_config.get('num_decoder_layers') or num_layers,
      head_dim=hf_config['d_kv'], mlp_dim=hf_config['d_ff'], mlp_activations=_ACTIVATIONS[proj],
      dropout_rate=0.0,
      logits_via_embedding=_scales_decoder_output(hf_config) and not separate_lm_head)


def load_hf_t5(path: os.PathLike) -> Tuple[network.T5Config, Params]:
  """(config, params) of an HF T5 folder; params are numpy arrays in the T5X tree.

  Raises ValueError (one line) for unsupported configs or missing/extra/mis-shaped weights.
  """
  path = Path(path)
  hf_config = json.loads((path / 'config.json').read_text())
  weights = read_hf_weights(path)
  separate = 'lm_head.weight' in weights and not (
      'shared.weight' in weights and np.array_equal(weights['lm_head.weight'],
                                                    weights['shared.weight']))
  try:
    config = config_from_hf(hf_config, separate_lm_head=separate)
  except (KeyError, ValueError) as e:
    raise ValueError(f'{path}: unsupported Hugging Face T5 config: {e}') from None
  return config, convert_hf_weights(weights, config, str(path),
                                    scale_logits=_scales_decoder_output(hf_config))


def read_hf_weights(path: os.PathLike) -> Dict[str, np.ndarray]:
  """All tensors of the folder's weight files by HF name, as numpy arrays."""
  tensors = {}
  for file in _weight_files(Path(path)):
    if file.suffix == '.safetensors':
      tensors.update(read_safetensors(file))
    else:
      tensors.update(_read_torch_bin(file))
  return tensors


def _weight_files(path: Path):
  single = path / 'model.safetensors'
  if single.is_file():
    return [single]
  index = path / 'model.safetensors.index.json'
  if index.is_file():
    files = sorted(set(json.loads(index.read_text())['weight_map'].values()))
    return [path / f for f in files]
  shards = sorted(path.glob('model-*-of-*.safetensors'))
  if shards:
    return shards
  if (path / 'pytorch_model.bin').is_file():
    return [path / 'pytorch_model.bin']
  return []


def read_safetensors(file: os.PathLike) -> Dict[str, np.ndarray]:
  """Reads a .safetensors file: u64 header size, JSON header {name: dtype, shape, offsets}."""
  raw = Path(file).read_bytes()
  if len(raw) < 8:
    raise ValueError(f'{file}: not a safetensors file (too short)')
  (header_size,) = struct.unpack('<Q', raw[:8])
  try:
    header = json.loads(raw[8:8 + header_size])
  except (json.JSONDecodeError, UnicodeDecodeError):
    raise ValueError(f'{file}: not a safetensors file (bad header)') from None
  data = memoryview(raw)[8 + header_size:]
  out = {}
  for name, info in header.items():
    if name == '__metadata__':
      continue
    dtype = _SAFETENSORS_DTYPES.get(info['dtype'])
    if dtype is None:
      raise ValueError(f'{file}: tensor {name} has unsupported dtype {info["dtype"]}')
    start, end = info['data_offsets']
    out[name] = np.frombuffer(data[start:end], dtype=dtype).reshape(info['shape']).copy()
  return out


def _read_torch_bin(file: Path) -> Dict[str, np.ndarray]:
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(f'{file}: reading pytorch_model.bin needs torch (pip install '
                     "'speculative_t5x[hf]'), or convert the folder to safetensors") from None
  state = torch.load(file, map_location='cpu', weights_only=True)
  # numpy has no bfloat16: such tensors go through float32 (exact).
  return {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in state.items()}


def _hf_names(config: network.T5Config) -> Dict[Tuple[str, ...], Tuple[str, bool]]:
  """T5X param path -> (HF tensor name, transpose?)."""
  names = {('token_embedder', 'embedding'): ('shared.weight', False)}
  mlp_names = (['wi'] if len(config.mlp_activations) == 1 else
               [f'wi_{i}' for i in range(len(config.mlp_activations))])

  def attention(prefix, hf_prefix):
    for ours, theirs in (('query', 'q'), ('key', 'k'), ('value', 'v'), ('out', 'o')):
      names[prefix + (ours, 'kernel')] = (f'{hf_prefix}.{theirs}.weight', True)

  def mlp(prefix, hf_prefix):
    for name in mlp_names + ['wo']:
      names[prefix + ('mlp', name, 'kernel')] = (f'{hf_prefix}.DenseReluDense.{name}.weight', True)

  for stack, layers in (('encoder', config.num_encoder_layers),
                        ('decoder', config.num_decoder_layers)):
    names[(stack, 'relpos_bias', 'rel_embedding')] = (
        f'{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight', True)
    norm = 'encoder_norm' if stack == 'encoder' else 'decoder_norm'
    names[(stack, norm, 'scale')] = (f'{stack}.final_layer_norm.weight', False)
    for i in range(layers):
      ours, theirs = (stack, f'layers_{i}'), f'{stack}.block.{i}.layer'
      if stack == 'encoder':
        names[ours + ('pre_attention_layer_norm', 'scale')] = (f'{theirs}.0.layer_norm.weight',
                                                               False)
        attention(ours + ('attention',), f'{theirs}.0.SelfAttention')
        names[ours + ('pre_mlp_layer_norm', 'scale')] = (f'{theirs}.1.layer_norm.weight', False)
        mlp(ours, f'{theirs}.1')
      else:
        names[ours + ('pre_self_attention_layer_norm', 'scale')] = (
            f'{theirs}.0.layer_norm.weight', False)
        attention(ours + ('self_attention',), f'{theirs}.0.SelfAttention')
        names[ours + ('pre_cross_attention_layer_norm', 'scale')] = (
            f'{theirs}.1.layer_norm.weight', False)
        attention(ours + ('encoder_decoder_attention',), f'{theirs}.1.EncDecAttention')
        names[ours + ('pre_mlp_layer_norm', 'scale')] = (f'{theirs}.2.layer_norm.weight', False)
        mlp(ours, f'{theirs}.2')
  return names


# HF state dicts may repeat the shared embedding under these names; they are the same tensor.
_ALIASES = ('encoder.embed_tokens.weight', 'decoder.embed_tokens.weight')


def convert_hf_weights(weights: Dict[str, np.ndarray], config: network.T5Config,
                       source: str = '', scale_logits: bool = False) -> Params:
  """HF tensors (by name) -> T5X params for `config`; one-line ValueError on any mismatch.

  Without `config.logits_via_embedding`, `logits_dense` is HF's `lm_head` (or the shared
  embedding when the file has no separate head), times d_model**-0.5 if `scale_logits`.
  """
  where = f' [{source}]' if source else ''
  names = _hf_names(config)
  head = None
  if not config.logits_via_embedding:
    head = 'lm_head.weight' if 'lm_head.weight' in weights else 'shared.weight'
  missing = sorted(hf for hf, _ in names.values() if hf not in weights)
  if missing:
    raise ValueError(f'Hugging Face checkpoint lacks {missing[0]} ({len(missing)} missing)'
                     f'{where}')
  used = {hf for hf, _ in names.values()}
  # The tied lm_head may be saved as a copy of shared.weight; anything else left over is a
  # weight this config would silently ignore.
  leftover = sorted(k for k in weights if k not in used and k not in _ALIASES and not (
      k == 'lm_head.weight' and (head == k or np.array_equal(weights[k], weights['shared.weight']))))
  if leftover:
    raise ValueError(f'Hugging Face checkpoint has {leftover[0]}, which the config does not use '
                     f'({len(leftover)} unused){where}')
  flat = {}
  for path, (hf, transpose) in names.items():
    value = np.asarray(weights[hf])
    flat[path] = value.T if transpose else value
  if head is not None:
    kernel = np.asarray(weights[head]).T
    if scale_logits:
      kernel = (kernel.astype(np.float32) * config.emb_dim ** -0.5).astype(kernel.dtype)
    flat[('decoder', 'logits_dense', 'kernel')] = kernel
  params = traverse_util.unflatten_dict(flat)
  network.validate_params(params, config, source)
  return params


# ------------------------------------------------------------------------------------------------
# T5X -> Hugging Face.

_FEED_FORWARD_PROJ = {('gelu', 'linear'): 'gated-gelu', ('relu',): 'relu',
                      ('silu', 'linear'): 'gated-silu'}
_DENSE_ACT_FN = {'gated-gelu': 'gelu_new', 'relu': 'relu', 'gated-silu': 'silu'}
_LOGITS_KERNEL = ('decoder', 'logits_dense', 'kernel')
# The ids every T5 vocabulary (and data.py's) uses; generation starts from pad.
_PAD_ID, _EOS_ID = 0, 1


def hf_config_from(config: network.T5Config) -> Dict[str, Any]:
  """The HF `config.json` dict of `config`.

  ValueError for a decoder-only config, and unless mlp_activations are T5 1.1's, T5 1.0's or
  ('silu', 'linear') (HF's plain 'gelu' is the erf GELU; flax's is the tanh one).

  Both conventions for the output layer are written: transformers < 5 reads
  `tie_word_embeddings` as 'share and scale by d_model**-0.5'; transformers >= 5 always shares
  (unless the weights file has a different `lm_head.weight`) and reads the scaling from
  `scale_decoder_outputs` (see `_scales_decoder_output`). T5X's `logits_via_embedding` is both;
  its absence is an own, unscaled `lm_head`.
  """
  if not config.has_encoder:
    raise ValueError(f'A decoder-only model (encoded_width {config.encoded_width}) has no '
                     'Hugging Face T5 form: it reads another model\'s encoder.')
  proj = _FEED_FORWARD_PROJ.get(tuple(config.mlp_activations))
  if proj is None:
    raise ValueError(f'mlp_activations {tuple(config.mlp_activations)} have no Hugging Face T5 '
                     f'feed_forward_proj (supported: {sorted(_FEED_FORWARD_PROJ)})')
  tied = bool(config.logits_via_embedding)
  return {
      'architectures': ['T5ForConditionalGeneration'],
      'model_type': 't5',
      'vocab_size': config.vocab_size,
      'd_model': config.emb_dim,
      'd_kv': config.head_dim,
      'd_ff': config.mlp_dim,
      'num_layers': config.num_encoder_layers,
      'num_decoder_layers': config.num_decoder_layers,
      'num_heads': config.num_heads,
      'relative_attention_num_buckets': network.RELPOS_NUM_BUCKETS,
      'relative_attention_max_distance': network.RELPOS_MAX_DISTANCE,
      'feed_forward_proj': proj,
      'dense_act_fn': _DENSE_ACT_FN[proj],
      'is_gated_act': proj.startswith('gated-'),
      'layer_norm_epsilon': 1e-6,  # network.RMSNorm's
      'dropout_rate': 0.0,
      'initializer_factor': 1.0,
      'is_encoder_decoder': True,
      'use_cache': True,
      'pad_token_id': _PAD_ID,
      'eos_token_id': _EOS_ID,
      # T5 has no BOS; without this generate() has no first decoder token.
      'decoder_start_token_id': _PAD_ID,
      'tie_word_embeddings': tied,
      'scale_decoder_outputs': tied,
      # The weights are written in float32 whatever config.dtype (the activation dtype) says.
      'dtype': 'float32',
  }


def hf_state_dict_from(config: network.T5Config, params: Params) -> Dict[str, np.ndarray]:
  """The tensors HF's `save_pretrained` would write: HF name -> float32 numpy array.

  `params`: the T5X tree of `config`, jax or numpy leaves of any float dtype.
  Kernels `[in, out]` become `[out, in]` and `rel_embedding` `[heads, buckets]` becomes
  `[buckets, heads]`. Without `logits_via_embedding`, `logits_dense/kernel` `[emb, vocab]` is
  `lm_head.weight` `[vocab, emb]`, unscaled. Names HF ties to `shared.weight`
  (`encoder/decoder.embed_tokens.weight`, and `lm_head.weight` when tied) are left out, as HF
  leaves them out of its files; `to_hf_model` fills them in for `load_state_dict`.
  Raises the one-line ValueError of `network.validate_params` if params do not fit config.
  """
  network.validate_params(params, config, 'T5X params exported to Hugging Face')
  flat = traverse_util.flatten_dict(params)

  def as_f32(x, transpose: bool) -> np.ndarray:
    # A copy: writable and contiguous (torch.from_numpy wants both; jax arrays come read-only),
    # and never an alias of the caller's buffer.
    x = np.asarray(x)
    return np.array(x.T if transpose else x, dtype=np.float32, order='C')

  out = {hf: as_f32(flat[path], transpose) for path, (hf, transpose) in _hf_names(config).items()}
  if not config.logits_via_embedding:
    out['lm_head.weight'] = as_f32(flat[_LOGITS_KERNEL], True)
  return out


def write_safetensors(file: os.PathLike, tensors: Dict[str, np.ndarray],
                      metadata: Optional[Dict[str, str]] = None) -> None:
  """Writes numpy arrays as a .safetensors file (the layout `read_safetensors` reads).

  Layout: u64 little-endian header size, a JSON header {name: {dtype, shape, data_offsets}}
  padded with spaces so that the data starts 8-byte aligned, then the tensors' raw
  little-endian bytes back to back in header order.
  """
  codes = {np.dtype(v): k for k, v in _SAFETENSORS_DTYPES.items()}
  header: Dict[str, Any] = {'__metadata__': dict(metadata)} if metadata else {}
  chunks, offset = [], 0
  for name in sorted(tensors):
    array = np.ascontiguousarray(tensors[name])
    if array.dtype.byteorder == '>':
      array = array.astype(array.dtype.newbyteorder('<'))
    if array.dtype not in codes:
      raise ValueError(f'{name}: dtype {array.dtype} has no safetensors code')
    raw = array.tobytes()
    header[name] = {'dtype': codes[array.dtype], 'shape': list(array.shape),
                    'data_offsets': [offset, offset + len(raw)]}
    chunks.append(raw)
    offset += len(raw)
  encoded = json.dumps(header, separators=(',', ':')).encode('utf-8')
  encoded += b' ' * (-len(encoded) % 8)
  with open(file, 'wb') as f:
    f.write(struct.pack('<Q', len(encoded)))
    f.write(encoded)
    for raw in chunks:
      f.write(raw)


def save_hf_t5(path: os.PathLike, config: network.T5Config, params: Params) -> None:
  """Writes `config.json` and `model.safetensors` (float32) to `path` (created if needed).

  The folder loads with `transformers.T5ForConditionalGeneration.from_pretrained(path)` (no
  missing or unexpected weights) and back with `load_hf_t5(path)` to the same params (as float32).
  Without `logits_via_embedding`, transformers 5.x (5.24 checked) logs that it will "NOT tie"
  `lm_head` to `shared` because both are in the file and differ: its T5Config forces
  tie_word_embeddings=True, so every T5 1.1 checkpoint gets that message; the head is loaded.
  """
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors = hf_state_dict_from(config, params)
  # No generation_config.json: without one, from_pretrained derives it from config.json, whose
  # decoder_start/eos/pad ids are all greedy generate() needs.
  (path / 'config.json').write_text(json.dumps(hf_config_from(config), indent=2, sort_keys=True)
                                    + '\n')
  # from_pretrained of transformers 4.x refuses safetensors files without format 'pt'.
  write_safetensors(path / 'model.safetensors', tensors, metadata={'format': 'pt'})


def to_hf_model(config: network.T5Config, params: Params):
  """A float32 `transformers.T5ForConditionalGeneration` in eval mode with `params`' weights.

  Needs torch and transformers (ImportError otherwise). Its logits equal
  `network.Transformer(config).apply(...)`'s to float32 rounding, and its generation config
  (from `hf_config_from`) starts decoding from id 0 and stops at id 1, as
  `models.EncoderDecoderModel` does. With transformers 5.24, `generate()` of a decoder deeper
  than the encoder needs a lazily grown cache (`cache=EncoderDecoderCache(DynamicCache(),
  DynamicCache())`) or `use_cache=False`: the cache it builds has `num_layers`, the encoder's.
  """
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError('to_hf_model needs torch and transformers: '
                      f"pip install 'speculative_t5x[hf]' ({e})") from e
  hf_config = transformers.T5Config(**hf_config_from(config))  # its checks first: one line
  tensors = hf_state_dict_from(config, params)
  model = transformers.T5ForConditionalGeneration(hf_config)
  if not config.logits_via_embedding:
    # transformers >= 5 ties lm_head to shared.weight whatever tie_word_embeddings says (it
    # unties only in from_pretrained, when the file's tensors differ); loading two different
    # tensors into one shared Parameter would silently keep the last. Give lm_head its own.
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    tied = getattr(model, 'all_tied_weights_keys', None)
    if isinstance(tied, dict):
      tied.pop('lm_head.weight', None)  # so a later tie_weights() does not re-tie it
  # state_dict() lists tied Parameters under every name they have; strict loading wants all.
  aliases = _ALIASES + (('lm_head.weight',) if config.logits_via_embedding else ())
  for name in model.state_dict():
    if name in aliases and name not in tensors:
      tensors[name] = tensors['shared.weight']
  model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
  return model.float().eval()
