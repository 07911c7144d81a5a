"""Smoke test of the benchmark commands: each main() in-process on the tiniest setting.

Checks that every command writes its JSON and Markdown with the expected keys and that greedy
speculative decoding reproduces the target alone's outputs; never how fast anything ran. The
commands run on a small random pair over the embedded vocabulary (`small_pair`): the same code
paths as the embedded pair's, at a fraction of its compile time (most of these tests' time).
"""

import inspect
import json
import pathlib
import re
from typing import Any, Dict, Iterator, List

import jax
from jax.experimental.compilation_cache import compilation_cache
import numpy as np
import pytest

from benchmarks import drafts
from benchmarks import harness
from benchmarks import speed
from benchmarks import verifiers
from benchmarks import vs_ctranslate2
from benchmarks import vs_t5x
from benchmarks.harness import Setting
from speculative_t5x import calibrate
from speculative_t5x import costs
from speculative_t5x import data
from speculative_t5x import network
from speculative_t5x import pipeline
from speculative_t5x import policy
import conftest

TINY = ['--sentences', '1:2', '--rounds', '1']


@pytest.fixture(scope='module', autouse=True)
def shared_compilation_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
  """The commands compile the same decoders at the same shapes (target-only and gamma 1 at
  batch 1): a persistent compilation cache lets later commands load them instead. JAX decides
  once per process whether to use the cache: reset that decision here and after the module, so
  that other tests in this worker run as they would without it."""
  names = ('jax_compilation_cache_dir', 'jax_persistent_cache_min_compile_time_secs',
           'jax_persistent_cache_min_entry_size_bytes')
  before = {name: getattr(jax.config, name) for name in names}
  compilation_cache.reset_cache()
  for name, value in zip(names, (str(tmp_path_factory.mktemp('jax_cache')), 0, 0)):
    jax.config.update(name, value)
  yield
  for name, value in before.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()


@pytest.fixture(scope='module', autouse=True)
def small_pair() -> Iterator[pipeline.Pair]:
  """Every command's `harness.load_pair` gives a random 2-layer target over the embedded
  vocabulary and, as its draft, the same network with perturbed weights (a draft that agrees
  often but not always: both accepted and rejected proposals occur)."""
  config = network.T5Config(vocab_size=8000, emb_dim=32, num_heads=2, head_dim=16,
                            num_encoder_layers=2, num_decoder_layers=2, mlp_dim=64,
                            mlp_activations=('gelu', 'linear'), dropout_rate=0.0)
  target, _ = network.init_params(config, jax.random.PRNGKey(0))
  leaves, tree = jax.tree.flatten(target)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  draft = jax.tree.unflatten(tree, [x + 0.02 * jax.random.normal(k, x.shape, x.dtype)
                                    for x, k in zip(leaves, keys)])
  pair = harness.make_pair(config, config, {'target': target, 'draft': draft})
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(harness, 'load_pair', lambda *args, **kwargs: pair)
    yield pair


@pytest.fixture
def data_args() -> List[str]:
  return ['--data_dir', str(conftest.shared_files('multi30k/test_2016_flickr.de')[0].parents[1])]


def written(out_dir: pathlib.Path, name: str, heading: str) -> Dict[str, Any]:
  """The command's JSON (with its meta) after checking that its Markdown starts as expected."""
  markdown = (out_dir / f'{name}.md').read_text()
  assert markdown.startswith(f'# {heading}') and f'python -m benchmarks.{name}' in markdown
  results = json.loads((out_dir / f'{name}.json').read_text())
  assert {'command', 'machine', 'rounds', 'input_length_step'} <= set(results['meta'])
  return results


def test_speed(tmp_path: pathlib.Path, data_args: List[str]) -> None:
  speed.main(TINY + data_args + ['--out_dir', str(tmp_path), '--gammas', '1,auto',
                                 '--sampling_gammas', '', '--bild', '', '--no_adaptive'])
  results = written(tmp_path, 'speed', 'Speed')
  assert {'c_hat', 'memory_bandwidth_gbs', 'matmul_gflops'} <= set(results['meta'])
  block = results['batches']['1']
  assert {'1', '2'} <= set(block['step_ms']['target'])
  rows = {r['name']: r for r in block['rows']}
  assert set(rows) == {'target-only T=0', 'speculative gamma=1 T=0',
                       'speculative gamma=auto T=0'}
  for name in ('speculative gamma=1 T=0', 'speculative gamma=auto T=0'):
    assert rows[name]['same_as_baseline'] == 1.0
    assert {'speedup', 'speedup_min', 'alpha', 'bleu'} <= set(rows[name])
    # Greedy passes write the same tokens each round (the untimed one and 1 timed): per token,
    # the speedup is the pass's.
    tokens = rows[name]['tokens_per_pass']
    assert len(tokens) == 2 and tokens[0] == tokens[1] > 0
    assert rows[name]['speedup_per_token'] == pytest.approx(rows[name]['speedup'])
    assert rows[name]['speedup_summed'] == pytest.approx(rows[name]['speedup'])  # (one round)
  # The same outputs, counted from the decodes and from the loop's counts: the same length.
  assert (rows['speculative gamma=1 T=0']['tokens_per_sentence'] ==
          rows['target-only T=0']['tokens_per_sentence'])
  assert 'predicted_speedup' in rows['speculative gamma=1 T=0']
  # 'auto' chooses per batch as the infer job does: the fallback first (one row: the most
  # speculative gamma), then the bandit.
  auto, first = rows['speculative gamma=auto T=0'], policy.fallback_gamma(0.0, 1)
  assert str(first) in auto['gammas_used'] and set(auto['gammas_used']) <= {'0', '1', '2', '3', '4'}
  assert auto['policy']['fallback'] == first and auto['policy']['measured']
  assert '| speculative gamma=1 T=0 |' in (tmp_path / 'speed.md').read_text()


def test_calibrate_then_speed_starts_from_it(tmp_path: pathlib.Path, data_args: List[str],
                                             small_pair: pipeline.Pair,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
  """speculative-t5x-calibrate end to end (step costs, every gamma's loop, the fit, the files),
  then a benchmark whose 'auto' starts at the calibrated gamma and follows the model."""
  monkeypatch.setattr(pipeline, 'load_pair', lambda *args, **kwargs: small_pair)
  out = tmp_path / 'calibration'
  results = calibrate.main(data_args + ['--output_dir', str(out), '--batch_sizes', '2',
                                        '--sentences', '8', '--max_gamma', '2', '--rounds', '1',
                                        '--check', '--trees', '2,1'])
  block = results['batch_sizes'][2]
  # Every gamma and the tree timed, the tree priced by its lift; the schedule holds a gamma.
  assert set(block['check']) == {'0', '1', '2', '(2,1)'} and block['best'] in (0, 1, 2)
  assert set(block['costs']['lifts']) == {'(2,1)'} and '(2,1)' in block['predicted_ms_per_position']
  assert block['costs']['target_ms'].keys() >= {'1', '2', '3', '5'}  # (2,1): 5 nodes
  assert 0 < block['alpha'] <= 1 and all(r['positions'] > 0 for r in block['runs'])
  # 8 inputs at batch 2 are 4 batches: the loops run over calibrate.MIN_BATCHES (the inputs
  # repeated).
  assert {r['batches'] for r in block['runs']} == {calibrate.MIN_BATCHES}
  # Greedy loops decode the same rows whatever the choice, so the model corrected by each
  # checked loop predicts exactly what that loop measured, and the schedule takes the fastest.
  measured = {c: v['measured'] for c, v in block['check'].items()}
  assert block['corrected_ms_per_position'] == pytest.approx(measured)
  assert block['best_choice'] == min(measured, key=measured.get)
  assert {p.name for p in out.iterdir()} == {'calibration.json', 'calibration.md',
                                             't5x_schedule.gin', 'infer_schedule.gin'}
  speed.main(['--sentences', '2:4', '--rounds', '1'] + data_args + [
      '--out_dir', str(tmp_path), '--gammas', 'auto', '--calibration',
      str(out / 'calibration.json')])
  auto = {r['name']: r for r in written(tmp_path, 'speed', 'Speed')['batches']['2']['rows']}[
      'speculative gamma=auto T=0']
  assert auto['same_as_baseline'] == 1.0
  assert auto['policy']['fallback'] == block['best']
  assert '(2,1)' in auto['policy'].get('model', {}).get('predicted_ms_per_position', {'(2,1)': 0})
  # The model predicts once a speculative batch has counted acceptance.
  assert 'model' in auto['policy'] or set(auto['gammas_used']) == {'0'}


@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_a_sampled_calibration_loop_pools_a_draw_per_round(
    temperature: float, data_args: List[str], small_pair: pipeline.Pair,
    monkeypatch: pytest.MonkeyPatch) -> None:
  """`calibrate.measure`: a sampled loop draws its own samples each round and its run pools the
  timed rounds' draws, at its rounds' ms per output position paired with the other loop's
  (`policy.paired_medians`); a greedy loop is one decode at its median ms. The probes take
  turns in their own rounds. The rounds' seconds are injected (the passes still run)."""
  seconds = {0: [9.0, 1.0, 4.0, 2.0], 1: [9.0, 3.0, 1.0, 2.5]}  # a warm round, 3 timed rounds
  real, rounds = policy.round_robin, []

  def injected(passes, repeats):
    real(passes, repeats)
    rounds.append({key[0] for key in passes})
    return {key: (seconds[key[1]] if key[0] == 'loop' else [1.0] * repeats) for key in passes}

  monkeypatch.setattr(policy, 'round_robin', injected)
  texts = data.load_split('test', data_dir=data_args[1])[0][:4]
  pipe = pipeline.Pipeline(small_pair, batch_size=2, max_output_length=16)
  decodes = []
  decode = pipe.decode
  monkeypatch.setattr(pipe, 'decode', lambda *args, seed, **kwargs: decodes.append(
      (kwargs.get('gamma', 0), seed, decode(*args, seed=seed, **kwargs))) or decodes[-1][-1])
  _, runs = calibrate.measure(small_pair, pipe, texts, [0, 1], temperature, 1, rounds=3)
  assert rounds == [{'target', 'draft', 'encode'}, {'loop'}]  # the probes' rounds, the loops'
  positions = {}
  for run in runs:
    seeds = [seed for g, seed, _ in decodes if g == run.gamma]
    timed = [d for g, _, d in decodes if g == run.gamma][2:]  # after the warm pass and round
    if not temperature:  # one decode, its median ms
      assert seeds == [0] * 5 and run.batches == 2
      # Paired: the rounds' ratio 0.8 and product 4 (medians), not each one's own 2 and 2.5 s.
      assert run.ms == pytest.approx(1e3 * np.sqrt({0: 4 * 0.8, 1: 4 / 0.8}[run.gamma]))
      continue
    assert seeds == [0, 1, 2, 3, 4]  # the warm pass with the infer job's keys, then a draw each
    assert len({d.tokens.tobytes() for d in timed}) == 3
    assert run.batches == 3 * 2 and len(run.lengths) == 6
    if run.gamma:
      assert run.accepted == sum(int(d.stats['accepted'].sum()) for d in timed) > 0
    positions[run.gamma] = [sum(max(batch) for batch in run.lengths[2 * r:2 * r + 2])
                            for r in range(3)]
    assert run.positions == sum(positions[run.gamma])
  if temperature:  # each round's ms per position, relative to the other loop's in that round
    paired = policy.paired_medians(
        {g: [1e3 * s / p for s, p in zip(seconds[g][1:], positions[g])] for g in positions})
    assert {run.gamma: run.ms_per_position for run in runs} == pytest.approx(paired)


def test_calibrate_beam_search_then_the_pipeline_starts_from_it(
    tmp_path: pathlib.Path, data_args: List[str], small_pair: pipeline.Pair,
    monkeypatch: pytest.MonkeyPatch) -> None:
  """--beam_size: beam search itself and every tree of branching='auto' timed and priced; a
  Pipeline of that beam size starts speculative beam search where the model says, exactly."""
  monkeypatch.setattr(pipeline, 'load_pair', lambda *args, **kwargs: small_pair)
  out = tmp_path / 'calibration'
  results = calibrate.main(data_args + ['--output_dir', str(out), '--batch_sizes', '2',
                                        '--sentences', '4', '--rounds', '1', '--beam_size', '2'])
  block = results['batch_sizes'][2]
  names = {costs.choice_name(t) for t in policy.TREES}
  assert set(block['check']) == names == set(block['predicted_ms_per_position'])
  assert block['best'] in names and block['alpha'] == 0.0
  measured = {c: v['measured'] for c, v in block['check'].items()}
  assert block['corrected_ms_per_position'] == pytest.approx(measured)
  assert block['best'] == min(measured, key=measured.get)
  assert {p.name for p in out.iterdir()} == {'calibration.json', 'calibration.md',
                                             'infer_schedule.gin'}
  calibration = costs.load_calibration(out / 'calibration.json')
  assert calibration.beam_size == 2 and calibration.schedule == {}
  texts = data.load_split('test', data_dir=data_args[1])[0][:4]
  pipe = pipeline.Pipeline(small_pair, batch_size=2, calibration=calibration)
  auto = pipe.decode(texts, 'speculative_beam', branching='auto', num_decodes=2)
  plain = pipeline.Pipeline(small_pair, batch_size=2).decode(texts, 'beam', num_decodes=2)
  assert auto.policy['fallback'] == list(costs.parse_choice(block['best']))
  np.testing.assert_array_equal(auto.tokens, plain.tokens)
  # The beam size reaches the decoder: 2 beams are not greedy decoding's one.
  one = pipeline.Pipeline(small_pair, batch_size=2).decode(texts, 'beam', num_decodes=1)
  assert not np.array_equal(one.scores, plain.scores)


def test_pipeline_samples_each_batch_with_its_own_key(small_pair: pipeline.Pair) -> None:
  """Batches of one job draw independently (the same input gives two samples), and a job is
  reproducible from its seed."""
  pipe = pipeline.Pipeline(small_pair, batch_size=1, max_output_length=16)
  texts = ['Ein Hund läuft über die Wiese.'] * 2
  first = pipe.decode(texts, 'target', temperature=1.0, seed=3)
  assert not np.array_equal(first.tokens[0], first.tokens[1])
  np.testing.assert_array_equal(first.tokens,
                                pipe.decode(texts, 'target', temperature=1.0, seed=3).tokens)


def test_sampled_passes_draw_their_own_samples() -> None:
  # A sampled setting timed over rounds is timed over draws: pass p of batch i draws from its
  # own key; the first pass's keys are the infer job's, and past the last the keys repeat.
  keys = harness.pass_keys(3, num_batches=2, passes=2)
  assert [k.tolist() for k in keys[0]] == [
      jax.random.fold_in(jax.random.PRNGKey(3), i).tolist() for i in range(2)]
  fixed = policy.DecodingPolicy((None,))
  decoder = lambda choice, batch, key: (jax.random.randint(key, (2, 4), 1, 10**6), {})
  compiled = harness.Compiled(Setting('baseline', 1.0), decoder, fixed, [{}, {}], keys)
  for _ in range(3):
    list(compiled.pieces(1))
  firsts, seconds, thirds = ([np.asarray(d) for d, _ in p] for p in compiled.history)
  assert not np.array_equal(firsts[0], seconds[0]) and not np.array_equal(firsts[1], seconds[1])
  assert all(np.array_equal(a, b) for a, b in zip(firsts, thirds))


def test_collect_passes_pools_every_draw_and_counts_tokens_per_pass() -> None:
  def batch(decodes: List[List[int]], accepted: List[int], with_stats: bool = True) -> Any:
    stats = {'accepted': np.array(accepted), 'accepted_at': np.ones((len(accepted), 2), int)}
    return np.array(decodes), {'stats': stats} if with_stats else {}
  first = [batch([[5, 1, 0]], [2]), batch([[6, 0, 0]], [1])]
  second = [batch([[5, 6, 1]], [3]), batch([[7, 1, 0]], [0], with_stats=False)]  # target alone
  run = harness.collect_passes([first, second], num_sentences=2)
  assert run['tokens_per_pass'] == [3, 5]
  assert run['decodes'].tolist() == [[5, 1, 0], [6, 0, 0]]  # the first pass's
  assert run['stats']['accepted'].tolist() == [2, 1, 3, 0]
  assert run['stats']['accepted_at'].shape == (4, 2)


def test_speedups_per_token_count_each_rounds_own_tokens() -> None:
  # Round 1: the same time, twice the tokens (2x per token); round 2: the same tokens and a
  # quarter the time (4x); round 3: 3x. Tokens: the untimed pass's first.
  times = {'base': [1.0, 1.0, 1.0], 'x': [1.0, 0.25, 1.0]}
  tokens = {'base': [9, 10, 10, 10], 'x': [9, 20, 10, 30]}
  out = harness.speedups_per_token(times, tokens, 'base')
  summed = out['x'].pop('speedup_summed'), out['x'].pop('speedup_summed_low'), out['x'].pop(
      'speedup_summed_high')
  assert out['x'] == {'speedup_per_token': pytest.approx(3.0), 'speedup_per_token_min': 2.0,
                      'speedup_per_token_max': 4.0}
  assert out['base']['speedup_per_token'] == out['base']['speedup_summed'] == 1.0
  # Summed: 3 s over 30 tokens against 2.25 s over 60: 2.67x, not the median's 3x; resampled
  # rounds stay within the rounds' own range.
  assert summed[0] == pytest.approx((3.0 / 30) / (2.25 / 60))
  assert 2.0 <= summed[1] <= summed[0] <= summed[2] <= 4.0
  assert harness.speedups_per_token(times, tokens, 'base')['x']['speedup_summed_low'] == summed[1]


def test_auto_note_holds_auto_to_the_fastest_fixed_gamma_of_its_sampling_round_by_round(
    ) -> None:
  def row(setting: Setting, seconds: List[float], **extra: Any) -> Dict[str, Any]:
    return {'name': setting.name, **setting._asdict(), 'seconds_per_round': seconds, **extra}
  auto = row(Setting('speculative', gamma='auto'), [1.0, 2.0, 1.0], gammas_used={'2': 9},
             policy={'measured': {}})
  rows = [row(Setting('baseline'), [3.0, 3.0, 3.0]),
          row(Setting('speculative', gamma=1), [1.1, 1.2, 1.3]),  # fastest summed (3.6 s)
          row(Setting('speculative', gamma=2), [0.9, 1.9, 0.9]),  # fastest per round, not summed
          row(Setting('speculative', gamma=4, adaptive=True), [0.1, 0.1, 0.1]),  # not a fixed one
          row(Setting('speculative', 1.0, gamma=1), [0.1, 0.1, 0.1]),  # other sampling
          auto]
  note = harness.auto_note(auto, rows)
  # gamma 1 over auto, round by round: 1.1, 0.6, 1.3 -> median 1.1; summed 3.6 / 4.0.
  assert 'Against speculative gamma=1 T=0: 1.100 by the paired median, 0.900 summed.' in note
  assert 'Against target-only T=0: 3.000 by the paired median, 2.250 summed.' in note
  assert 'T=1' not in note and 'adaptive' not in note


def test_drafts_acceptance(tmp_path: pathlib.Path, data_args: List[str]) -> None:
  drafts.main(data_args + ['--out_dir', str(tmp_path), '--gammas', '1,2', '--temperatures', '0',
                           '--sweep_temperature', '0', '--longest', '2', '--max_sentences', '4',
                           '--batch_size', '4', '--bleu_sentences', '4'])
  results = written(tmp_path, 'drafts', 'Draft models compared')
  assert {'path', 'params', 'c_hat', 'bleu_alone'} <= set(results['drafts']['shipped'])
  rows = results['acceptance']['shipped']
  # The gamma sweep on the test split at the sweep temperature, the largest gamma elsewhere.
  assert [(r['split'], r['gamma']) for r in rows] == [
      ('test', 1), ('test', 2), ('validation', 2), ('test, 2 longest inputs', 2)]
  assert all(0.0 < r['alpha'] <= 1.0 and r['sentences'] > 0 for r in rows)
  assert not results['batches']
  assert '| shipped | test (4) | 0 |' in (tmp_path / 'drafts.md').read_text()


def test_drafts_speed(tmp_path: pathlib.Path, data_args: List[str]) -> None:
  drafts.main(TINY + data_args + ['--out_dir', str(tmp_path), '--gammas', '1',
                                  '--sampling_gammas', '', '--temperatures', '',
                                  '--bleu_sentences', '4'])
  results = written(tmp_path, 'drafts', 'Draft models compared')
  assert not results['acceptance']
  rows = {r['name']: r for r in results['batches']['1']['rows']}
  assert {r['draft'] for r in rows.values()} == {'shipped'}
  assert rows['speculative gamma=1 T=0']['same_as_baseline'] == 1.0
  assert {'alpha', 'c', 'speedup'} <= set(rows['speculative gamma=1 T=0'])


def test_vs_t5x(tmp_path: pathlib.Path, data_args: List[str]) -> None:
  try:
    import t5x  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    with pytest.raises(SystemExit) as exit_info:
      vs_t5x.main(TINY + data_args + ['--out_dir', str(tmp_path)])
    message = str(exit_info.value)
    assert 't5x_private_install.md' in message and '\n' not in message
    assert not list(tmp_path.iterdir())
    return
  vs_t5x.main(TINY + data_args + ['--out_dir', str(tmp_path), '--gammas', '1'])
  rows = {r['name']: r for r in written(tmp_path, 'vs_t5x', 'This')['batches']['1']['rows']}
  assert rows['target-only T=0']['same_as_t5x'] == rows['speculative gamma=1 T=0']['same_as_t5x']


def test_verifiers(tmp_path: pathlib.Path, data_args: List[str]) -> None:
  # One sampling setting and no speed part (its timing is benchmarks.speed's batch_block,
  # test_speed's): each setting is a compile of the real pair's loop.
  verifiers.main(data_args + ['--out_dir', str(tmp_path), '--count_sentences', '4',
                              '--count_batch', '4', '--gammas', '1', '--trees', '2',
                              '--sampling', '1:0', '--speed_gammas', '', '--speed_trees', ''])
  results = written(tmp_path, 'verifiers', 'Verifiers')
  names = [r['name'] for r in results['acceptance']]
  assert names == ['speculative gamma=1 token T=1', 'speculative gamma=1 block T=1',
                   'tree (2) T=1']
  assert all(r['tokens_per_call'] >= 1.0 for r in results['acceptance'])
  assert not results['batches']
  assert '| T=1 | (2) | 1 | 3 |' in (tmp_path / 'verifiers.md').read_text()


def test_speed_parts_set_every_flag_batch_block_reads() -> None:
  # verifiers and drafts hand their own flags to benchmarks.speed.batch_block: a flag added
  # there and not in theirs fails only after their counting part has run for hours.
  read = set(re.findall(r'\bargs\.(\w+)', inspect.getsource(speed.batch_block)))
  for args in (verifiers.parse_args(['--sentences', '1:2']),
               drafts.parse_args(['--sentences', '1:2'])):
    assert read and not [name for name in sorted(read) if not hasattr(args, name)]


def test_vs_ctranslate2(tmp_path: pathlib.Path, data_args: List[str],
                        monkeypatch: pytest.MonkeyPatch) -> None:
  with monkeypatch.context() as patch:  # a missing dependency: one line, before any work
    patch.setattr(vs_ctranslate2, 'NEEDS', (('ctranslate2', 'CTranslate2'),
                                            ('no_such_module', 'a converter')))
    with pytest.raises(SystemExit) as exit_info:
      vs_ctranslate2.main(data_args + ['--out_dir', str(tmp_path)])
    assert str(exit_info.value) == ("error: no_such_module not installed (a converter): "
                                    "pip install -e '.[bench]' (or pip install "
                                    "'speculative_t5x[bench]')")
    assert not list(tmp_path.iterdir())
  # gamma 1 at batch 1 on 2 sentences: test_speed's programs, from the compilation cache.
  # Batch 2 only (rows of different lengths: the engines pad differently); each batch size is
  # three more compiles of the real pair's loops.
  vs_ctranslate2.main(data_args + ['--out_dir', str(tmp_path), '--sentences', '2:4',
                                   '--gammas', '1', '--rounds', '1'])
  results = written(tmp_path, 'vs_ctranslate2', "This project's decoders against CTranslate2")
  assert {'ctranslate2', 'crossover_rows', 'memory_bandwidth_gbs'} <= set(results['meta'])
  theirs = [f'CTranslate2 {search} {compute}' for search in ('greedy', 'beam=4')
            for compute in ('float32', 'int8')]
  for batch_size in ('2',):
    block = results['batches'][batch_size]
    rows = {r['name']: r for r in block['rows']}
    assert set(rows) == {'target-only T=0', 'speculative gamma=1 T=0', 'beam_search beam=4',
                         *theirs}
    assert set(block['identity']) == set(theirs)
    # The same float32 weights, input ids and greedy search: the same output ids.
    assert block['identity']['CTranslate2 greedy float32'] == 1.0
    assert rows['speculative gamma=1 T=0']['same_ids'] == 1.0
    assert all(r['ms_per_sentence'] > 0 and r['regime'] in ('bandwidth-bound', 'arithmetic-bound')
               for r in rows.values())
    assert rows['beam_search beam=4']['rows_per_call'] == 4 * int(batch_size)
  assert '| CTranslate2 greedy int8 |' in (tmp_path / 'vs_ctranslate2.md').read_text()
