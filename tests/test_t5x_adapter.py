"""The optional T5X adapter and the gin files a T5X user includes (gin_configs/t5x/).

Without T5X, the adapter class is built over a minimal stand-in for `t5x.models` (the two
names the adapter uses) so that the gin files can be parsed and the model they describe built;
the tests that need T5X's own code skip, naming it. The end-to-end check, `python -m t5x.infer`
with these files against T5X's own EncoderDecoderModel, needs a T5X install and is described
in t5x_adapter's docstring and the README.
"""

import dataclasses
import functools
import pathlib
import re
import sys
import types

import flax
import gin
import jax
import numpy as np
import pytest

from speculative_t5x import checkpoints
from speculative_t5x import decoding
from speculative_t5x import evaluation
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import t5x_adapter
from conftest import random_model
from conftest import tiny_config

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = REPO / 'gin_configs'
T5X_CONFIGS = CONFIGS / 't5x'
NEEDS_T5X = pytest.mark.skipif(
    not t5x_adapter.T5X_AVAILABLE,
    reason='needs T5X itself (not a dependency; see docs for a private install)')


def _stub_t5x_models() -> types.ModuleType:
  """What the adapter takes from `t5x.models`: DecoderParams and an EncoderDecoderModel base
  keeping its constructor arguments as T5X's does."""
  stub = types.ModuleType('t5x.models')

  @dataclasses.dataclass(frozen=True)
  class DecoderParams:
    return_all_decodes: bool = False
    num_decodes: int = 1

  class EncoderDecoderModel:

    def __init__(self, module, input_vocabulary, output_vocabulary, optimizer_def,
                 decode_fn=None, default_decoder_params=None, **kwargs):
      del kwargs
      self.module = module
      self._input_vocabulary = input_vocabulary
      self._output_vocabulary = output_vocabulary
      self.optimizer_def = optimizer_def
      self._decode_fn = decode_fn
      self._default_decoder_params = default_decoder_params or DecoderParams()

    def predict_batch(self, params, batch, rng=None):
      return self.predict_batch_with_aux(params, batch, rng=rng)[0]

  stub.DecoderParams = DecoderParams
  stub.EncoderDecoderModel = EncoderDecoderModel
  return stub


def _adapter_class_and_models():
  """(SpeculativeEncoderDecoderModel, DistillationEncoderDecoderModel, the t5x.models they
  subclass): T5X's, else the stub's."""
  if t5x_adapter.T5X_AVAILABLE:
    from t5x import models as t5x_models  # pylint: disable=g-import-not-at-top
    return (t5x_adapter.SpeculativeEncoderDecoderModel,
            t5x_adapter.DistillationEncoderDecoderModel, t5x_models)
  stub = _stub_t5x_models()
  package = types.ModuleType('t5x')
  package.models = stub
  saved = {name: sys.modules.get(name) for name in ('t5x', 't5x.models')}
  sys.modules.update({'t5x': package, 't5x.models': stub})
  try:
    return (*t5x_adapter._build_class(), stub)  # pylint: disable=protected-access
  finally:
    for name, module in saved.items():
      if module is None:
        sys.modules.pop(name)
      else:
        sys.modules[name] = module


# Built once: gin registers the class object the first time a gin file names it.
ADAPTER, DISTILLATION, T5X_MODELS = _adapter_class_and_models()


@pytest.fixture
def clean_gin(monkeypatch):
  # Where T5X is absent the gin files find the stub-based class under the real name.
  monkeypatch.setattr(t5x_adapter, 'SpeculativeEncoderDecoderModel', ADAPTER, raising=False)
  gin.clear_config()
  # Includes name 'speculative_t5x/gin_configs/...': found through the Python path (the
  # editable install maps that package to the top-level gin_configs/); REPO is a fallback.
  gin.add_config_file_search_path(str(REPO))
  yield
  gin.clear_config()


def test_imports_without_t5x():
  assert isinstance(t5x_adapter.T5X_AVAILABLE, bool)
  assert hasattr(t5x_adapter, 'SpeculativeEncoderDecoderModel') == t5x_adapter.T5X_AVAILABLE


# ------------------------------------------------------------------------------------------------
# The gin files.

T5X_GIN_FILES = ('vocab_multi30k.gin', 'multi30k_pair.gin', 'speculative_greedy.gin', 'bild.gin',
                 'multi30k_task.gin', 'multi30k_target_t5x_greedy.gin', 'multi30k_distill.gin',
                 'multi30k_distill_teacher.gin')


def test_docstring_recipe_names_shipped_files():
  doc = t5x_adapter.__doc__
  named = set(re.findall(r'speculative_t5x/gin_configs/t5x/(\w+\.gin)', doc))
  assert named == {'multi30k_pair.gin', 'speculative_greedy.gin', 'multi30k_task.gin'}
  for name in set(T5X_GIN_FILES) | named:
    assert (T5X_CONFIGS / name).is_file(), name
  # The recipe binds what T5X's infer.gin leaves required and does not bind itself.
  assert '--gin_file=t5x/configs/runs/infer.gin' in doc
  for macro in ('CHECKPOINT_PATH', 'INFER_OUTPUT_DIR'):
    assert f'--gin.{macro}=' in doc
  assert 'python -m speculative_t5x.t5x_adapter --output_dir=' in doc


def test_gin_finds_t5x_files_through_the_python_path(tmp_path, monkeypatch):
  """T5X's CLI searches '.' and T5X's folder; for other relative paths gin imports the folder as
  a package. A folder that is no regular package makes gin fail (TypeError, not 'not found')."""
  from gin import resource_reader  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(tmp_path)
  for name in T5X_GIN_FILES:
    assert resource_reader.system_path_file_exists(f'speculative_t5x/gin_configs/t5x/{name}'), name


def _imported_aliases(text: str):
  aliases = set()
  for line in text.splitlines():
    m = re.match(r'\s*from\s+([\w.]+)\s+import\s+(\w+)(?:\s+as\s+(\w+))?', line)
    if m and m.group(1) != '__gin__':
      aliases.add(m.group(3) or m.group(2))
    m = re.match(r'\s*import\s+([\w.]+)(?:\s+as\s+(\w+))?\s*$', line)
    if m:
      aliases.add(m.group(2) or m.group(1).split('.')[0])
  return aliases


@pytest.mark.parametrize('name', T5X_GIN_FILES)
def test_t5x_gin_files_name_only_what_they_import(name):
  """In a `python -m t5x.infer` run only T5X's and the file's own imports are known: a name the
  project registers statically (`network.T5Config` of gin_configs/pairs/) fails there."""
  text = (T5X_CONFIGS / name).read_text()
  assert text.count('from __gin__ import dynamic_registration') == 1
  aliases = _imported_aliases(text)
  code = '\n'.join(line.split('#')[0] for line in text.splitlines())
  code = re.sub(r"'[^']*'", "''", code)  # strings hold paths, not configurables
  selectors = set(re.findall(r'@(?:\w+/)*([\w.]+)', code))  # references
  selectors |= set(re.findall(r'^(?:\w+/)*([\w.]+)\.\w+\s*=', code, re.M))  # bindings
  selectors |= set(re.findall(r'^(?:\w+/)*([\w.]+):\s*$', code, re.M))  # binding blocks
  macros = set(re.findall(r'^([A-Z][A-Z0-9_]*)\s*=', code, re.M))
  assert macros <= {'VOCABULARY', 'MODEL', 'MIXTURE_OR_TASK_NAME', 'TASK_FEATURE_LENGTHS',
                    'OPTIMIZER', 'BATCH_SIZE', 'TEACHER_OUTPUTS'}
  assert selectors or macros, name
  for selector in selectors:
    assert selector.split('.')[0] in aliases, (name, selector)


def _gin_value(macro: str):
  return gin.query_parameter(f'{macro}/macro.value').scoped_configurable_fn()


def _pair_file_configs():
  """The two T5Configs of gin_configs/pairs/multi30k.gin (the project CLI's names)."""
  from speculative_t5x import infer  # pylint: disable=g-import-not-at-top,unused-import  (registers)
  gin.parse_config_file(str(CONFIGS / 'pairs' / 'multi30k.gin'))
  configs = tuple(_gin_value(m) for m in ('TARGET_CONFIG', 'DRAFT_CONFIG'))
  gin.clear_config()
  return configs


def test_pair_file_builds_the_embedded_pair_model(clean_gin):
  pytest.importorskip('seqio', reason='the vocabulary is a seqio.SentencePieceVocabulary')
  target_config, draft_config = _pair_file_configs()
  gin.parse_config_files_and_bindings(
      [str(T5X_CONFIGS / 'multi30k_pair.gin'), str(T5X_CONFIGS / 'speculative_greedy.gin')], [])
  model = _gin_value('MODEL')
  assert isinstance(model, ADAPTER) and isinstance(model, T5X_MODELS.EncoderDecoderModel)
  assert model.module.config == target_config
  assert model.draft_module.config == draft_config
  vocabulary = _gin_value('VOCABULARY')
  assert type(vocabulary).__name__ == 'SentencePieceVocabulary'
  assert vocabulary.vocab_size == 8000 and vocabulary.eos_id == 1
  assert pathlib.Path(vocabulary.sentencepiece_model_file) == (
      REPO / 'speculative_t5x' / 'vocab' / 'multi30k_8k.model')
  assert model._pair.eos_id == 1  # pylint: disable=protected-access
  # Greedy: T5X calls decode_fn without temperature, so the file's binding must hold it.
  fn = model._pair.decode_fn  # pylint: disable=protected-access
  assert getattr(fn, '__wrapped__', fn) is decoding.speculative_sample
  assert gin.get_bindings(fn) == {'gamma': 4, 'temperature': 0.0}
  assert model._pair.uses_draft  # pylint: disable=protected-access


def test_calibrated_schedule_file_binds_the_pair_models_schedule(clean_gin, tmp_path):
  pytest.importorskip('seqio', reason='the vocabulary is a seqio.SentencePieceVocabulary')
  from speculative_t5x import calibrate  # pylint: disable=g-import-not-at-top
  block = {'alpha': 0.8, 'predicted_ms_per_position': {}, 'costs': {
      'target_ms': {}, 'draft_ms': {}, 'batch_ms': 0.0, 'plain_overhead_ms': 0.0,
      'overhead_ms': 0.0, 'overhead_per_token_ms': 0.0}}
  written = calibrate.write(tmp_path, {'command': 'x', 'batch_sizes': {
      1: {**block, 'best': 4}, 8: {**block, 'best': 2, 'best_choice': '(2,1,1,1)'},
      32: {**block, 'best': 0}}}, 'x')
  gin.parse_config_files_and_bindings(
      [str(T5X_CONFIGS / 'multi30k_pair.gin'), str(T5X_CONFIGS / 'speculative_greedy.gin'),
       str(written[2])], [])
  model = _gin_value('MODEL')
  assert model.gamma_schedule == {1: 4, 8: (2, 1, 1, 1), 32: 0}
  # The tree samples as the gin-bound speculative_sample does: greedy.
  assert model._tree_pairs[2, 1, 1, 1].decode_kwargs == {  # pylint: disable=protected-access
      'temperature': 0.0, 'branching': (2, 1, 1, 1)}


def test_bild_file_binds_greedy_bild(clean_gin):
  gin.parse_config_file(str(T5X_CONFIGS / 'bild.gin'))
  fn = gin.query_parameter('t5x_adapter.SpeculativeEncoderDecoderModel.decode_fn')
  fn = fn.scoped_configurable_fn
  assert getattr(fn, '__wrapped__', fn) is decoding.bild_decode
  assert gin.get_bindings(fn) == {'fallback_threshold': 0.6, 'rollback_threshold': 5.0,
                                  'max_small_steps': 10, 'temperature': 0.0}


def _binding_block(text: str, header: str):
  """The indented `name = value` lines under `header:` in a gin file."""
  lines = text.splitlines()
  start = lines.index(header + ':') + 1
  block = []
  for line in lines[start:]:
    if not line.startswith('  '):
      break
    block.append(line.split('#')[0].strip())
  return block


def test_t5x_reference_file_restates_the_target():
  """multi30k_target_t5x_greedy.gin (T5X's own model, the check) has the pair file's target."""
  pair = (T5X_CONFIGS / 'multi30k_pair.gin').read_text()
  reference = (T5X_CONFIGS / 'multi30k_target_t5x_greedy.gin').read_text()
  target = _binding_block(pair, 'target/spec_network.T5Config')
  assert len(target) == 10
  assert _binding_block(reference, 'network.T5Config') == target
  assert 'decoding.temperature_sample.temperature = 0.0' in reference


@NEEDS_T5X
def test_t5x_reference_file_builds_t5x_model(clean_gin):
  from t5x import models as t5x_models  # pylint: disable=g-import-not-at-top
  target_config, _ = _pair_file_configs()
  gin.parse_config_file(str(T5X_CONFIGS / 'multi30k_target_t5x_greedy.gin'))
  model = _gin_value('MODEL')
  assert type(model) is t5x_models.EncoderDecoderModel  # pylint: disable=unidiomatic-typecheck
  for field in dataclasses.fields(network.T5Config):
    assert getattr(model.module.config, field.name) == getattr(target_config, field.name), field
  assert gin.get_bindings(model.decode_fn) == {'temperature': 0.0}


def test_task_file_names_a_registered_task(clean_gin):
  seqio = pytest.importorskip('seqio', reason='the task is a seqio task')
  gin.parse_config_file(str(T5X_CONFIGS / 'multi30k_task.gin'))
  name = gin.query_parameter('MIXTURE_OR_TASK_NAME/macro.value')
  assert name == 'multi30k_de_en' and name in seqio.TaskRegistry.names()
  assert gin.query_parameter('TASK_FEATURE_LENGTHS/macro.value') == {'inputs': 64,
                                                                     'targets': 64}


# ------------------------------------------------------------------------------------------------
# The two-model checkpoint.


def test_write_pair_checkpoint_holds_both_models(tmp_path):
  step_dir = t5x_adapter.write_pair_checkpoint(tmp_path, step=3)
  assert step_dir == tmp_path / 'checkpoint_3' and (step_dir / 'checkpoint').is_file()
  assert (step_dir / 'target.target.token_embedder.embedding').is_dir()
  assert (step_dir / 'target.draft.decoder.decoder_norm.scale').is_dir()
  stored = checkpoints.load_t5x_checkpoint(step_dir)
  assert set(stored) == {'target', 'draft'}
  for name, path in (('target', t5x_adapter.EMBEDDED_TARGET),
                     ('draft', t5x_adapter.EMBEDDED_DRAFT)):
    expected = flax.traverse_util.flatten_dict(checkpoints.load_checkpoint(path))
    got = flax.traverse_util.flatten_dict(stored[name])
    assert set(got) == set(expected), name
    for key, value in expected.items():
      np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(value), err_msg=str(key))
  with pytest.raises(FileExistsError):
    t5x_adapter.main(['--output_dir', str(tmp_path), '--step', '3'])


def test_packaged_file():
  assert t5x_adapter.packaged_file('vocab/multi30k_8k.model') == str(
      REPO / 'speculative_t5x' / 'vocab' / 'multi30k_8k.model')
  with pytest.raises(FileNotFoundError, match='no_such.model'):
    t5x_adapter.packaged_file('vocab/no_such.model')


# ------------------------------------------------------------------------------------------------
# The model's T5X interface.


@functools.lru_cache(maxsize=None)
def _tiny_params(target_cfg, draft_cfg):
  # Random values in the networks' shapes: compiling an init costs more than these tests.
  rng = np.random.RandomState(0)
  shapes = jax.eval_shape(lambda: {'target': network.init_params(target_cfg)[0],
                                   'draft': network.init_params(draft_cfg)[0]})
  return jax.tree.map(lambda x: rng.normal(0.0, 0.5, x.shape).astype(np.float32), shapes)


def test_get_initial_variables_has_both_models():
  model, params, _, _ = _tiny_model()
  shapes = {'encoder_input_tokens': (2, 8), 'decoder_input_tokens': (2, 6)}
  variables = jax.eval_shape(lambda: model.get_initial_variables(jax.random.PRNGKey(0), shapes))
  assert set(variables) == {'params', 'params_axes'}
  assert (jax.tree.map(lambda x: x.shape, flax.core.unfreeze(variables['params'])) ==
          jax.tree.map(np.shape, params))
  assert set(variables['params_axes']) == {'target', 'draft'}


def _tiny_model(draft_cfg=None, **kwargs):
  target_cfg, draft_cfg = tiny_config(), draft_cfg or tiny_config(num_decoder_layers=1)
  kwargs.setdefault('decode_kwargs', {'gamma': 2, 'temperature': 0.0})
  model = ADAPTER(network.Transformer(target_cfg), network.Transformer(draft_cfg), None, None,
                  **kwargs)
  params = _tiny_params(target_cfg, draft_cfg)
  batch = {'encoder_input_tokens': np.arange(2, 18, dtype=np.int32).reshape(2, 8),
           'decoder_input_tokens': np.zeros((2, 6), np.int32),
           'decoder_target_tokens': np.array([[5, 6, 7, 1, 0, 0], [8, 9, 1, 0, 0, 0]], np.int32),
           'decoder_loss_weights': np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]], np.float32)}
  return model, params, batch, (target_cfg, draft_cfg)


def test_t5x_model_matches_pair_model():
  model, params, batch, (target_cfg, draft_cfg) = _tiny_model()
  pair = models.EncoderDecoderModel(target_cfg, draft_cfg, decode_fn=decoding.speculative_sample,
                                    decode_kwargs={'gamma': 2, 'temperature': 0.0}, eos_id=1)
  # Jitted: a whole decode compiles once instead of op by op.
  np.testing.assert_array_equal(jax.jit(model.predict_batch)(params, batch),
                                jax.jit(pair.predict_batch)(params, batch))


@pytest.mark.parametrize('feature_width', [0, 16])
def test_a_decoder_only_draft_through_the_adapter(feature_width):
  """A T5X job whose draft reads the target's encoder (and, with feature_width, the target's
  decoder state): T5X's initial variables hold no draft encoder, and the greedy decode is the
  target's."""
  reader = tiny_config(num_decoder_layers=1, num_encoder_layers=0, encoded_width=16,
                       feature_width=feature_width)
  model, params, batch, (target_cfg, _) = _tiny_model(reader)
  shapes = {'encoder_input_tokens': (2, 8), 'decoder_input_tokens': (2, 6)}
  initial = model.get_initial_variables(jax.random.PRNGKey(0), shapes)
  assert 'encoder' not in initial['params']['draft']
  alone = models.EncoderDecoderModel(target_cfg, decode_fn=decoding.temperature_sample,
                                     decode_kwargs={'temperature': 0.0}, eos_id=1)
  np.testing.assert_array_equal(jax.jit(model.predict_batch)(params, batch),
                                jax.jit(alone.predict_batch)(params, batch))


def test_speculative_beam_search_through_the_adapter():
  """decode_fn = speculative_beam_search with T5X's DecoderParams(num_decodes=4): beam_search's
  beams, through the same predict_batch_with_aux a T5X job calls."""
  from speculative_t5x import beam_search  # pylint: disable=g-import-not-at-top
  defaults = T5X_MODELS.DecoderParams(return_all_decodes=True, num_decodes=4)
  model, _, batch, (target_cfg, draft_cfg) = _tiny_model(
      decode_fn=functools.partial(beam_search.speculative_beam_search, branching=(4,)),
      default_decoder_params=defaults, decode_kwargs={'alpha': 0.6})
  _, target = random_model(target_cfg, seed=0, logit_scale=4.0)
  _, draft = random_model(draft_cfg, seed=1, logit_scale=4.0)
  params = {'target': target, 'draft': draft}
  beams = models.EncoderDecoderModel(target_cfg, None, decode_fn=beam_search.beam_search,
                                     decode_kwargs={'alpha': 0.6}, eos_id=1)
  ours, ours_aux = jax.jit(model.predict_batch_with_aux)(params, batch)
  theirs, theirs_aux = jax.jit(functools.partial(
      beams.predict_batch_with_aux, num_decodes=4, return_all_decodes=True))(params, batch)
  assert ours.shape == (2, 4, 6)
  np.testing.assert_array_equal(ours, theirs)
  np.testing.assert_allclose(ours_aux['scores'], theirs_aux['scores'], rtol=1e-5, atol=1e-4)


def _recording_decoder(calls):
  """A decode_fn with speculative_sample's arguments that records them and decodes nothing
  (so these tests compile no decoding loop)."""

  def decode(inputs, cache, tokens_to_logits, draft_cache, draft_tokens_to_logits, eos_id,
             decode_rng=None, num_decodes=1, temperature=0.0, gamma=4):
    del cache, tokens_to_logits, draft_cache, draft_tokens_to_logits
    calls.append(dict(eos_id=eos_id, decode_rng=decode_rng, num_decodes=num_decodes,
                      temperature=temperature, gamma=gamma))
    batch, length = inputs.shape
    decodes = np.arange(batch * num_decodes * length).reshape(batch, num_decodes, length)
    return decodes, np.arange(batch * num_decodes, dtype=np.float32).reshape(batch, num_decodes)

  return decode


def test_default_decoder_params_and_decode_rng():
  calls = []
  defaults = T5X_MODELS.DecoderParams(return_all_decodes=True, num_decodes=3)
  model, params, batch, _ = _tiny_model(default_decoder_params=defaults,
                                        decode_fn=_recording_decoder(calls))
  # The plumbing is under test, not the networks: no caches are built.
  model._pair._init_cache = lambda *args: None  # pylint: disable=protected-access
  decodes, aux = model.predict_batch_with_aux(params, batch)
  assert decodes.shape == (2, 3, 6) and aux['scores'].shape == (2, 3)
  assert calls[-1]['num_decodes'] == 3 and calls[-1]['decode_rng'] is None
  # decode_kwargs reach the decoder; decoder_params override them.
  assert (calls[-1]['gamma'], calls[-1]['temperature']) == (2, 0.0)
  top, top_aux = model.predict_batch_with_aux(params, batch, return_all_decodes=False,
                                              num_decodes=2, decoder_params={'gamma': 5})
  assert top.shape == (2, 6) and top_aux['scores'].shape == (2,)
  assert (calls[-1]['num_decodes'], calls[-1]['gamma']) == (2, 5)
  np.testing.assert_array_equal(top, np.arange(24).reshape(2, 2, 6)[:, -1])
  # T5X's rule: the decode RNG comes from `rng` or decoder_params['decode_rng'], not both.
  key = jax.random.PRNGKey(1)
  with pytest.raises(ValueError, match='decode_rng'):
    model.predict_batch_with_aux(params, batch, rng=key, decoder_params={'decode_rng': key})
  for kwargs in ({'rng': key}, {'decoder_params': {'decode_rng': key}}):
    model.predict_batch_with_aux(params, batch, **kwargs)
    np.testing.assert_array_equal(calls[-1]['decode_rng'], key)
  # Without default_decoder_params: T5X's DecoderParams(), the top decode of one.
  plain = _tiny_model(decode_fn=_recording_decoder(calls))[0]
  plain._pair._init_cache = lambda *args: None  # pylint: disable=protected-access
  assert plain.predict_batch_with_aux(params, batch)[0].shape == (2, 6)
  assert calls[-1]['num_decodes'] == 1


def test_a_calibrated_schedule_sets_gamma_by_the_traced_batch_size():
  """speculative-t5x-calibrate's t5x_schedule.gin: each predict_batch call (T5X traces one per
  batch size) decodes at its batch size's gamma; decoder_params still override it."""
  calls = []
  model, params, batch, _ = _tiny_model(decode_fn=_recording_decoder(calls),
                                        gamma_schedule={1: 4, 2: 3, 32: 0})
  model._pair._init_cache = lambda *args: None  # pylint: disable=protected-access
  model.predict_batch_with_aux(params, batch)
  assert calls[-1]['gamma'] == 3
  one = {k: v[:1] for k, v in batch.items()}
  model.predict_batch_with_aux(params, one)
  assert calls[-1]['gamma'] == 4
  model.predict_batch_with_aux(params, batch, decoder_params={'gamma': 1})
  assert calls[-1]['gamma'] == 1
  assert [model.scheduled_choice(b) for b in (8, 16, 64)] == [3, 0, 0]
  assert _tiny_model(decode_fn=_recording_decoder(calls))[0].scheduled_choice(2) is None


def test_scheduled_gamma_0_decodes_with_the_target_alone():
  model, params, batch, (target_cfg, draft_cfg) = _tiny_model(gamma_schedule={2: 0})
  alone = models.EncoderDecoderModel(target_cfg, draft_cfg, decode_fn=decoding.temperature_sample,
                                     decode_kwargs={'temperature': 0.0}, eos_id=1)
  np.testing.assert_array_equal(jax.jit(model.predict_batch)(params, batch),
                                jax.jit(alone.predict_batch)(params, batch))


def test_a_scheduled_tree_decodes_with_the_tree_and_the_target_greedy_output():
  """A schedule entry (2, 1): that batch size decodes with tree_speculative_sample at
  speculative_sample's arguments, the target's greedy output; an explicit gamma overrides it."""
  model, params, batch, (target_cfg, _) = _tiny_model(gamma_schedule={2: (2, 1), 1: 3})
  assert model.scheduled_choice(2) == (2, 1) and model.scheduled_choice(1) == 3
  decodes, aux = jax.jit(model.predict_batch_with_aux)(params, batch)
  alone = models.EncoderDecoderModel(target_cfg, decode_fn=decoding.temperature_sample,
                                     decode_kwargs={'temperature': 0.0}, eos_id=1)
  np.testing.assert_array_equal(decodes, jax.jit(alone.predict_batch)(params, batch))
  # Each call proposes the tree's 4 nodes (a chain of gamma 2 would propose 2).
  stats = {k: np.asarray(v) for k, v in aux['stats'].items()}
  np.testing.assert_array_equal(stats['proposed'], 4 * stats['target_calls'])
  _, aux = model.predict_batch_with_aux(params, batch, decoder_params={'gamma': 2})
  stats = {k: np.asarray(v) for k, v in aux['stats'].items()}
  assert (stats['proposed'] <= 2 * stats['target_calls']).all()  # (fewer near the length limit)


def test_a_tree_schedule_needs_exact_speculative_sampling():
  # (A decoder without gamma ignores a schedule, gammas and trees alike.)
  bild = _tiny_model(decode_fn=decoding.bild_decode, decode_kwargs={}, gamma_schedule={2: (2, 1)})
  assert bild[0].scheduled_choice(2) is None
  with pytest.raises(ValueError, match='lenience 1'):
    _tiny_model(decode_kwargs={'lenience': 0.5}, gamma_schedule={2: (2, 1)})
  with pytest.raises(ValueError, match='schedule entry 2'):
    _tiny_model(gamma_schedule={2: (0, 1)})


def test_compute_logits_returns_mutated_variables_when_asked():
  model, params, batch, (target_cfg, _) = _tiny_model()
  logits = model._compute_logits(params, batch)  # pylint: disable=protected-access
  assert logits.shape == (2, 6, target_cfg.vocab_size)
  out = model._compute_logits(params, batch, mutable=['intermediates'])  # pylint: disable=protected-access
  assert isinstance(out, tuple) and len(out) == 2
  np.testing.assert_allclose(out[0], logits, rtol=1e-6)


@NEEDS_T5X
def test_score_batch_return_intermediates_as_t5x():
  model, params, batch, (target_cfg, draft_cfg) = _tiny_model()
  pair = models.EncoderDecoderModel(target_cfg, draft_cfg)
  scores = model.score_batch(params, batch)
  np.testing.assert_allclose(scores, pair.score_batch(params, batch), rtol=1e-5, atol=1e-5)
  scores2, intermediates = model.score_batch(params, batch, return_intermediates=True)
  np.testing.assert_allclose(scores2, scores, rtol=1e-6)
  decoder = intermediates['decoder']
  np.testing.assert_array_equal(decoder['target_tokens'][0], batch['decoder_target_tokens'])
  np.testing.assert_array_equal(decoder['loss_weights'][0], batch['decoder_loss_weights'])
  np.testing.assert_allclose(decoder['token_scores'][0].sum(-1), scores, rtol=1e-5)


@NEEDS_T5X
def test_greedy_speculative_equals_t5x_own_greedy():
  """T5X's EncoderDecoderModel + its minimal T5 network + its temperature_sample at temperature
  0, on the same target parameters: the adapter's speculative greedy output is identical."""
  from t5x import decoding as t5x_decoding  # pylint: disable=g-import-not-at-top
  from t5x.examples.t5 import network as t5x_network  # pylint: disable=g-import-not-at-top
  target_cfg, draft_cfg = tiny_config(), tiny_config(num_decoder_layers=1)
  _, target = random_model(target_cfg, seed=0, logit_scale=4.0)
  _, draft = random_model(draft_cfg, seed=1, logit_scale=4.0)
  params = {'target': target, 'draft': draft}
  ours = ADAPTER(network.Transformer(target_cfg), network.Transformer(draft_cfg), None, None,
                 decode_kwargs={'gamma': 3, 'temperature': 0.0})
  t5x_cfg = t5x_network.T5Config(**{f.name: getattr(target_cfg, f.name)
                                    for f in dataclasses.fields(t5x_network.T5Config)})
  theirs = T5X_MODELS.EncoderDecoderModel(
      t5x_network.Transformer(t5x_cfg), None, None, None,
      decode_fn=functools.partial(t5x_decoding.temperature_sample, temperature=0.0))
  rng = np.random.RandomState(0)
  batch = {'encoder_input_tokens': rng.randint(2, 64, size=(4, 10)).astype(np.int32),
           'decoder_input_tokens': np.zeros((4, 12), np.int32)}
  batch['encoder_input_tokens'][1, 6:] = 0
  predict = lambda model, p: model.predict_batch_with_aux(p, batch, decoder_params={'eos_id': 1})[0]
  ours_out = jax.jit(functools.partial(predict, ours))(params)
  np.testing.assert_array_equal(ours_out, jax.jit(functools.partial(predict, theirs))(target))
  assert np.all(ours_out[:, 0] > 1)  # decoded something (not all EOS/padding)


# ------------------------------------------------------------------------------------------------
# Distillation in `python -m t5x.train` (DistillationEncoderDecoderModel).


def _distillation_model(draft_cfg=None, **kwargs):
  target_cfg = tiny_config(dropout_rate=0.1)
  draft_cfg = draft_cfg or tiny_config(num_decoder_layers=1, dropout_rate=0.1)
  model = DISTILLATION(network.Transformer(target_cfg), network.Transformer(draft_cfg), None,
                       None, **kwargs)
  params = _tiny_params(target_cfg, draft_cfg)
  return model, params, _tiny_model()[2]


def test_a_distillation_model_refuses_what_it_cannot_train():
  with pytest.raises(ValueError, match='kd_divergence must be one of'):
    _distillation_model(kd_divergence='kl')
  with pytest.raises(ValueError, match='vocabularies differ'):
    _distillation_model(tiny_config(num_decoder_layers=1, vocab_size=128))


def test_only_draft_parameters_pass_the_traversal_filter():
  assert t5x_adapter.is_draft_parameter('/draft/decoder/layers_0/mlp/wi_0/kernel', None)
  assert not t5x_adapter.is_draft_parameter('/target/decoder/layers_0/mlp/wi_0/kernel', None)
  assert not t5x_adapter.is_draft_parameter('/target/draft_like/kernel', None)


@NEEDS_T5X
@pytest.mark.parametrize('reads_encoder', [False, True])
def test_distillation_loss_is_the_project_objective_and_spares_the_teacher(reads_encoder):
  """T5X's loss_fn is the project trainer's objective on the draft (same loss, same dropout),
  and no gradient reaches the teacher."""
  from t5x import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  draft_cfg = tiny_config(num_decoder_layers=1, dropout_rate=0.1, **(
      {'num_encoder_layers': 0, 'encoded_width': 16} if reads_encoder else {}))
  model, params, batch = _distillation_model(draft_cfg, kd_weight=0.5, kd_divergence='jsd')
  rng = jax.random.PRNGKey(1)
  (loss, metrics), grads = jax.value_and_grad(model.loss_fn, has_aux=True)(params, batch, rng)
  objective = evaluation.Objective(draft_cfg, distillation='token', kd_weight=0.5,
                                   kd_divergence='jsd', teacher_config=model.module.config,
                                   encoder_config=model.module.config if reads_encoder else None)
  expected, sums = objective.loss(params['draft'], batch, rng, params['target'], params['target'])
  assert float(loss) == pytest.approx(float(expected), rel=1e-6)
  assert isinstance(metrics['loss'], metrics_lib.AveragePerStep)
  assert float(metrics['kd_loss'].compute()) == pytest.approx(
      float(sums['kd_loss'] / sums['tokens']), rel=1e-6)
  assert all(not np.any(g) for g in jax.tree.leaves(grads['target']))
  assert any(np.any(g) for g in jax.tree.leaves(grads['draft']))
  # Without an rng (T5X's eval_fn) there is no dropout: the same loss twice.
  assert float(model.eval_fn(params, batch)[0]) == float(model.eval_fn(params, batch)[0])


@NEEDS_T5X
def test_the_distill_file_builds_a_model_whose_optimizer_updates_the_draft_only(clean_gin):
  from t5x import optimizers  # pylint: disable=g-import-not-at-top
  pytest.importorskip('seqio', reason='the vocabulary is a seqio.SentencePieceVocabulary')
  gin.parse_config_files_and_bindings([str(T5X_CONFIGS / 'multi30k_distill.gin')], [])
  model = _gin_value('MODEL')
  assert isinstance(model, DISTILLATION)
  assert model.objective.encoder_config == model.module.config  # the embedded draft reads it
  assert model.draft_module.config.dropout_rate == 0.1
  params = _tiny_params(tiny_config(), tiny_config(num_decoder_layers=1))
  optimizer = model.optimizer_def.create(params)
  grads = jax.tree.map(np.ones_like, params)
  updated = optimizer.apply_gradient(grads, learning_rate=0.1).target
  for name, changed in (('target', False), ('draft', True)):
    differs = [np.any(a != b) for a, b in zip(jax.tree.leaves(params[name]),
                                              jax.tree.leaves(updated[name]))]
    assert all(differs) if changed else not any(differs), name
  assert isinstance(model.optimizer_def, optimizers.MultiOptimizer)
