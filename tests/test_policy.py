"""The decoding policy: the rule it follows with and without a calibration (an injected clock,
synthetic costs), its loop over a job's batches, the candidates it plans, the simulator that
checks it, and the infer job under gamma='auto'."""

import functools
import inspect

import numpy as np
import pytest

from benchmarks import policy_sim
from speculative_t5x import beam_search
from speculative_t5x import costs
from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import policy

from test_infer import DRAFT, TARGET, _infer, _model, _outputs, setup  # noqa: F401  (fixture)

IN_FLIGHT = inspect.signature(policy.DecodingPolicy.stream).parameters['in_flight'].default


def _run_job(decoding_policy, device, cost_ms, batches=40, positions=10, noise=None):
  """Decodes `batches` fake batches as a job does (`DecodingPolicy.stream`), each costing
  cost_ms[choice] per output position (times noise[i], if given) on the simulated device;
  returns the choices made."""
  decodes = np.zeros((2, 12), np.int32)
  decodes[0, :positions] = 5
  factor = np.ones(batches) if noise is None else noise
  return [choice for _, choice, _ in decoding_policy.stream(
      range(batches),
      lambda choice, i: device.dispatch(cost_ms[choice] * positions * factor[i], decodes))]


def _gamma_policy(clock, fallback=policy.FALLBACK_GAMMA, **kwargs):
  return policy.DecodingPolicy(range(5), 'gamma', fallback, clock=clock, **kwargs)


def _calibrated_job(decoding_policy, machine, batches, alpha=0.8, positions=12):
  """Drives a calibrated policy batch by batch (choose, then observe): each batch costs
  machine[choice] ms per position and counts acceptance `alpha` for a speculative choice;
  returns the choices and, per batch, the model's pick when it was chosen."""
  decodes = np.zeros((1, 32), np.int32)
  decodes[0, :positions] = 5
  chosen, picks = [], []
  for _ in range(batches):
    picks.append(decoding_policy.predicted())
    choice = decoding_policy.choose()
    stats = None if choice == 0 else {'accepted': np.array([round(100 * alpha)]),
                                      'rollbacks': np.array([100 - round(100 * alpha)])}
    decoding_policy.observe(choice, machine[choice] * positions / 1e3, decodes, stats)
    chosen.append(choice)
  return chosen, picks


def _sim_model(per_position, error=0.03):
  """A calibration's model pricing each gamma at per_position[gamma] ms per position (the
  policy reads it as it reads a `costs.StepCosts`), checked to `error`."""
  model = policy_sim.SimModel(dict(per_position), fixed_ms=0.0, positions=12.0)
  return dict(model=model, prior_alpha=0.8, model_error=error)


# ---------------------------------------------------------------------------------------------
# Without a calibration: the bandit.


def test_the_plain_decoder_takes_over_where_speculation_is_slower():
  device = policy_sim.Device()
  cost = {0: 1.0, 1: 1.3, 2: 1.5, 3: 1.7, 4: 1.9}
  choices = _run_job(_gamma_policy(device), device, cost)
  # The fallback (awaited: the search starts from its time), the plain decoder (untried: always
  # tried next), the running choice while that is in flight, then the plain decoder, measured
  # faster. Gamma 1, its untried neighbour, and gamma 2 run once each when due (EXPLORE_EVERY
  # batches into the job, and after gamma 2 last ran).
  assert IN_FLIGHT == 2 and policy.EXPLORE_EVERY == 32
  assert choices[:6] == [2, 0, 2, 2, 0, 0]
  assert set(choices[6:32]) == {0}
  assert sorted(c for c in choices[32:] if c) == [1, 2]


def test_the_search_climbs_downhill_to_a_faster_speculative_decoder():
  device = policy_sim.Device()
  cost = {0: 2.0, 1: 1.4, 2: 1.2, 3: 1.1, 4: 1.0}
  decoding_policy = _gamma_policy(device)
  choices = _run_job(decoding_policy, device, cost)
  # The plain decoder runs twice (after one batch of each choice the noise of a batch is not
  # known, so it may still be faster); slower than the fallback, it sends the search up a step,
  # and on: each step measured faster runs, the one it left beside it while that may be faster.
  assert choices[:16] == [2, 0, 2, 2, 0, 2, 2, 3, 2, 2, 3, 3, 4, 3, 3, 4]
  assert 1 not in choices and choices[16:].count(4) == len(choices) - 17  # (0 when due)
  summary = decoding_policy.summary()
  assert summary['best'] == 4 and not summary['fallback_only']
  assert summary['measured']['4']['ms_per_position'] == pytest.approx(1.0)


@pytest.mark.parametrize('seed', range(4))
def test_the_bandit_settles_on_the_fastest_choice_through_noise(seed):
  """Batch 1-like noise (15% per batch, the machine drifting), gamma 4 6% faster than gamma 3:
  the job finds it and runs it on most of its later batches."""
  device = policy_sim.Device()
  cost = {0: 1.8, 1: 1.35, 2: 1.15, 3: 1.06, 4: 1.0}
  rng = np.random.default_rng(seed)
  drift = np.exp(np.cumsum(rng.normal(0.0, 0.01, 400)))
  decoding_policy = _gamma_policy(device)
  choices = _run_job(decoding_policy, device, cost, batches=400,
                     noise=drift * rng.lognormal(0.0, 0.15, 400))
  assert decoding_policy.best() == 4
  assert choices[-200:].count(4) >= 170, choices


def test_a_choice_that_measured_slower_is_re_measured_ever_less_often():
  """Beam search ahead of every tree: the untried neighbour (1,) is due EXPLORE_EVERY batches
  into the job, then after twice as many batches each time; the trees beyond it, slower,
  never run; a 24-batch job (batch 8 of 192 sentences) runs beam_search alone."""
  device = policy_sim.Device()
  cost = {(): 1.0, (1,): 1.3, (2,): 1.35, (4,): 1.4, (8,): 1.5}
  choices = _run_job(policy.DecodingPolicy(policy.TREES, 'branching', clock=device), device,
                     cost, batches=500)
  tried = [i for i, c in enumerate(choices) if c != ()]  # (dispatched IN_FLIGHT batches ahead)
  assert set(choices) == {(), (1,)} and tried[0] == 32 + IN_FLIGHT
  assert [b - a - 1 - IN_FLIGHT for a, b in zip(tried, tried[1:])] == [64, 128, 256]
  assert set(_run_job(policy.DecodingPolicy(policy.TREES, 'branching', clock=device), device,
                      cost, batches=24)) == {()}


def test_a_short_job_tries_the_plain_decoder_and_nothing_off_the_search_s_path():
  """A 6-batch job (batch 32 of 192 sentences): the fallback and the plain decoder only; a
  24-batch one: besides those, only the neighbour the search walks to."""
  device = policy_sim.Device()
  flat = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}
  assert set(_run_job(_gamma_policy(device), device, flat, batches=6)) == {0, 2}
  cost = {0: 1.3, 1: 1.2, 2: 1.1, 3: 1.0, 4: 1.2}
  assert set(_run_job(_gamma_policy(device), device, cost, batches=24)) == {0, 2, 3, 4}


def test_a_long_job_follows_a_change_of_the_machine():
  """Gamma 1 becomes 25% faster than the plain decoder mid-job: measurements older than WINDOW
  blocks of WINDOW batches are forgotten, so the job moves there within that many batches."""
  device = policy_sim.Device()
  cost = {0: 1.0, 1: 1.3, 2: 1.5, 3: 1.7, 4: 1.9}
  decoding_policy = _gamma_policy(device, fallback=1)
  _run_job(decoding_policy, device, cost, batches=40)
  assert decoding_policy.best() == 0
  cost.update({0: 1.25, 1: 1.0})
  choices = _run_job(decoding_policy, device, cost, batches=policy.WINDOW ** 2)
  assert decoding_policy.best() == 1 and choices[-20:].count(1) >= 18


def test_fallbacks():
  """One row: the most speculative gamma; greedy: FALLBACK_GAMMA; sampling: SAMPLING_FALLBACK's
  gamma up to its rows, the target alone above (or for an unknown batch size)."""
  rows, gamma = policy.SAMPLING_FALLBACK
  assert [policy.fallback_gamma(0.0, b) for b in (1, 2, 32, None)] == [4, 2, 2, 2]
  assert policy.fallback_gamma(0.0, 1, max_gamma=3) == 3
  assert [policy.fallback_gamma(1.0, b) for b in (1, 2, rows, rows + 1, None)] == [
      4, gamma, gamma, 0, 0]
  assert policy.fallback_gamma(np.array([0.0, 0.7]), 2) == gamma


# ---------------------------------------------------------------------------------------------
# With a calibration: the model's pick, and one guard.


def test_follows_the_model_to_its_argmin_at_the_observed_alpha():
  """Every batch after the first (the schedule's) runs the choice the model predicts fastest at
  the acceptance the job's batches counted; a drop in acceptance moves it."""
  step_costs = costs.StepCosts(batch_size=1, target_ms={1: 1.24, 2: 1.67, 3: 1.91, 4: 2.0,
                                                        5: 1.96},
                               draft_ms={1: 0.12, 2: 0.14}, batch_ms=2.0, plain_overhead_ms=0.1,
                               overhead_ms=0.3, overhead_per_token_ms=0.05)
  at = lambda alpha: {g: step_costs.ms_per_position(g, alpha, lengths=[[12]]) for g in range(5)}
  decoding_policy = policy.DecodingPolicy(range(5), 'gamma', 2, model=step_costs,
                                          prior_alpha=0.5, model_error=0.03)
  chosen, picks = _calibrated_job(decoding_policy, at(0.95), 30, alpha=0.95)
  assert chosen[0] == 2 and chosen[1:] == picks[1:] == [4] * 29
  assert decoding_policy.alpha() == pytest.approx(0.95)
  # (Until then, the model's error on gamma 4, priced at the window's lagging acceptance, times
  # the plain decoder beside it, which may drop the model: either way the job moves there.)
  chosen, picks = _calibrated_job(decoding_policy, at(0.2), 40, alpha=0.2)
  assert step_costs.best(0.2, range(5), [[12]]) == 0 and decoding_policy.best() == 0
  assert chosen[-20:] == [0] * 20 and chosen[0] == 4


def test_the_guard_drops_a_model_that_the_plain_decoder_beats():
  """The model prices gamma 1 2% ahead of the plain decoder, within its 5% error, so the plain
  decoder runs beside it once due (EXPLORE_EVERY batches into the job); measured 20% faster, it
  takes over and the model is dropped."""
  decoding_policy = policy.DecodingPolicy(
      range(5), 'gamma', 1, **_sim_model({0: 1.0, 1: 0.98, 2: 1.2, 3: 1.3, 4: 1.4}, 0.05))
  machine = {0: 1.0, 1: 1.25, 2: 1.4, 3: 1.5, 4: 1.6}
  due = policy.EXPLORE_EVERY
  chosen, _ = _calibrated_job(decoding_policy, machine, due + 20)
  assert chosen[:due] == [1] * due  # (a job shorter than that never pays for the guard)
  assert chosen[due] == 0 and decoding_policy.dropped and decoding_policy.best() == 0
  assert chosen[due:].count(0) >= 18  # (the bandit from there: gamma 1 when due)
  assert decoding_policy.summary()['model']['dropped']


def test_the_guard_leaves_a_clear_pick_alone_unless_the_model_is_off_on_the_job():
  """The model prices gamma 4 40% ahead of the plain decoder, checked to 3%: the plain decoder
  never runs while the machine agrees. Where gamma 4 runs twice as slow as priced, the model's
  error on this job widens the guard: the plain decoder runs beside it when due and, faster,
  takes over."""
  priced = {0: 1.0, 1: 0.8, 2: 0.7, 3: 0.65, 4: 0.6}
  agreeing = policy.DecodingPolicy(range(5), 'gamma', 4, **_sim_model(priced))
  assert set(_calibrated_job(agreeing, priced, 100)[0]) == {4}
  off = policy.DecodingPolicy(range(5), 'gamma', 4, **_sim_model(priced))
  due = policy.EXPLORE_EVERY
  chosen, _ = _calibrated_job(off, {**priced, 4: 1.2}, due + 80)
  assert chosen[:due + 1] == [4] * due + [0] and off.dropped
  assert off.best() == 3  # (the bandit from there, as uncalibrated, finds gamma 3)


def test_an_unchecked_model_gets_the_plain_decoder_timed_beside_it_at_doubling_intervals():
  priced = {0: 1.0, 1: 0.8, 2: 0.7, 3: 0.65, 4: 0.6}
  decoding_policy = policy.DecodingPolicy(range(5), 'gamma', 4, **_sim_model(priced, None))
  chosen, _ = _calibrated_job(decoding_policy, priced, 200)
  due = policy.EXPLORE_EVERY
  assert [i for i, c in enumerate(chosen) if c == 0] == [due, 3 * due + 1]
  assert decoding_policy.best() == 4 and not decoding_policy.dropped


# ---------------------------------------------------------------------------------------------
# A job's loop.


def test_stream_keeps_batches_in_flight_and_times_each_by_its_share():
  """A job's loop (`DecodingPolicy.stream`): results come back in order, paired with their
  items; batches are awaited IN_FLIGHT dispatches late; each batch's recorded time is its own
  on a device that runs them back to back; at most one exploration batch is in flight."""
  device = policy_sim.Device()
  decoding_policy = _gamma_policy(device)
  cost = {0: 9.0, 1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0}
  decodes = np.full((1, 10), 5, np.int32)
  dispatched, seen = [], []

  def run(choice, item):
    dispatched.append(item)
    return device.dispatch(cost[choice] * (1 + item / 100), decodes)

  for item, choice, outputs in decoding_policy.stream(range(30), run):
    assert outputs[0] is decodes
    seen.append((item, choice))
    assert len(dispatched[len(seen):]) <= IN_FLIGHT
  assert [item for item, _ in seen] == list(range(30)) == dispatched
  for choice, record in decoding_policy.records.items():
    items = [i for i, c in seen if c == choice][-record.window:]
    assert [ms for ms, _ in record.recent] == pytest.approx(
        [cost[choice] * (1 + i / 100) for i in items])
  explorations = [i for i, (_, c) in enumerate(seen) if c != decoding_policy.best() and i > 2]
  assert all(b - a > IN_FLIGHT for a, b in zip(explorations, explorations[1:]))


def test_only_an_uncalibrated_job_awaits_its_first_batch_alone():
  """An uncalibrated search starts from the first batch's time, so the next batch waits for it;
  a calibrated job keeps IN_FLIGHT batches of its scheduled choice dispatched behind it (two
  batches side by side decode faster than one after the other)."""
  decodes = np.full((1, 10), 5, np.int32)
  for model, landed_before_second in (({}, 1), (_sim_model({g: 1.0 for g in range(5)}), 0)):
    device = policy_sim.Device()
    decoding_policy = _gamma_policy(device, fallback=3, **model)
    dispatched, seen = [], []

    def run(choice, item):
      dispatched.append((choice, len(seen)))  # (its choice, batches landed before it)
      return device.dispatch(1.0, decodes)

    for item, _, _ in decoding_policy.stream(range(6), run):
      seen.append(item)
    assert dispatched[1][1] == landed_before_second, model
    first = dispatched[:IN_FLIGHT + 1] if model else dispatched[:1]
    assert [choice for choice, _ in first] == [3] * len(first)


def test_stream_does_not_record_batches_that_shared_the_cores_with_a_compile():
  device = policy_sim.Device()
  decoding_policy = policy.DecodingPolicy((None,), clock=device)
  decodes = np.full((1, 10), 5, np.int32)
  compiled = set()

  def prepare(choice, item):  # a new encoder width every 5 batches
    new = item // 5 not in compiled
    compiled.add(item // 5)
    return new

  out = list(decoding_policy.stream(range(12), lambda c, i: device.dispatch(1.0, decodes),
                                    prepare))
  assert [item for item, _, _ in out] == list(range(12))
  # Batches 3-4 and 8-9 were in flight when widths 1 and 2 compiled.
  assert decoding_policy.records[None].batches == 12 - 2 * IN_FLIGHT


def test_a_short_job_runs_the_fallback_and_says_so():
  device = policy_sim.Device()
  decoding_policy = _gamma_policy(device)
  assert _run_job(decoding_policy, device, {g: 1.0 for g in range(5)}, batches=1) == [2]
  assert decoding_policy.summary()['fallback_only']
  fixed = policy.DecodingPolicy((None,))
  assert not fixed.measured and fixed.summary() == {}
  assert _run_job(fixed, device, {None: 1.0}, batches=3) == [None] * 3


def test_a_choice_that_is_not_a_neighbour_is_recorded():
  """A multi-host job runs process 0's choice, which another process's policy may not have
  reached: it is recorded like any batch."""
  decoding_policy = _gamma_policy(policy_sim.Device())
  decodes = np.full((1, 4), 5, np.int32)
  decoding_policy.observe(2, 0.01, decodes)
  decoding_policy.observe(4, 0.012, decodes)  # gamma 4: not a neighbour of the running gamma 2
  assert decoding_policy.records[4].batches == 1 and decoding_policy.best() == 2


# ---------------------------------------------------------------------------------------------
# The simulator (benchmarks.policy_sim).


def _scenario(name):
  (scenario,) = [s for s in policy_sim.SCENARIOS if s.name == name]
  return scenario


# Where the policy stays below the target in 12 simulated jobs (strict: a policy that closes a
# gap says so); the policy before this one (benchmarks.policy_sim --baseline_policy) fell short
# too, and at batch 32 greedy (0.965 of the best fixed gamma over 30 seeds; this one 0.969).
SHORT_OF_THE_TARGET = {
    'embedded pair, batch 32 T=1': 'gamma 3 measured 1.19x once, but a 6-batch job started '
                                   'from the target alone cannot afford to try it',
}


def _marked(names):
  return [pytest.param(s, id=s.name, marks=[pytest.mark.xfail(strict=True, reason=names[s.name])]
                       if s.name in names else []) for s in policy_sim.SCENARIOS]


@pytest.mark.parametrize('scenario', _marked(SHORT_OF_THE_TARGET))
def test_simulated_long_jobs_reach_the_target(scenario):
  """Simulated 192-sentence jobs (benchmarks.policy_sim, mean over 12 seeds), the later passes
  with the measurements carried over (the benchmark's timed rounds): at least 0.97x the best
  fixed choice and 0.99x the plain decoder; a fresh job, its search included, at least 0.97x
  the plain decoder and 0.94x the best fixed choice."""
  result = policy_sim.evaluate(scenario, range(12))
  assert result['job']['vs_plain'] >= 0.97 and result['job']['vs_best'] >= 0.94, result
  assert policy_sim.meets(result['rounds']), result


def test_the_simulator_puts_another_policy_beside_this_one(tmp_path):
  """--baseline_policy FILE: another policy.py on the same draws, before and after in one table."""
  results = policy_sim.main(['--seeds', '2', '--passes', '2', '--scenarios', 'batch 32 beam',
                             '--baseline_policy', policy.__file__, '--out_dir', str(tmp_path)])
  assert [r['scenario'] for r in results['scenarios']] == [
      'embedded pair, batch 32 beam 4', 'separate draft, batch 32 beam 4']
  assert all(r['baseline'] == {k: r[k] for k in ('job', 'rounds')}
             for r in results['scenarios'])  # (the same policy: the same numbers)
  table = (tmp_path / 'policy_sim.md').read_text()
  assert '| 1.000 → 1.000 |' in table and 'job kept, rounds kept' in table


@pytest.mark.parametrize('name', ['embedded pair, batch 8 T=1', 'separate draft, batch 32 greedy',
                                  'separate draft, batch 1 beam 4'])
def test_simulated_calibrated_jobs_follow_a_model_within_five_percent(name):
  make = functools.partial(policy_sim.make_policy, model_error=0.05)
  result = policy_sim.evaluate(_scenario(name), range(6), new_policy=make)
  assert policy_sim.meets(result['job']) and policy_sim.meets(result['rounds']), result


# ---------------------------------------------------------------------------------------------
# Helpers the benchmarks share, and the candidates.


def test_output_positions_is_the_longest_output():
  decodes = np.array([[5, 6, 1, 0], [5, 1, 0, 0]])
  assert policy.output_positions(decodes) == 3
  assert policy.output_positions(decodes[:, None]) == 3  # with a beam axis
  assert policy.output_positions(np.zeros((2, 4))) == 1


def test_round_robin_runs_passes_in_pieces_that_take_turns():
  clock, order = policy_sim.Device(), []

  def pieces(name, cost):
    def one_pass():
      for c in cost:
        order.append(name)
        clock.now += c
        yield c
    return one_pass

  def whole():
    order.append('whole')
    clock.now += 5.0
    return 5.0

  times = policy.round_robin({'a': pieces('a', [1.0, 2.0]), 'b': pieces('b', [3.0]),
                              'whole': whole}, repeats=2, clock=clock)
  assert order == ['whole', 'a', 'b', 'a'] * 2
  assert times == {'a': [3.0, 3.0], 'b': [3.0, 3.0], 'whole': [5.0, 5.0]}


def test_paired_medians_take_the_rounds_drift_out():
  """b is 5% faster than a in two of three rounds and 8% slower in the third; the rounds' speeds
  differ by up to 1.5x. Each key's own median ranks a ahead; the same rounds' ratios do not."""
  times = {'a': [1.0, 1.5, 1.2], 'b': [0.95, 1.425, 1.3]}
  assert np.median(times['a']) < np.median(times['b'])
  medians = policy.paired_medians(times)
  assert medians['b'] / medians['a'] == pytest.approx(0.95)
  level = np.median(np.sqrt(np.multiply(times['a'], times['b'])))  # the rounds' geometric means
  assert np.sqrt(medians['a'] * medians['b']) == pytest.approx(level)
  assert policy.paired_medians({'alone': [3.0, 1.0, 2.0]}) == {'alone': pytest.approx(2.0)}


def test_plan_covers_target_only_each_gamma_and_beam_trees():
  model = models.EncoderDecoderModel(TARGET, DRAFT, decode_kwargs={'gamma': 'auto',
                                                                   'temperature': 0.0})
  decoding_policy, out = policy.plan(model, model.decode_kwargs, max_gamma=3)
  assert decoding_policy.choices == (0, 1, 2, 3) and decoding_policy.setting == 'gamma'
  assert out[0].decode_fn is decoding.temperature_sample and not out[0].uses_draft
  assert out[0].decode_kwargs == {'temperature': 0.0, 'topk': 0}
  assert [out[g].decode_kwargs['gamma'] for g in (1, 2, 3)] == [1, 2, 3]
  assert model.decode_kwargs['gamma'] == 'auto'  # the original is untouched
  assert policy.plan(model, model.decode_kwargs, max_gamma=3, batch_size=1)[0].fallback == 3
  with pytest.raises(ValueError, match='lenience'):
    policy.plan(model, {'gamma': 'auto', 'lenience': 0.5})
  beam = models.EncoderDecoderModel(TARGET, DRAFT, decode_fn=beam_search.speculative_beam_search,
                                    decode_kwargs={'branching': 'auto', 'alpha': 0.6})
  decoding_policy, out = policy.plan(beam, beam.decode_kwargs)
  assert decoding_policy.choices == policy.TREES and decoding_policy.fallback == ()
  assert out[()].decode_fn is beam_search.beam_search and not out[()].uses_draft
  assert out[()].decode_kwargs == {'alpha': 0.6}
  assert out[(2,)].decode_kwargs == {'branching': (2,), 'alpha': 0.6}
  fixed = models.EncoderDecoderModel(TARGET, DRAFT, decode_kwargs={'gamma': 2})
  assert policy.plan(fixed, fixed.decode_kwargs)[0].choices == (None,)


def test_speculative_sample_refuses_auto_with_a_pointer():
  with pytest.raises(ValueError, match='policy'):
    decoding.speculative_sample(None, None, None, None, None, eos_id=1, gamma='auto')


def test_infer_with_gamma_auto_equals_a_fixed_gamma(setup, tmp_path):  # noqa: F811
  """gamma='auto' (every batch a real batch of the job, whatever gamma ran it) and a fixed gamma
  write the same predictions; the summary states the schedule and the measurements."""
  fixed = _infer(setup, tmp_path / 'fixed', setup / 'in.txt')
  auto = _infer(setup, tmp_path / 'auto', setup / 'in.txt', max_gamma=2,
                model=_model(decode_kwargs={'gamma': 'auto', 'temperature': 0.0}))
  assert [r['prediction'] for r in _outputs(tmp_path / 'auto')] == [
      r['prediction'] for r in _outputs(tmp_path / 'fixed')]
  info = auto['policy']
  assert info['setting'] == 'gamma' and info['batch_size'] == 2 and info['fallback'] == 2
  assert sum(info['examples_by_choice'].values()) == 12
  used = {r['aux']['stats']['gamma'] for r in _outputs(tmp_path / 'auto')}
  assert used <= {0, 1, 2} and len(used) >= 2  # 6 batches: the search tried the plain decoder
  assert {str(g) for g in used} == set(info['examples_by_choice']) == set(info['measured'])
  assert info['verification'] == {str(g): 'token' for g in used if g}  # greedy: token verdicts
  assert fixed['policy'] is None
