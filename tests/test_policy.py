"""gamma='auto': the tuner's choice, its calibration (with a fake clock) and the infer job."""

import json

import numpy as np
import pytest

from speculative_t5x import policy
from speculative_t5x import decoding
from speculative_t5x import models

from test_infer import DRAFT, TARGET, _infer, _model, _outputs, setup  # noqa: F401  (fixture)


def _stats(accepted, rollbacks, rows=2):
  return {'accepted': np.full(rows, accepted), 'rollbacks': np.full(rows, rollbacks),
          'target_calls': np.full(rows, 5)}


def test_expected_tokens_is_the_papers_formula():
  assert policy.expected_tokens(0.0, 4) == 1.0
  assert policy.expected_tokens(1.0, 3) == 4.0
  assert policy.expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_tuner_follows_the_running_alpha():
  tuner = policy.GammaTuner(batch_ms={0: 100.0, 1: 70.0, 2: 60.0, 3: 64.0},
                               calibration_alpha={1: 0.8, 2: 0.8, 3: 0.8}, accepted=8, rejected=2)
  assert tuner.alpha == pytest.approx(0.8)
  assert tuner.predicted_ms(2) == pytest.approx(60.0)  # at the calibration alpha: as measured
  assert tuner.choose() == 2
  # The draft stops being accepted: every speculative gamma now costs more than the target.
  for _ in range(50):
    tuner.observe(_stats(accepted=0, rollbacks=1))
  assert tuner.alpha < 0.1
  assert tuner.choose() == 0
  # A nearly perfect draft makes the longest draft worth it.
  for _ in range(400):
    tuner.observe(_stats(accepted=10, rollbacks=0))
  assert tuner.choose() == 3
  assert json.dumps(tuner.summary())


def test_calibrate_times_every_candidate_round_robin():
  costs = {0: 9, 1: 5, 2: 4}  # fake milliseconds per call
  clock_ms = [0.0]
  calls = []

  def predict_at(gamma):
    def predict(batch):
      assert batch == 'batch'
      calls.append(gamma)
      clock_ms[0] += costs[gamma]
      return np.zeros(1), {'stats': _stats(accepted=3 * gamma, rollbacks=1 if gamma else 0)}
    return predict

  tuner = policy.calibrate({g: predict_at(g) for g in costs}, ['batch', 'batch'], repeats=2,
                              clock=lambda: clock_ms[0] / 1e3)
  assert calls == [0, 0, 1, 1, 2, 2] * 3  # one untimed pass each, then 2 interleaved rounds
  assert tuner.batch_ms == pytest.approx({0: 9.0, 1: 5.0, 2: 4.0})
  assert tuner.calibration_alpha == pytest.approx({1: 6 / 8, 2: 12 / 14})
  assert tuner.choose() == 2
  # The machine slows down 3x for one round: candidates are compared within rounds.
  slow = iter([1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3] + [1] * 6)
  clock_ms[0] = 0.0

  def drifting_predict(gamma):
    def predict(batch):
      clock_ms[0] += costs[gamma] * next(slow)
      return np.zeros(1), {'stats': _stats(accepted=1, rollbacks=1)}
    return predict

  drifted = policy.calibrate({g: drifting_predict(g) for g in costs}, ['b', 'b'], repeats=2,
                                clock=lambda: clock_ms[0] / 1e3)
  assert drifted.batch_ms[1] / drifted.batch_ms[0] == pytest.approx(5 / 9)
  assert drifted.batch_ms[2] / drifted.batch_ms[0] == pytest.approx(4 / 9)
  with pytest.raises(ValueError, match='gamma 0'):
    policy.calibrate({1: predict_at(1)}, ['batch'])
  with pytest.raises(ValueError, match='batches'):
    policy.calibrate({0: predict_at(0)}, [])
  assert policy.calibration_batches(1, 100) == policy.CALIBRATION_ROWS
  assert policy.calibration_batches(32, 100) == 1
  assert policy.calibration_batches(2, 3) == 3
  assert policy.candidates(policy.MIN_BATCHES, max_gamma=3) == (0, 1, 2, 3)
  assert policy.candidates(policy.MIN_BATCHES - 1) == (policy.FALLBACK_GAMMA,)


def test_decoders_cover_target_only_and_each_gamma():
  model = models.EncoderDecoderModel(TARGET, DRAFT, decode_kwargs={'gamma': 'auto',
                                                                   'temperature': 0.0})
  assert policy.wants_auto(model, model.decode_kwargs)
  out = policy.decoders(model, model.decode_kwargs, max_gamma=3)
  assert sorted(out) == [0, 1, 2, 3]
  assert out[0].decode_fn is decoding.temperature_sample and not out[0].uses_draft
  assert out[0].decode_kwargs == {'temperature': 0.0, 'topk': 0}
  assert [out[g].decode_kwargs['gamma'] for g in (1, 2, 3)] == [1, 2, 3]
  assert model.decode_kwargs['gamma'] == 'auto'  # the original is untouched
  with pytest.raises(ValueError, match='lenience'):
    policy.decoders(model, {'gamma': 'auto', 'lenience': 0.5})


def test_speculative_sample_refuses_auto_with_a_pointer():
  with pytest.raises(ValueError, match='policy'):
    decoding.speculative_sample(None, None, None, None, None, eos_id=1, gamma='auto')


def test_infer_with_gamma_auto_equals_a_fixed_gamma(setup, tmp_path):  # noqa: F811
  """Calibrated (every batch: min_batches 1) and fixed-gamma runs write the same predictions."""
  fixed = _infer(setup, tmp_path / 'fixed', setup / 'in.txt')
  auto = _infer(setup, tmp_path / 'auto', setup / 'in.txt', max_gamma=2, auto_min_batches=1,
                model=_model(decode_kwargs={'gamma': 'auto', 'temperature': 0.0}))
  assert [r['prediction'] for r in _outputs(tmp_path / 'auto')] == [
      r['prediction'] for r in _outputs(tmp_path / 'fixed')]
  info = auto['gamma_auto']
  assert sorted(info['batch_ms']) == [0, 1, 2]
  assert sum(info['examples_by_gamma'].values()) == 12
  used = {r['aux']['stats']['gamma'] for r in _outputs(tmp_path / 'auto')}
  assert used <= {0, 1, 2} and used == set(info['examples_by_gamma'])
  assert auto['calibration_seconds'] > 0 and fixed['gamma_auto'] is None
  # A short job skips calibration.
  short = _infer(setup, tmp_path / 'short', setup / 'in.txt',
                 model=_model(decode_kwargs={'gamma': 'auto', 'temperature': 0.0}))
  assert short['gamma_auto'] == {'examples_by_gamma': {policy.FALLBACK_GAMMA: 12}}
