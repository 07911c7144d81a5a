"""The cost model of gamma (`costs`), the schedule it writes and where a schedule is read.

Costs and acceptance are injected: what is checked is the model's arithmetic and choices, never
how fast anything ran.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

from speculative_t5x import beam_search
from speculative_t5x import calibrate
from speculative_t5x import costs
from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import policy
from conftest import tiny_config

# Shaped like the embedded pair at batch 1 on this CPU (an earlier run): a 1-token target step
# 1.24 ms, the verify step growing slowly with its tokens, a draft step a tenth of it.
TARGET_MS = {1: 1.24, 2: 1.67, 3: 1.91, 4: 2.00, 5: 1.96}
DRAFT_MS = {1: 0.12, 2: 0.14}


def model(**overrides) -> costs.StepCosts:
  values = dict(batch_size=1, target_ms=TARGET_MS, draft_ms=DRAFT_MS, batch_ms=2.0,
                plain_overhead_ms=0.1, overhead_ms=0.3, overhead_per_token_ms=0.05)
  values.update(overrides)
  return costs.StepCosts(**values)


def test_expected_tokens_is_the_papers_formula():
  assert costs.expected_tokens(0.0, 4) == 1.0
  assert costs.expected_tokens(1.0, 3) == 4.0
  assert costs.expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


@pytest.mark.parametrize('alpha,gamma', [(0.3, 1), (0.55, 3), (0.87, 4), (0.99, 2)])
def test_effective_alpha_inverts_expected_tokens(alpha, gamma):
  assert costs.effective_alpha(costs.expected_tokens(alpha, gamma), gamma) == pytest.approx(
      alpha, abs=1e-6)
  assert costs.effective_alpha(0.5, gamma) == pytest.approx(0.0, abs=1e-6)  # clipped
  assert costs.effective_alpha(gamma + 3.0, gamma) == pytest.approx(1.0, abs=1e-6)


def test_iteration_cost_is_the_steps_and_overheads():
  m = model()
  assert m.iteration_ms(0) == pytest.approx(1.24 + 0.1)
  # A draft phase's first call feeds 2 tokens, then gamma - 1 one-token calls, then the verify.
  assert m.iteration_ms(3) == pytest.approx(0.14 + 2 * 0.12 + 2.00 + 0.3 + 3 * 0.05)
  assert m.ms_per_position(3, 0.8) == pytest.approx(m.iteration_ms(3) /
                                                    costs.expected_tokens(0.8, 3))
  assert m.ms_per_position(0, 0.8, positions=10) == pytest.approx(m.iteration_ms(0) + 0.2)
  with pytest.raises(ValueError, match='6-token target step'):
    m.steps_ms(5)


def test_picks_the_target_alone_when_verify_calls_are_expensive():
  cheap = model()
  assert cheap.best(0.87) > 0
  expensive = model(target_ms={k: 1.24 * k for k in TARGET_MS})  # arithmetic-bound verifies
  assert expensive.best(0.87) == 0
  assert model(overhead_ms=5.0).best(0.87) == 0  # a loop whose bookkeeping costs more


def test_picks_a_larger_gamma_when_alpha_rises():
  m = model()
  picks = [m.best(alpha) for alpha in (0.2, 0.55, 0.75, 0.87, 0.97)]
  assert picks == sorted(picks) and picks[0] < picks[-1], picks
  assert picks[0] == 0 and picks[-1] == m.max_gamma


# Two batches' rows' output positions (a padding row: 0).
LENGTHS = ((20, 15, 9, 12), (7, 30, 11, 0))


def synthetic_runs(truth: costs.StepCosts, alpha: float, gammas, repeats: int = 3,
                   spread: float = 1.0):
  """LoopRuns exactly as `truth` would time them at acceptance `alpha`: `repeats` times the
  batches of LENGTHS, their loop iterations as `costs.batch_iterations` predicts (times
  `spread`), their draft tokens accepted at alpha."""
  lengths = LENGTHS * repeats
  positions = sum(max(batch) for batch in lengths)
  runs = []
  for g in gammas:
    iterations = positions if g == 0 else int(round(
        spread * np.sum(costs.batch_iterations(lengths, alpha, g))))
    ms = len(lengths) * truth.batch_ms + iterations * truth.iteration_ms(g)
    events = 1000 if g else 0
    runs.append(costs.LoopRun(g, batches=len(lengths), ms=ms, iterations=iterations,
                              positions=positions, accepted=round(alpha * events),
                              rejected=round((1 - alpha) * events), lengths=lengths))
  return runs


def test_fit_recovers_the_overheads_and_predicts_the_other_gammas():
  truth = model()
  # batch_ms is measured (the encoders, in isolation); the loops' overheads are fitted.
  fitted = costs.fit(model(plain_overhead_ms=0.0, overhead_ms=0.0, overhead_per_token_ms=0.0),
                     synthetic_runs(truth, 0.8, (0, 1, 4)))
  for name in ('plain_overhead_ms', 'overhead_ms', 'overhead_per_token_ms'):
    assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.05), name
  runs = synthetic_runs(truth, 0.8, range(5))
  alpha = costs.pooled_alpha(runs)
  assert alpha == pytest.approx(0.8, abs=0.01)
  errors = {g: c['error'] for g, c in costs.check(fitted, runs, alpha).items()}
  assert max(abs(e) for e in errors.values()) < 0.02, errors
  with pytest.raises(ValueError, match='gamma 0'):
    costs.fit(truth, synthetic_runs(truth, 0.8, (1, 2)))


def test_a_fit_term_held_at_zero_leaves_the_other_refitted():
  # Unconstrained: 1.3 fixed and -0.1 per draft token. Held at 0, the fixed term is refitted
  # alone (the mean), not left at 1.3.
  a, b = np.array([[1.0, 1.0], [1.0, 4.0]]), np.array([1.2, 0.9])
  np.testing.assert_allclose(costs.nonnegative_lstsq(a, b), [1.05, 0.0])
  np.testing.assert_allclose(costs.nonnegative_lstsq(a, np.array([1.5, 2.7])), [1.1, 0.4])
  np.testing.assert_allclose(costs.nonnegative_lstsq(a, -b), [0.0, 0.0])
  # Loops whose overhead falls with gamma (their longer verify steps probed dear): the fit's own
  # loops are priced on both sides of what they measured, not both dearer.
  truth = model(overhead_per_token_ms=-0.05)
  runs = synthetic_runs(truth, 0.8, (0, 1, 4))
  fitted = costs.fit(model(plain_overhead_ms=0.0, overhead_ms=0.0, overhead_per_token_ms=0.0),
                     runs)
  assert fitted.overhead_per_token_ms == 0.0 and fitted.overhead_ms > 0
  errors = [c['error'] for g, c in costs.check(fitted, runs, 0.8).items() if g]
  assert min(errors) < 0 < max(errors), errors


def test_a_batch_runs_until_its_slowest_row_is_done():
  # One row: the expected iterations to emit its positions, each emitting 1 + a run of
  # acceptances; at acceptance 0 one position each, at 1 gamma + 1 (the last one cut short).
  assert costs.batch_iterations([[12]], 0.0, 3)[0] == pytest.approx(12)
  assert costs.batch_iterations([[12]], 1.0, 3)[0] == pytest.approx(3)
  one = costs.batch_iterations([[40]], 0.8, 4)[0]
  assert one == pytest.approx(40 / costs.expected_tokens(0.8, 4), rel=0.1)
  # A batch takes its slowest row's iterations, more than its longest row alone would.
  batch = costs.batch_iterations([[40, 38, 35, 30]], 0.8, 4)[0]
  assert one < batch < costs.batch_iterations([[40]], 0.75, 4)[0]
  # The per-batch model prices a batch by its rows: fewer tokens per iteration than the
  # paper's formula (the last iteration is cut short, and the rows race).
  m = model()
  assert m.tokens(4, 0.8, LENGTHS) < m.tokens(4, 0.8) and m.tokens(0, 0.8, LENGTHS) == 1.0
  # The spread: measured loop iterations over the model's, fitted from the runs' counts.
  runs = synthetic_runs(m, 0.8, (0, 1, 4), spread=1.1)
  spread = costs.fit_spread(m, runs, 0.8)
  assert spread == pytest.approx(1.1, rel=0.02)
  fitted = dataclasses.replace(costs.fit(m, runs), spread=spread)
  errors = [c['error'] for c in costs.check(fitted, synthetic_runs(m, 0.8, range(5), spread=1.1),
                                            0.8).values()]
  assert max(abs(e) for e in errors) < 0.02, errors


def test_step_costs_round_trip_through_json():
  for m in (model(), model(lifts={(3, 1): 0.05, (2, 1, 1, 1): 0.02},
                           corrections={3: 1.1, (3, 1): 0.9})):
    assert costs.StepCosts.from_json(json.loads(json.dumps(m.to_json()))) == m
  assert [costs.parse_choice(costs.choice_name(c)) for c in (0, 3, (2, 1, 1))] == [0, 3, (2, 1, 1)]


def test_a_timed_loop_corrects_its_choices_predictions_and_the_pick():
  """A calibration that timed gamma 3's and 4's loops: the model's near-tie between them is
  settled by what the loops measured, at the calibration's acceptance and at another one."""
  truth = model()
  lengths = ((12,),) * 8
  runs = [costs.LoopRun(g, batches=8, ms=ms * 96, iterations=1, positions=96, lengths=lengths)
          for g, ms in ((3, 0.97 * truth.ms_per_position(3, 0.8, lengths=lengths)),
                        (4, 1.08 * truth.ms_per_position(4, 0.8, lengths=lengths)))]
  checked = costs.check(truth, runs, 0.8)
  assert checked[4]['error'] == pytest.approx(1 / 1.08 - 1)  # the model's, before correction
  fixed = costs.corrected(truth, checked)
  assert fixed.corrections == pytest.approx({3: 0.97, 4: 1.08})
  for alpha in (0.8, 0.6):
    for g, factor in ((0, 1.0), (2, 1.0), (3, 0.97), (4, 1.08)):
      assert fixed.ms_per_position(g, alpha, lengths=lengths) == pytest.approx(
          factor * truth.ms_per_position(g, alpha, lengths=lengths))
  assert truth.best(0.8, (3, 4), lengths) == 4 and fixed.best(0.8, (3, 4), lengths) == 3
  assert costs.StepCosts.from_json(json.loads(json.dumps(fixed.to_json()))) == fixed


# A bandwidth-bound machine (an accelerator at batch 1): a verify call costs about a step for
# any tokens per row up to a tree's nodes; the draft a tenth of it.
FLAT_TARGET_MS = {k: 1.0 + 0.01 * k for k in range(1, 10)}
FLAT_DRAFT_MS = {k: 0.1 for k in (1, 2, 3)}


def test_a_tree_is_priced_by_its_call_shape_and_its_acceptance_lift():
  # A chain is the tree (1,) * gamma: the shapes give the chain's formula.
  assert [costs.call_shape(g) for g in (0, 1, 3)] == [((), 1), ((2,), 2), ((2, 1, 1), 4)]
  assert costs.call_shape((1, 1, 1)) == costs.call_shape(3)
  # Level d of a tree is one draft call over its nodes; the target scores all of them.
  assert costs.call_shape((2, 1, 1, 1)) == ((2, 2, 2, 2), 9)
  assert costs.call_shape((3, 1)) == ((2, 3), 7)
  m = model(target_ms=FLAT_TARGET_MS, draft_ms=FLAT_DRAFT_MS, lifts={(3, 1): 0.1})
  assert m.max_gamma == 8 and m.prices((3, 1)) and not m.prices((2, 1, 1, 1))  # no lift
  assert not model().prices((3, 1)) and model().max_gamma == 4
  # The overhead per draft token is paid for each of its 3 + 3 proposed nodes.
  assert [costs.proposed(c) for c in (0, 3, (3, 1), (2, 1, 1, 1))] == [0, 3, 6, 8]
  assert m.iteration_ms((3, 1)) == pytest.approx(0.1 + 0.1 + 1.07 + 0.3 + 6 * 0.05)
  assert m.tokens((3, 1), 0.7) == pytest.approx(costs.expected_tokens(0.8, 2))
  assert m.tokens(2, 0.7) == pytest.approx(costs.expected_tokens(0.7, 2))
  # The lift is what a tree's run counted above the chains' acceptance, and counting a tree's
  # batch gives the chains' acceptance back.
  runs = [costs.LoopRun((3, 1), 1, 10.0, 100, 200, accepted=80, rejected=20)]
  assert costs.tree_lifts(runs, 0.7)[(3, 1)] == pytest.approx(0.1)
  assert costs.chain_alpha((3, 1), 80, 20, m.lifts) == pytest.approx(0.7)
  # A run without counted acceptance (beam search): its effective one, from tokens per call.
  beams = [costs.LoopRun((3, 1), 1, 10.0, 100, round(100 * costs.expected_tokens(0.8, 2)))]
  assert costs.tree_lifts(beams, 0.7)[(3, 1)] == pytest.approx(0.1, abs=0.01)


def test_a_feature_draft_s_first_call_rewrites_the_chain():
  """Its first draft call feeds gamma + 1 tokens: priced, and measured, at that shape."""
  assert costs.call_shape(3, feature_draft=True) == ((4, 1, 1), 4)
  draft_ms = {1: 0.1, 2: 0.12, 3: 0.14, 4: 0.16, 5: 0.18}
  m = model(target_ms=FLAT_TARGET_MS, draft_ms=draft_ms, feature_draft=True)
  assert m.steps_ms(3) == pytest.approx(0.16 + 0.1 + 0.1 + FLAT_TARGET_MS[4])
  assert m.prices(4) and not model(target_ms=FLAT_TARGET_MS, draft_ms=FLAT_DRAFT_MS,
                                   feature_draft=True).prices(4)  # (no 5-token draft step)
  assert costs.StepCosts.from_json(m.to_json()) == m


def tree_job(machine: costs.StepCosts, alpha: float, batches: int):
  kwargs = {'gamma': 'auto', 'temperature': 1.0}
  pair = models.EncoderDecoderModel(tiny_config(), tiny_config(), eos_id=1, decode_kwargs=kwargs)
  calibration = costs.Calibration({1: 3}, {1: machine}, temperature=1.0, alphas={1: alpha})
  decoding_policy, decoders = policy.plan(pair, kwargs, calibration=calibration, batch_size=1)
  return decoding_policy, decoders, run_job(decoding_policy, [alpha] * batches, positions=60)


def test_the_policy_runs_a_tree_only_where_the_model_predicts_it_fastest():
  flat = model(target_ms=FLAT_TARGET_MS, draft_ms=FLAT_DRAFT_MS, overhead_per_token_ms=0.01,
               lifts={(3, 1): 0.02, (2, 1, 1, 1): 0.06})
  assert flat.best(0.8) == (2, 1, 1, 1)  # more kept per call at the same cost
  decoding_policy, decoders, chosen = tree_job(flat, 0.8, 40)
  assert set(decoders) == {0, 1, 2, 3, 4, (3, 1), (2, 1, 1, 1)}
  assert decoders[(2, 1, 1, 1)].decode_kwargs['branching'] == (2, 1, 1, 1)
  assert chosen[:2] == [3, (2, 1, 1, 1)] and decoding_policy.best() == (2, 1, 1, 1), chosen
  assert decoding_policy.alpha() == pytest.approx(0.8, abs=0.02)  # the tree's counts, lift off
  assert decoding_policy.summary()['model']['predicted_best'] == [2, 1, 1, 1]
  # Where a verify call grows with its rows (this CPU), the same lifts do not pay for a tree's
  # rows: the model prices it slower and no batch runs it.
  steep = dataclasses.replace(flat, target_ms={k: 1.0 * k for k in range(1, 10)})
  assert not isinstance(steep.best(0.8), tuple)
  _, _, chosen = tree_job(steep, 0.8, 192)
  assert not any(isinstance(c, tuple) for c in chosen), chosen


def test_schedule_lookup_and_parsing():
  schedule = costs.parse_schedule({'1': 4, 8: '2', 32: 0})
  assert schedule == {1: 4, 8: 2, 32: 0}
  assert [costs.scheduled(schedule, b) for b in (1, 2, 3, 8, 16, 20, 64)] == [4, 4, 2, 2, 2, 0, 0]
  assert costs.scheduled({}, 8) is None
  with pytest.raises(ValueError, match="entry 'x'"):
    costs.parse_schedule({'x': 1})
  with pytest.raises(ValueError, match='batch size must be >= 1'):
    costs.parse_schedule({0: 1})
  # Token trees: as gin writes them (tuples), JSON (lists) or their names.
  trees = costs.parse_schedule({1: (2, 1), 8: [3, 1], 32: '(2,1,1,1)'})
  assert trees == {1: (2, 1), 8: (3, 1), 32: (2, 1, 1, 1)} and costs.scheduled(trees, 16) == (3, 1)
  for bad in ((0, 1), [], -1):
    with pytest.raises(ValueError, match='schedule entry 1'):
      costs.parse_schedule({1: bad})


def test_plan_starts_auto_at_the_scheduled_gamma():
  pair = models.EncoderDecoderModel(tiny_config(), tiny_config(), eos_id=1,
                                    decode_kwargs={'gamma': 'auto', 'temperature': 0.0})
  kwargs = {'gamma': 'auto', 'temperature': 0.0}
  calibration = costs.Calibration({1: 4, 8: 9, 32: 0}, {})
  assert policy.plan(pair, kwargs)[0].fallback == policy.FALLBACK_GAMMA
  starts = [policy.plan(pair, kwargs, calibration=calibration, batch_size=b)[0].fallback
            for b in (1, 2, 8, 32, 64)]
  assert starts == [4, 4, policy.MAX_GAMMA, 0, 0]
  # A scheduled tree starts the job where the batch size's model prices it, else the fallback.
  priced = dataclasses.replace(model(), lifts={(2, 1): 0.05})
  trees = costs.Calibration({1: (2, 1), 8: (2, 1)}, {1: priced, 8: model()})
  starts = [policy.plan(pair, kwargs, calibration=trees, batch_size=b)[0].fallback for b in (1, 8)]
  assert starts == [(2, 1), policy.FALLBACK_GAMMA]


def test_speculative_sample_at_gamma_0_is_the_target_alone():
  from conftest import random_model, start_decoding, ragged_tokens  # pylint: disable=g-import-not-at-top
  module, params = random_model(tiny_config(), seed=3)
  inputs = ragged_tokens(jax.random.PRNGKey(0), 3, 8, 64)
  cache, fn = start_decoding(module, params, inputs, 10)
  prompt = np.zeros((3, 10), np.int32)
  ours = decoding.speculative_sample(prompt, cache, fn, cache, fn, eos_id=1, gamma=0,
                                     temperature=0.0)
  alone = decoding.temperature_sample(prompt, cache, fn, eos_id=1, temperature=0.0, topk=0)
  np.testing.assert_array_equal(ours[0], alone[0])
  with pytest.raises(ValueError, match='gamma must be >= 0'):
    decoding.speculative_sample(prompt, cache, fn, cache, fn, eos_id=1, gamma=-1)


def test_calibrate_writes_a_schedule_for_t5x_and_for_the_infer_job(tmp_path):
  block = {'alpha': 0.8, 'costs': model().to_json(), 'predicted_ms_per_position': {0: 1.5, 1: 1.2},
           'check': {0: {'measured': 1.5, 'error': 0.0}}}
  results = {'command': 'speculative-t5x-calibrate --output_dir x', 'batch_sizes': {
      1: {**block, 'best': 4}, 8: {**block, 'best': 2}, 32: {**block, 'best': 0}}}
  paths = calibrate.write(tmp_path, results, results['command'])
  assert [p.name for p in paths] == ['calibration.json', 'calibration.md', 't5x_schedule.gin',
                                     'infer_schedule.gin']
  assert json.loads(paths[0].read_text())['schedule'] == {'1': 4, '8': 2, '32': 0}
  t5x = paths[2].read_text()
  assert 'from speculative_t5x import t5x_adapter' in t5x
  assert ('t5x_adapter.SpeculativeEncoderDecoderModel.gamma_schedule = {1: 4, 8: 2, 32: 0}'
          in t5x)
  assert (f"infer_script.infer.calibration = '{paths[0].resolve()}'" in
          paths[3].read_text())


def test_calibration_json_keeps_its_values_and_puts_each_list_of_numbers_on_a_line():
  values = {'runs': [{'gamma': '(2,1)', 'lengths': [[12, 0], [7, 30]], 'ms': 1.5e-3}],
            'schedule': {'1': [2, 1]}, 'names': ['a', 'b'], 'command': 'x --lengths [1,2]'}
  text = calibrate.dumps(values)
  assert json.loads(text) == values
  assert '"lengths": [[12, 0], [7, 30]]' in text and '"1": [2, 1]' in text
  assert '"names": [\n' in text and '"x --lengths [1,2]"' in text  # (strings as they were)


def test_a_sampled_calibration_times_more_rounds_by_default(tmp_path):
  rounds = lambda *argv: calibrate.parse_args(['--output_dir', str(tmp_path), *argv]).rounds
  assert rounds() == rounds('--temperature', '1', '--beam_size', '4') == calibrate.LOOP_ROUNDS
  assert rounds('--temperature', '1') == calibrate.SAMPLED_LOOP_ROUNDS > calibrate.LOOP_ROUNDS
  assert rounds('--temperature', '1', '--rounds', '3') == 3


@pytest.mark.parametrize('argv,message', [
    (['--batch_sizes', '1,x'], '--batch_sizes wants integers'),
    (['--batch_sizes', '0'], '--batch_sizes must be >= 1'),
    (['--fit_gammas', '1,2'], '--fit_gammas needs 0'),
    (['--fit_gammas', '0,9'], '--fit_gammas needs 0'),
    (['--trees', '3,x'], '--trees wants branchings'),
    (['--trees', '2,0;3'], '--trees wants branchings'),
])
def test_calibrate_bad_flags_are_one_line(tmp_path, capsys, argv, message):
  with pytest.raises(SystemExit) as exit_info:
    calibrate.parse_args(['--output_dir', str(tmp_path)] + argv)
  assert message in str(exit_info.value) + capsys.readouterr().err


def run_job(decoding_policy, alphas, positions=12, machine=None):
  """Drives a policy over one-row batches of `positions` output positions whose acceptance is
  alphas[i] for batch i (a tree's: with its lift), each batch's counts and time as `machine`
  (default: the policy's model) has them; returns the choices, in order."""
  chosen = []
  for alpha in alphas:
    choice = decoding_policy.choose()
    truth = machine or decoding_policy.model
    if decoding_policy.setting == 'gamma':  # timed by its rows (beam search: by its steps)
      ms = truth.ms_per_position(choice, alpha, lengths=[[positions]]) * positions
    else:
      ms = truth.ms_per_position(choice, alpha, positions) * positions
    decodes = np.zeros((1, max(32, positions)), np.int32)
    decodes[0, :positions] = 5
    accepted = truth.acceptance(choice, alpha)
    stats = None if choice in (0, ()) else {'accepted': np.array([round(100 * accepted)]),
                                            'rollbacks': np.array([round(100 - 100 * accepted)])}
    decoding_policy.observe(choice, ms / 1e3, decodes, stats)
    chosen.append(choice)
  return chosen


def test_the_policy_follows_the_models_pick_and_a_change_of_alpha():
  kwargs = {'gamma': 'auto', 'temperature': 0.0}
  pair = models.EncoderDecoderModel(tiny_config(), tiny_config(), eos_id=1, decode_kwargs=kwargs)
  calibration = costs.Calibration({1: 2}, {1: model()})
  decoding_policy, _ = policy.plan(pair, kwargs, calibration=calibration, batch_size=1)
  assert decoding_policy.fallback == 2 and decoding_policy.model == model()
  # A draft that agrees often: the model's pick is the largest gamma, tried right after the
  # first batch counted it (the timing search alone walks there one neighbour at a time).
  chosen = run_job(decoding_policy, [0.95] * 12)
  assert chosen[:2] == [2, model().best(0.95)] == [2, 4], chosen
  assert decoding_policy.best() == 4, chosen
  # Acceptance drops mid-job: once the window's counts say so, the model's new pick runs, and
  # the timing confirms it.
  chosen = run_job(decoding_policy, [0.2] * 40)
  assert model().best(0.2) == 0 and 0 in chosen and decoding_policy.best() == 0, chosen
  assert decoding_policy.summary()['model']['predicted_best'] == 0


def test_a_model_without_counts_leaves_the_timing_search_alone():
  kwargs = {'gamma': 'auto', 'temperature': 1.0}
  pair = models.EncoderDecoderModel(tiny_config(), tiny_config(), eos_id=1, decode_kwargs=kwargs)
  decoding_policy, _ = policy.plan(pair, kwargs, calibration=costs.Calibration({}, {}),
                                   batch_size=8)
  assert decoding_policy.fallback == policy.fallback_gamma(1.0, 8)
  assert decoding_policy.model is None
  assert decoding_policy.predicted() is None and 'model' not in decoding_policy.summary()


def test_a_calibration_serves_only_jobs_at_its_temperature():
  calibrated = {0.0: costs.Calibration({1: 4}, {1: model()}),
                1.0: costs.Calibration({1: 1}, {1: model()}, temperature=1.0)}
  one_row = policy.fallback_gamma(1.0, 1)  # the uncalibrated start
  for job, made_at, fallback, follows in ((0.0, 0.0, 4, True), (1.0, 0.0, one_row, False),
                                          (1.0, 1.0, 1, True), (0.0, 1.0, one_row, False)):
    kwargs = {'gamma': 'auto', 'temperature': job}
    pair = models.EncoderDecoderModel(tiny_config(), tiny_config(), eos_id=1,
                                      decode_kwargs=kwargs)
    decoding_policy, _ = policy.plan(pair, kwargs, calibration=calibrated[made_at], batch_size=1)
    assert decoding_policy.fallback == fallback, (job, made_at)
    assert (decoding_policy.model is not None) == follows, (job, made_at)
  assert calibrated[1.0].fits(np.array([1.0, 1.0])) and not calibrated[1.0].fits([1.0, 0.7])


def test_a_checked_model_is_followed_without_timing_what_it_prices_much_slower():
  kwargs = {'gamma': 'auto', 'temperature': 0.0}
  pair = models.EncoderDecoderModel(tiny_config(), tiny_config(), eos_id=1, decode_kwargs=kwargs)
  at = lambda g: model().ms_per_position(g, 0.95, lengths=[[12]])
  assert np.log(at(0) / at(4)) > 0.05  # the target alone: predicted slower beyond its error
  checked = costs.Calibration({1: 4}, {1: model()}, errors={1: 0.05})
  guided, _ = policy.plan(pair, kwargs, calibration=checked, batch_size=1)
  chosen = run_job(guided, [0.95] * 192)
  assert set(chosen) == {4} and guided.best() == 4, chosen
  # Without the model the same job spends batches on the target alone (always tried); an
  # unchecked model has it timed beside its pick (`DecodingPolicy._guards`).
  blind = policy.DecodingPolicy(range(5), 'gamma', 4)
  assert 0 in run_job(blind, [0.95] * 64, machine=model())
  unchecked, _ = policy.plan(pair, kwargs, calibration=costs.Calibration({1: 4}, {1: model()}),
                             batch_size=1)
  chosen = run_job(unchecked, [0.95] * 192)
  assert 0 in chosen and unchecked.best() == 4 and not unchecked.dropped, chosen


def test_the_calibrations_acceptance_guides_a_job_that_starts_without_speculation():
  """Calibrated at an acceptance where the target alone is fastest: the job starts there and
  does not spend early batches on gammas the model predicts much slower (it has no counts of
  its own until one runs)."""
  kwargs = {'gamma': 'auto', 'temperature': 1.0}
  pair = models.EncoderDecoderModel(tiny_config(), tiny_config(), eos_id=1, decode_kwargs=kwargs)
  at = lambda g: model().ms_per_position(g, 0.2, lengths=[[12]])
  assert min(at(g) for g in (1, 2, 3, 4)) > 1.08 * at(0)
  calibration = costs.Calibration({1: 0}, {1: model()}, temperature=1.0, alphas={1: 0.2})
  guided, _ = policy.plan(pair, kwargs, calibration=calibration, batch_size=1)
  assert guided.fallback == 0 and guided.alpha() == 0.2 and guided.predicted() == 0
  assert set(run_job(guided, [0.2] * 63)) == {0}
  blind = policy.DecodingPolicy(range(5), 'gamma', 0)
  assert set(run_job(blind, [0.2] * 63, machine=model())) != {0}


def beam_job(machine: costs.StepCosts, beams: int, batches: int, calibrated_beams: int = 4):
  kwargs = {'branching': 'auto'}
  pair = models.EncoderDecoderModel(tiny_config(), tiny_config(), eos_id=1, decode_kwargs=kwargs,
                                    decode_fn=beam_search.speculative_beam_search)
  calibration = costs.Calibration({}, {1: machine}, alphas={1: 0.0}, beam_size=calibrated_beams)
  decoding_policy, _ = policy.plan(pair, kwargs, calibration=calibration, batch_size=1,
                                   num_decodes=beams)
  return decoding_policy, run_job(decoding_policy, [0.0] * batches, machine=machine)


def test_a_beam_calibration_starts_where_its_model_predicts_and_serves_only_its_beam_size():
  # Beam steps per call of the trees as lifts over an acceptance of 0 (calibrate_beams).
  lifts = {(1,): 0.35, (2,): 0.45, (4,): 0.55, (8,): 0.6}
  flat = model(target_ms=FLAT_TARGET_MS, draft_ms=FLAT_DRAFT_MS, overhead_per_token_ms=0.0,
               lifts=lifts)
  assert flat.prices(()) and flat.tokens((8,), 0.0) == pytest.approx(1.6)
  guided, chosen = beam_job(flat, beams=4, batches=12)
  assert guided.fallback == flat.best(0.0, policy.TREES) == (8,) and guided.best() == (8,)
  assert chosen.count((8,)) >= 10  # (its calibration unchecked: beam_search timed beside)
  # A CPU: a call over a tree's rows costs more than the beam steps it saves; beam search itself
  # starts, and a short job does not try the trees the model prices slower.
  steep = dataclasses.replace(flat, target_ms={k: 1.0 * k for k in range(1, 10)})
  guided, chosen = beam_job(steep, beams=4, batches=64)
  assert guided.fallback == () and set(chosen) == {()}, chosen
  # Another beam size, or a gamma job: the calibration is not used.
  other, _ = beam_job(steep, beams=2, batches=1)
  assert other.model is None and other.fallback == policy.TREES[0]
  assert not costs.Calibration({}, {1: steep}, beam_size=4).fits(0.0)


def test_a_calibrated_noisy_job_stays_off_what_its_model_prices_slower():
  """Beam search at batch 1, each batch's time off by 30% (lognormal), the trees 8-25% slower:
  a job that follows its model runs beam_search on every batch, checked or not (the plain
  decoder needs no guard); timing alone tries the trees, and lucky streaks keep some on."""
  lifts = {(1,): 0.1, (2,): 0.3, (4,): 0.5, (8,): 0.6}
  steep = model(target_ms={k: 1.0 + 0.1 * k for k in range(1, 10)}, draft_ms=FLAT_DRAFT_MS,
                lifts=lifts)
  at = lambda c: steep.ms_per_position(c, 0.0)
  assert min(at(t) for t in policy.TREES[1:]) > 1.08 * at(())

  def tree_batches(calibration, seed):
    kwargs = {'branching': 'auto'}
    pair = models.EncoderDecoderModel(tiny_config(), tiny_config(), eos_id=1,
                                      decode_kwargs=kwargs,
                                      decode_fn=beam_search.speculative_beam_search)
    decoding_policy, _ = policy.plan(pair, kwargs, calibration=calibration, batch_size=1,
                                     num_decodes=4)
    noise = np.random.default_rng(seed).lognormal(0.0, 0.3, 192)
    decodes = np.zeros((1, 32), np.int32)
    decodes[0, :12] = 5
    trees = 0
    for i in range(192):
      choice = decoding_policy.choose()
      decoding_policy.observe(choice, at(choice) * 12 * noise[i] / 1e3, decodes)
      trees += choice != ()
    return trees

  for errors in ({}, {1: 0.03}):
    calibration = costs.Calibration({}, {1: steep}, alphas={1: 0.0}, beam_size=4, errors=errors)
    assert [tree_batches(calibration, seed) for seed in range(6)] == [0] * 6
  assert max(tree_batches(None, seed) for seed in range(6)) > 0


def test_the_policy_prices_batches_of_any_shape():
  """A short last batch and several decodes per example (each a row of the loop) mix in the
  policy's recent rows; the counted acceptance is the paper's."""
  decoding_policy = policy.DecodingPolicy(range(5), 'gamma', 2, model=model(), prior_alpha=0.5)
  for shape in ((4, 10), (3, 10), (2, 2, 10)):
    rows = shape[0]
    decoding_policy.observe(2, 0.01, np.ones(shape, np.int32),
                            {'accepted': np.full(rows, 8), 'rollbacks': np.full(rows, 2)})
  assert decoding_policy.alpha() == pytest.approx(0.8)
  assert decoding_policy._lengths().shape == (3, 4)  # pylint: disable=protected-access
  assert decoding_policy.predicted() in decoding_policy.choices
