"""The shipped gin configs parse, build what they say, and agree with T5X and with training."""

import os
import pathlib
import shlex
import subprocess

import gin
import pytest

from speculative_t5x import data
from speculative_t5x import decoding
from speculative_t5x import gin_utils
from speculative_t5x import infer  # registers the configurables
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import policy
from speculative_t5x import train  # noqa: F401  (registers train)

from conftest import tiny_config

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = REPO / 'gin_configs'

# T5X's t5x/examples/t5/{t5_1_1,mt5}/*.gin: emb_dim, num_heads, encoder/decoder layers,
# head_dim, mlp_dim.
T5X_SIZES = {
    'small': (512, 6, 8, 8, 64, 1024), 'base': (768, 12, 12, 12, 64, 2048),
    'large': (1024, 16, 24, 24, 64, 2816), 'xl': (2048, 32, 24, 24, 64, 5120),
    'xxl': (4096, 64, 24, 24, 64, 10240)}


@pytest.fixture(autouse=True)
def clean_gin():
  gin.clear_config()
  gin.add_config_file_search_path(str(REPO))  # 'gin_configs/...' includes
  yield
  gin.clear_config()


def _config(scope: str) -> network.T5Config:
  return gin.get_configurable(f'{scope}/network.T5Config')()


@pytest.mark.parametrize('family,vocab', [('t5_1_1', 32128), ('mt5', 250112)])
@pytest.mark.parametrize('size', sorted(T5X_SIZES))
def test_model_configs_have_t5x_hyperparameters(family, vocab, size):
  gin.parse_config_file(str(CONFIGS / 'models' / family / f'{size}.gin'))
  with gin.config_scope(f'{family}_{size}'):
    cfg = gin.get_configurable('network.T5Config')()
  emb, heads, enc, dec, head_dim, mlp = T5X_SIZES[size]
  assert (cfg.emb_dim, cfg.num_heads, cfg.num_encoder_layers, cfg.num_decoder_layers,
          cfg.head_dim, cfg.mlp_dim) == (emb, heads, enc, dec, head_dim, mlp)
  assert cfg.vocab_size == vocab
  assert cfg.mlp_activations == ('gelu', 'linear') and not cfg.logits_via_embedding
  assert str(cfg.dtype) == 'bfloat16'


def _scoped_config(scope):
  with gin.config_scope(scope):
    return gin.get_configurable('network.T5Config')()


def test_pair_file_matches_training_model_files():
  """gin_configs/pairs/multi30k.gin restates the models/ files of the embedded pair under
  scopes: the target, the (decoder-only) draft and the separate draft."""
  ignore = ('dropout_rate',)  # inference turns dropout off
  for scope, model_file in (('multi30k_target', 'multi30k_target'),
                            ('multi30k_draft', 'multi30k_draft_decoder_only_2layers'),
                            ('multi30k_separate_draft', 'multi30k_draft')):
    gin.clear_config()
    gin.parse_config_file(str(CONFIGS / 'models' / f'{model_file}.gin'))
    trained = gin.get_configurable('network.T5Config')()
    gin.clear_config()
    gin.parse_config_file(str(CONFIGS / 'pairs' / 'multi30k.gin'))
    paired = _scoped_config(scope)
    for field in network.T5Config.__dataclass_fields__:
      if field not in ignore:
        assert getattr(paired, field) == getattr(trained, field), (scope, field)
    assert paired.dropout_rate == 0.0


@pytest.mark.parametrize('name,fn,expect', [
    ('baseline', 'temperature_sample', {'temperature': 0.0}),
    ('speculative_greedy', 'speculative_sample', {'gamma': 'auto', 'temperature': 0.0}),
    ('speculative_sampling', 'speculative_sample', {'gamma': 'auto', 'temperature': 1.0,
                                                    'topk': 0}),
    ('speculative_adaptive', 'speculative_sample', {'adaptive_gamma': True, 'gamma': 8}),
    ('bild', 'bild_decode', {'fallback_threshold': 0.6, 'rollback_threshold': 5.0}),
    ('speculative_beam', 'speculative_beam_search', {'alpha': 0.6, 'branching': 'auto'}),
    ('beam_search', 'beam_search', {'alpha': 0.6}),
    ('speculative_tree', 'tree_speculative_sample', {'branching': (3, 1), 'temperature': 1.0}),
])
def test_decoding_configs_bind_the_decoder(name, fn, expect):
  gin.parse_config_file(str(CONFIGS / 'decoding' / f'{name}.gin'))
  assert gin.query_parameter('models.EncoderDecoderModel.decode_fn').selector == f'decoding.{fn}'
  for key, value in expect.items():
    assert gin.query_parameter(f'decoding.{fn}.{key}') == value
  beams = 4 if 'beam' in name else None  # the infer job's num_decodes: the beam size
  if beams:
    assert gin.query_parameter('infer_script.infer.num_decodes') == beams


@pytest.mark.parametrize('run,source', [
    ('infer_multi30k', ('INPUT_FILE', 'speculative_t5x/samples/captions_de.txt')),
    ('infer_multi30k_test', ('MIXTURE_OR_TASK_NAME', 'multi30k_de_en'))])
def test_infer_run_config_builds_the_multi30k_model(run, source, tmp_path, monkeypatch):
  # As the job parses them: the names on its command line, from outside the repository.
  monkeypatch.chdir(tmp_path)
  gin_utils.parse_gin_flags(
      [f'gin_configs/runs/{run}.gin', 'gin_configs/decoding/speculative_greedy.gin'],
      ["INFER_OUTPUT_DIR = '/tmp/unused'"])
  other = 'MIXTURE_OR_TASK_NAME' if source[0] == 'INPUT_FILE' else 'INPUT_FILE'
  for macro, value in (source, (other, None),
                       ('TASK_FEATURE_LENGTHS', {'inputs': 64, 'targets': 64})):
    assert gin.query_parameter(f'{macro}/macro.value') == value
  for role, path in (('target', data.EMBEDDED_TARGET), ('draft', data.EMBEDDED_DRAFT)):
    # the embedded weights, found from here as the job finds them
    value = gin.query_parameter(f'{role.upper()}_CHECKPOINT_PATH/macro.value')
    assert value == f'speculative_t5x/pretrained/{path.name}'
    assert gin_utils.resolve_path(value) == path, value
  model = gin.query_parameter('infer_script.infer.model').scoped_configurable_fn()
  assert model.target_config.num_decoder_layers == 6 and model.draft_config.num_decoder_layers == 2
  assert model.draft_config.encoded_width == model.target_config.emb_dim
  assert model.uses_draft and model.eos_id == 1
  fn = getattr(model.decode_fn, '__wrapped__', model.decode_fn)
  assert fn is decoding.speculative_sample


def test_base_infer_config_requires_its_macros():
  with pytest.raises(ValueError, match='INFER_OUTPUT_DIR.*gin.REQUIRED'):
    gin.parse_config_files_and_bindings([str(CONFIGS / 'runs' / 'infer.gin')], [])


def test_train_pair_script_chains_every_stage_inside_its_folder(tmp_path):
  """scripts/train_pair.sh: each stage's gin file parses with the script's overrides; every path
  it reads or writes is in the output folder, and each draft stage starts from the last."""
  out = tmp_path / 'pair'
  printed = subprocess.run(['bash', str(REPO / 'scripts' / 'train_pair.sh'), str(out)],
                           env={**os.environ, 'DRY_RUN': '1'}, capture_output=True, text=True,
                           check=True, cwd=REPO).stdout.splitlines()
  assert len(printed) == 11 and not out.exists()
  # After the stages, the drafts' vocabulary files (their tokens: test_pretrained).
  assert shlex.split(printed[10])[-4:] == [str(out / f'{n}.msgpack') for n in (
      'draft', 'draft_decoder_only_2layers', 'feature_draft', 'feature_draft_3layers')]
  bound = []
  for line in printed[:10]:
    words = shlex.split(line)
    gin_file = words[words.index('-m') + 2].split('=', 1)[1]
    bindings = [w[len('--gin.'):] for w in words
                if w.startswith('--gin.')]
    gin.clear_config()
    gin.add_config_file_search_path(str(REPO))
    gin.parse_config_files_and_bindings([str(REPO / gin_file)], bindings)
    bound.append({k: gin.query_parameter(f'train.{k}') for k in (
        'model_dir', 'export_path', 'teacher', 'init_from', 'distillation_cache', 'encoder')
        if f'train.{k}' in gin.config_str()})
  exports = [b['export_path'] for b in bound]
  assert exports == [str(out / n) + '.msgpack' for n in (
      'target', 'draft_undistilled', 'draft_seq_6000', 'draft', 'draft_token_mixed',
      'draft_decoder_only', 'draft_decoder_only_on_policy', 'draft_decoder_only_2layers',
      'feature_draft', 'feature_draft_3layers')]
  for i, b in enumerate(bound):
    assert all(str(v).startswith(str(out)) for v in b.values()), b
    if i >= 2:  # the distillation stages; the decoder-only drafts start from stage 4's
      assert b['teacher'] == exports[0] and b['init_from'] == exports[
          {5: 3, 6: 5, 7: 3, 9: 7}.get(i, i - 1)], b
    if i >= 5:  # (the drafts over the target's encoder)
      assert b['encoder'] == exports[0], b


def test_the_infer_job_reads_every_argument_gin_binds_to_its_decoder():
  """All of them, not a list of names: a rule bound in gin must reach the policy, which refuses
  gamma='auto' with one (a custom rule changes what the target alone would sample)."""
  gin.parse_config_file(str(CONFIGS / 'decoding' / 'speculative_sampling.gin'))
  gin.parse_config("decoding.speculative_sample.gamma = 'auto'\n"
                   'decoding.speculative_sample.rule = @decoding.temperature_sample')
  bound = infer._bound_decode_kwargs(decoding.speculative_sample, {'topk': 5})
  assert bound['gamma'] == 'auto' and bound['topk'] == 5
  assert bound['temperature'] == gin.query_parameter('decoding.speculative_sample.temperature')
  pair = models.EncoderDecoderModel(tiny_config(), tiny_config(), eos_id=1)
  with pytest.raises(ValueError, match='exact speculative sampling'):
    policy.plan(pair, bound)
