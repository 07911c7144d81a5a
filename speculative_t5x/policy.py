"""The decoding policy: which compiled decoder each batch of a job runs, measured on the job.

A speculative decoder and its plain counterpart give the same output (greedy decoding: the same
tokens; sampling: the same distribution; beam search: the same beams), so which of them runs a
batch is a matter of speed alone, and the answer depends on the machine, the pair and the batch
size: on a 2-core CPU a verify call over 8 rows is arithmetic-bound and costs about what it
saves, on an accelerator the same batch is bandwidth-bound and speculation pays. So it is
measured, on the job's own batches, not modelled. `plan` turns a model that leaves the choice
open into its candidates, ordered from the plain decoder to the most speculative:

  speculative_sample, gamma='auto'              0 (temperature_sample: the target alone, same
                                                temperature / topk / topp), 1, ..., max_gamma
                                                (each verifying as the job asks; 'auto', the
                                                default: block verification when sampling at
                                                gamma >= 2, `decoding.resolve_verification`)
                                                and, with a calibration that priced them, its
                                                token trees (run only where its model predicts
                                                one fastest)
  speculative_beam_search, branching='auto'     () (beam_search itself), (1,), (2,), (4,), (8,)

and a `DecodingPolicy` that picks one per batch. A job's batches run as a fixed decoder's would,
dispatched ahead of the one awaited (`DecodingPolicy.stream`), and every batch is a real batch
of the job (its outputs are kept: there is no separate calibration); its share of the job's wall
time and its output positions (the longest output of the batch) are recorded for the choice
that ran it. A choice's cost is total ms over total positions of its last `window` batches (a
ratio of sums: a short batch, which carries the encoder and per-batch overhead over few
positions, weighs less; a burst of another process is clipped). A neighbour is compared with
the running choice both ways, window against window and side by side (each of its batches
against the running choice's batches run around it: the machine's speed drifts by more than
the differences sought), and the less favourable comparison counts. The first batch runs the
fallback; then the running choice's neighbours (one step more or less speculative, the more
speculative first, and the plain decoder, always within reach) are tried: a local search that
stops where both neighbours are slower (it looks past one that a calibrated model rules out
untried), so a job tries two to four choices, not all. A
neighbour replaces the running choice only once it is faster by a margin beyond the noise of
the estimates (the noise of one batch pooled over the job's batches); while it may be
faster, it (or the running choice, if that has fewer batches) runs again. Exploration is
bounded: batches of untried choices may cost at most `EXPLORE_SHARE` of the job's time beyond
the running choice's (an untried neighbour is assumed slower unless the step from the
nearest measured choice on the other side saved time); the plain decoder is exempt, as time on
it is never lost against decoding without speculation. A neighbour that is surely not faster
is re-measured `explore_every` batches after it last ran, and twice as long after each time, so
a long job follows changes at a cost that shrinks. A job shorter than the search runs the
fallback, and its summary says so.

BiLD is never chosen automatically: it is lossy, so choosing it is the user's decision.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import itertools
import time
from typing import (Any, Callable, Deque, Dict, Hashable, Iterable, Iterator, List, Mapping,
                    Optional, Sequence, Tuple)

import jax
import numpy as np

from speculative_t5x import beam_search
from speculative_t5x import costs
from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import trees

AUTO = 'auto'
# gamma='auto' candidates: 0 (the target alone) to MAX_GAMMA, each one compiled loop. The first
# batch runs FALLBACK_GAMMA when greedy (on the project's CPU the fastest gamma at batch 8 and
# within 1% of the fastest at 32, where a 192-sentence job is too short to search, and halfway to
# the fastest at batch 1). When sampling it runs SAMPLING_FALLBACK_GAMMA up to
# SAMPLING_FALLBACK_ROWS rows a batch: from a speculative start the target alone is always
# within reach (it is exempt from the exploration budget), while from the target alone a short
# job cannot afford to try speculation (at T=1 the embedded pair's gamma 1 was 1.12x at batch 8,
# and a 24-batch job starting without it never tried it). Above that, the target alone: on a
# CPU a verify call over 64 rows is arithmetic-bound (gamma 1 at batch 32: 0.97x and 1.04x in
# two runs, no clear gain), and a 6-batch job cannot search its way back. Sampling one row a
# batch starts at ONE_ROW_SAMPLING_FALLBACK_GAMMA: a verify call of a few tokens for one row is
# bandwidth-bound on every machine (about one step's cost), the embedded pair's fastest gamma
# there was 4, and the search, which climbs one gamma at a time through batches whose time
# varies by 15-25%, got there late from gamma 1 (0.92 of the best fixed gamma measured, 0.90 in
# benchmarks.policy_sim; from gamma 3: 0.99 measured, 0.95 simulated). The separate draft,
# whose best at T=1 is the target alone, lost nothing (0.981 and 0.984 simulated): the target
# alone is always within reach. Greedy keeps FALLBACK_GAMMA: it reached 0.99 of the best from
# there, and one run from gamma 3 gave 0.93.
MAX_GAMMA = 4
FALLBACK_GAMMA = 2
SAMPLING_FALLBACK_GAMMA = 1
SAMPLING_FALLBACK_ROWS = 8
ONE_ROW_SAMPLING_FALLBACK_GAMMA = 3
# branching='auto' candidates, () = beam_search itself (the fallback: a tree call over 4 beams is
# arithmetic-bound on a CPU and did not pay there).
TREES: Tuple[Tuple[int, ...], ...] = ((), (1,), (2,), (4,), (8,))
FALLBACK_TREE: Tuple[int, ...] = ()
# A choice's cost: total ms over total output positions of its last WINDOW batches (a ratio of
# sums: a short batch carries the per-batch fixed cost over few positions, and weighs less).
WINDOW = 24
# A neighbour replaces the running choice once its cost is lower by more than MARGIN, by Z
# standard errors of the difference (log ms per position, sigma pooled over all the choices'
# batches: one batch at batch 1 is one sentence, and its time varies by 10-25%). Until then, a
# neighbour that looks faster by more than MARGIN runs again.
MARGIN = 0.01
Z = 0.5
PRIOR_SIGMA, PRIOR_BATCHES = 0.15, 4
# A batch counts at most SPIKE times the choice's median ms per position.
SPIKE = 1.5
# A neighbour's batch is compared with the running choice's batches at most NEAR batches from it
# (before or after), among the last HISTORY batches of each choice.
NEAR = 8
HISTORY = 512
# Exploration (batches of non-running choices) may cost at most EXPLORE_SHARE of the job's time
# beyond what the running choice would have taken; an untried neighbour is expected to cost
# PRIOR_SLOWDOWN more than the running choice unless the step to the running choice from its
# other side saved time. The plain decoder (choices[0]) is exempt: time on it is never lost
# against decoding without speculation.
EXPLORE_SHARE = 0.01
PRIOR_SLOWDOWN = 0.5
# A neighbour measured not faster is re-measured EXPLORE_EVERY batches later, then after twice as
# many each time it is still not faster (at most MAX_EXPLORE_EVERY): a long job keeps following
# the machine's drift, and a neighbour that never pays costs ever fewer batches.
EXPLORE_EVERY = 8
MAX_EXPLORE_EVERY = 256
# A job's batches in flight beyond the one awaited (`DecodingPolicy.stream`).
IN_FLIGHT = 2
# With a calibrated model, a choice it predicts slower than the running one by more than
# MODEL_SLACK (its error on gammas it was not fitted to was at most 5% here) is not explored
# before the job's MODEL_TRUST-th batch: a short job does not pay to check what the model already
# answers (at batch 32 a 192-sentence job is 6 batches, and one batch of the target alone cost it
# 7%), and a long one still finds out when the model no longer holds. A checked model
# (`DecodingPolicy.model_error`) keeps ruling out, for the whole job, what it predicts slower by
# more than MODEL_SLACK plus CHECKED_MARGIN times its error: at batch 1 T=1 the target alone,
# predicted 62% slower than gamma 3, otherwise took 4 batches of each 192-batch job after its
# 64th, each twice as slow as the running choice's (2% of the job).
MODEL_SLACK = 0.08
MODEL_TRUST = 64
CHECKED_MARGIN = 3
# The narrowest prior a checked model gives a timed comparison (`DecodingPolicy.model_error`):
# its check is one run of a few batches.
MIN_MODEL_ERROR = 0.03


def round_robin(passes: Mapping[Hashable, Callable[[], Any]], repeats: int,
                clock: Callable[[], float] = time.perf_counter) -> Dict[Hashable, List[float]]:
  """Seconds of every pass in each of `repeats` rounds, blocking on each pass's result.

  The passes take turns within a round, so that slow phases of a shared machine hit all of them
  alike; compare them within a round (`relative_medians`), never across runs. A pass that
  returns an iterator runs piece by piece (each `next` a piece, blocked on), its pieces taking
  turns with the other such passes' pieces: the machine's speed drifts within a pass of a few
  seconds by more than the differences sought. Warm the passes up (compile them) first. The
  benchmarks and the translate command time with it.
  """
  times: Dict[Hashable, List[float]] = {key: [] for key in passes}
  for _ in range(repeats):
    running = {}
    for key, one_pass in passes.items():
      start = clock()
      result = one_pass()
      if isinstance(result, Iterator):
        running[key] = result  # (a generator has not started yet)
      else:
        jax.block_until_ready(result)
      times[key].append(clock() - start)
    while running:
      for key in list(running):
        start = clock()
        try:
          jax.block_until_ready(next(running[key]))
        except StopIteration:
          del running[key]
        times[key][-1] += clock() - start
  return times


def relative_medians(times: Mapping[Hashable, Sequence[float]], base: Hashable
                     ) -> Dict[Hashable, float]:
  """For each key, the median over rounds of its time over `base`'s time in the same round."""
  base_times = np.asarray(times[base])
  return {key: float(np.median(np.asarray(t) / base_times)) for key, t in times.items()}


def paired_medians(values: Mapping[Hashable, Sequence[float]]) -> Dict[Hashable, float]:
  """For each key, a median over rounds with the rounds' drift taken out: the median of its
  value over the round's geometric mean of all keys' values, times the median of those means.

  Each key's own median would carry the machine's speed of the rounds it happened to take; in
  the same rounds the keys' ratios do not (at batch 8 T=1 a round's ms per position moved by
  10-15%, and the keys' own medians ranked gamma 4 ahead of gamma 2; their ratios did not).
  """
  logs = np.log(np.array([np.asarray(v, float) for v in values.values()]))  # [keys, rounds]
  level = logs.mean(axis=0)
  return {key: float(np.exp(np.median(row - level) + np.median(level)))
          for key, row in zip(values, logs)}


def _local_rows(values: Any) -> np.ndarray:
  """A per-row array on the host: this process's rows of a multi-host batch (its measured time
  is for its part too)."""
  if isinstance(values, jax.Array) and not values.is_fully_addressable:
    values = np.concatenate([np.asarray(s.data) for s in values.addressable_shards])
  return np.asarray(values)


def row_positions(decodes: Any) -> np.ndarray:
  """Each row's output positions (non-padding tokens; decodes [batch, (beams,) length]) as
  [batch, (beams,)], this process's rows of a multi-host batch."""
  return np.count_nonzero(_local_rows(decodes), axis=-1)


def output_positions(decodes: Any) -> int:
  """The longest output of a batch (`row_positions`): a batch's loop runs until its longest
  row is done, so time per position compares batches of different lengths."""
  return longest(row_positions(decodes))


def longest(rows: np.ndarray) -> int:
  """The most output positions of `rows` (`row_positions`), at least 1."""
  return max(1, int(np.max(rows, initial=0)))


@dataclasses.dataclass
class _Record:
  """One choice's measurements: (the job's batch number, ms, output positions) of its last
  HISTORY batches, for side-by-side comparisons with batches of other choices run at about the
  same time, and its cost over the last `window` of them, computed once per batch (the policy
  reads it several times a batch, and at batch 1 a batch is a few ms)."""
  window: int
  batches: int = 0
  last: int = -1  # the job's batch number it last ran
  interval: int = EXPLORE_EVERY  # batches after `last` until it is re-measured as a neighbour
  history: Deque[Tuple[int, float, int]] = dataclasses.field(
      default_factory=lambda: collections.deque(maxlen=HISTORY))
  recent: np.ndarray = dataclasses.field(  # the window's batches [count, (number, ms, positions)]
      default_factory=lambda: np.zeros((0, 3)))
  count: int = 0  # batches in the window
  mean_ms: float = 0.0  # their mean ms
  cost: float = float('inf')  # ms per output position: a ratio of sums over the window
  log_ratios: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))

  def add(self, number: int, ms: float, positions: int) -> None:
    """Appends batch `number`. Each batch's ms counts at most SPIKE times its positions at the
    window's median ms per position: another process's burst must not stick to a choice for a
    window."""
    self.history.append((number, ms, positions))
    self.recent = np.array(list(itertools.islice(
        self.history, max(0, len(self.history) - self.window), None)))
    ms_, positions_ = self.recent[:, 1], self.recent[:, 2]
    clipped = np.minimum(ms_, SPIKE * np.median(ms_ / positions_) * positions_)
    self.count, self.mean_ms = len(self.recent), float(ms_.mean())
    self.cost = float(clipped.sum() / positions_.sum())
    self.log_ratios = np.log(clipped / positions_)


class DecodingPolicy:
  """Which decoder each batch of a job runs (module docstring: the search and its costs).

  choices: the keys of the job's compiled decoders (`plan`), ordered from the plain decoder to
    the most speculative; `(None,)` for a fixed decoder.
  setting: what a choice sets ('gamma' or 'branching'; None for a fixed decoder), the name under
    which the infer job records it per example.
  clock: injectable for tests.
  model: the batch size's `costs.StepCosts` (speculative-t5x-calibrate's) for gamma choices:
    the job's batches count their acceptance (`observe`'s stats) and their rows' output
    positions, from which it predicts each choice's time; the choice the model then
    predicts fastest neighbours the running one (tried next if it has not run yet), choices it
    predicts much slower are not explored early in the job (MODEL_SLACK), and timing decides
    between the rest.
  prior_alpha: the calibration's acceptance, the model's until a speculative batch counts one.
  modelled: choices outside the line of `choices` that only the model reaches (token trees the
    calibration priced): run when it predicts one fastest, never explored by the local search;
    while one runs, timing checks it against the plain decoder and the model's best of the line.
  model_error: the model's largest relative error over every choice it prices, as its
    calibration checked them (None: not all checked). Given, the model's predicted difference
    between two choices is a prior of that width on their timed comparison: at batch 1 one
    batch's time varies by 15-25%, and a neighbour predicted much slower would otherwise take
    over on a lucky streak (beam search at batch 1: 34 of 192 batches on a tree 17% slower).
  """

  def __init__(self, choices: Sequence[Any], setting: Optional[str] = None,
               fallback: Any = None, window: int = WINDOW, explore_every: int = EXPLORE_EVERY,
               clock: Callable[[], float] = time.perf_counter,
               model: Optional[costs.StepCosts] = None, prior_alpha: Optional[float] = None,
               modelled: Sequence[Any] = (), model_error: Optional[float] = None):
    if not choices:
      raise ValueError('DecodingPolicy needs at least one choice.')
    self.line = tuple(choices)  # ordered from the plain decoder to the most speculative
    self.choices = self.line + tuple(c for c in modelled if c not in self.line)
    self.setting = setting
    self.fallback = fallback if fallback in self.choices else self.choices[0]
    self.explore_every = explore_every
    self.window = window
    self.clock = clock
    self.model = model
    self.prior_alpha = prior_alpha
    self.model_error = model_error
    # (choice, accepted, rejected draft tokens) of the last `window` speculative batches, and
    # the rows' output positions of the last `window` batches.
    self.counts: Deque[Tuple[Any, int, int]] = collections.deque(maxlen=window)
    self.lengths: Deque[np.ndarray] = collections.deque(maxlen=window)
    self.records = {c: _Record(window, interval=explore_every) for c in self.choices}
    self.current = self.fallback  # the running choice
    self.batches = 0
    self.total_ms = 0.0
    self.excess_ms = 0.0  # what batches of other choices cost beyond the running choice's cost
    self._sigma_cache: Optional[float] = None
    self._advantages: Dict[Any, Tuple[float, float]] = {}  # of this batch: each is read often
    self._ours: Optional[np.ndarray] = None  # the running choice's history as an array
    self._alpha: Optional[Tuple[Optional[float]]] = None  # of this batch: read per neighbour
    self._predictions: Dict[Any, float] = {}  # of this batch, likewise
    self._rows: Optional[np.ndarray] = None  # of this batch, likewise

  def fresh(self) -> 'DecodingPolicy':
    """A policy with the same choices and settings and no measurements: the next job's."""
    return DecodingPolicy(self.line, self.setting, self.fallback, self.window,
                          self.explore_every, self.clock, self.model, self.prior_alpha,
                          self.choices[len(self.line):], self.model_error)

  @property
  def measured(self) -> bool:
    """Whether batches choose between several decoders."""
    return len(self.choices) > 1

  def best(self) -> Any:
    """The running choice: the fastest confirmed one (the fallback before any measurement)."""
    return self.current

  def alpha(self) -> Optional[float]:
    """The chains' acceptance in the job's recent speculative batches (the paper's: accepted
    over accepted and rejected draft tokens, a tree's lift taken off); before any, the
    calibration's (`prior_alpha`; None without a model). Computed once per observed batch."""
    if self._alpha is None:
      self._alpha = (self._counted_alpha(),)
    return self._alpha[0]

  def _counted_alpha(self) -> Optional[float]:
    by_choice: Dict[Any, List[int]] = collections.defaultdict(lambda: [0, 0])
    for choice, accepted, rejected in self.counts:
      by_choice[choice][0] += accepted
      by_choice[choice][1] += rejected
    weights = [sum(counted) for counted in by_choice.values()]
    if not sum(weights):
      return self.prior_alpha if self.model is not None else None
    alphas = [costs.chain_alpha(c, accepted, rejected, self.model.lifts)
              for c, (accepted, rejected) in by_choice.items()]
    return float(np.average(alphas, weights=weights))

  def predicted(self) -> Optional[Any]:
    """The choice the model predicts fastest at the observed acceptance (None without a model
    or before a speculative batch)."""
    alpha = self.alpha()
    if self.model is None or alpha is None:
      return None
    return costs.cheapest([c for c in self.choices if self.model.prices(c)],
                          self._predicted_ms)

  def _neighbours(self) -> List[Any]:
    """The choices one step more and less speculative than the running one, and the next one
    past a neighbour that is not surely slower or that the model rules out untried: a local
    search then crosses a plateau (at batch 1 greedy gamma 2, 3 and 4 were within a few % of
    each other, and the search rested on 2) and a choice the model prices apart (at batch 8 T=1
    a job started on gamma 4 with gamma 3 ruled out never reached gamma 2, 8% faster). A
    modelled choice's: the model's best of the line."""
    out: List[Any] = []
    if self.current not in self.line:
      out.append(costs.cheapest([c for c in self.line if self.model.prices(c)],
                                self._predicted_ms))
    else:
      i, line = self.line.index(self.current), self.line
      for step in (-1, 1):
        if 0 <= i + step < len(line):
          out.append(line[i + step])
          if 0 <= i + 2 * step < len(line) and self._passable(out[-1]):
            out.append(line[i + 2 * step])
    if self.choices[0] not in out + [self.current]:
      out.append(self.choices[0])
    predicted = self.predicted()  # the model's pick neighbours every choice
    if predicted is not None and predicted not in out + [self.current]:
      out.append(predicted)
    return out

  def _sigma(self) -> float:
    """The noise of one batch's log ms per position, pooled over the choices (with a prior);
    computed once per observed batch."""
    if self._sigma_cache is None:
      squares, dof = PRIOR_SIGMA ** 2 * PRIOR_BATCHES, PRIOR_BATCHES
      for record in self.records.values():
        if record.count > 1:
          squares += float(np.sum((record.log_ratios - record.log_ratios.mean()) ** 2))
          dof += len(record.log_ratios) - 1
      self._sigma_cache = float(np.sqrt(squares / dof))
    return self._sigma_cache

  def _advantage(self, choice: Any) -> Tuple[float, float]:
    """(log of the running choice's ms per position over `choice`'s: > 0 when it is faster,
    its standard error), measured side by side: each of `choice`'s last `window` batches
    against the running choice's batches within NEAR batches of it (the machine's speed drifts
    by more than the differences sought, so windows taken at different times cannot be
    compared). Each pair's log ratio counts at most log(SPIKE) either way."""
    if choice not in self._advantages:
      record, current = self.records[choice], self.records[self.current]
      paired, windows = self._paired(record, current), self._windows(record, current)
      timed = min(paired[0], windows[0]), max(paired[1], windows[1])
      self._advantages[choice] = self._with_prior(choice, *timed)
    return self._advantages[choice]

  def _with_prior(self, choice: Any, gain: float, error: float) -> Tuple[float, float]:
    """A timed (gain, error) combined with the model's predicted gain, weighted by inverse
    variances, the model's standard error `model_error` (at least MIN_MODEL_ERROR); the timed
    one alone without a checked model, where it does not price both choices, or before both
    have run (the prior tempers timing; it does not replace it)."""
    alpha = self.alpha()
    if (self.model_error is None or alpha is None or not self.model.prices(choice) or
        not self.model.prices(self.current) or not self.records[choice].count or
        not self.records[self.current].count):
      return gain, error
    prior = np.log(self._predicted_ms(self.current) / self._predicted_ms(choice))
    prior_error = max(self.model_error, MIN_MODEL_ERROR)
    weights = np.array([1 / error ** 2 if np.isfinite(error) else 0.0, 1 / prior_error ** 2])
    return (float(np.dot(weights, [gain, prior]) / weights.sum()),
            float(1 / np.sqrt(weights.sum())))

  def _windows(self, record: _Record, current: _Record) -> Tuple[float, float]:
    if not record.count or not current.count:
      return 0.0, float('inf')
    error = self._sigma() * np.sqrt(1 / record.count + 1 / current.count)
    return float(np.log(current.cost / record.cost)), float(error)

  def _paired(self, record: _Record, current: _Record) -> Tuple[float, float]:
    if not record.history or not current.history:
      return 0.0, float('inf')
    theirs = record.recent
    if self._ours is None:  # the running choice's, once a batch for all its neighbours
      self._ours = np.array(current.history)
    ours = self._ours
    near = np.abs(ours[None, :, 0] - theirs[:, None, 0]) <= NEAR  # [n, len(ours)]
    counts = near.sum(axis=1)
    paired = counts > 0
    if not paired.any():
      return 0.0, float('inf')
    ratios = (near @ ours[:, 1]) / np.maximum(near @ ours[:, 2], 1)
    gains = np.log(ratios[paired]) - np.log(theirs[paired, 1] / theirs[paired, 2])
    gains = np.clip(gains, -np.log(SPIKE), np.log(SPIKE))
    weights = 1 + 1 / counts[paired]  # each pair's variance, in one batch's
    return float(gains.mean()), float(self._sigma() * np.sqrt(weights.sum()) / len(gains))

  def _passable(self, choice: Any) -> bool:
    """Whether the local search looks past `choice`, a neighbour of the running one: measured
    and not surely slower, or untried and ruled out by the model (`_ruled_out`)."""
    if not self.records[choice].count:
      return self._ruled_out(choice)
    gain, error = self._advantage(choice)
    return gain + Z * error > -MARGIN

  def _expected_slowdown(self, choice: Any) -> float:
    """How much slower than the running choice a batch of `choice` is expected to be."""
    if self.records[choice].count:
      return max(0.0, -self._advantage(choice)[0])
    if choice not in self.line or self.current not in self.line:
      return self._predicted_slowdown(choice)
    line, i, j = self.line, self.line.index(self.current), self.line.index(choice)
    if abs(j - i) == 2:  # past a plateau, as slow as the measured neighbour in between if that
      middle = line[(i + j) // 2]  # is; past one the model rules out, as the model predicts
      if self.records[middle].count or self.alpha() is None:
        return max(0.0, -self._advantage(middle)[0])
      return self._predicted_slowdown(choice)
    step = i - j  # toward the other side: its nearest measured choice
    others = [self.records[c] for c in (line[i + step::step] if i + step >= 0 else ())
              if self.records[c].count]
    if others and others[0].cost > self.records[self.current].cost:
      return 0.0  # the step from there to the running choice saved time: keep going
    return PRIOR_SLOWDOWN

  def _predicted_slowdown(self, choice: Any) -> float:
    """How much slower than the running choice the model predicts `choice` (0 if faster)."""
    return max(0.0, self._predicted_ms(choice) / self._predicted_ms(self.current) - 1.0)

  def _affordable(self, choice: Any) -> bool:
    """Whether a batch of `choice` keeps exploration within EXPLORE_SHARE of the job's time."""
    if choice == self.choices[0]:
      return True
    current = self.records[self.current]
    return (self.excess_ms + self._expected_slowdown(choice) * current.mean_ms <=
            EXPLORE_SHARE * (self.total_ms + current.mean_ms))

  def _next(self) -> Any:
    if not self.measured or not self.records[self.current].count:  # the first batch: fallback
      return self.current
    neighbours, current = self._neighbours(), self.records[self.current]
    for choice in neighbours:  # may be faster, not yet surely: measure it again (or the running
      record = self.records[choice]  # choice, if it has fewer batches: both estimates are noisy)
      gain, error = self._advantage(choice)
      if record.count and (gain > MARGIN or
                           gain + Z * error > MARGIN and self._affordable(choice)):
        return choice if record.count <= current.count else self.current
    predicted = self.predicted()  # the model's pick, once, untried: timing decides from there
    if predicted is not None and predicted != self.current and not self.records[predicted].count:
      return predicted
    # Untried neighbours within the exploration budget; measured ones when their interval is
    # up (its doubling bounds what re-measuring costs: a neighbour's relative speed can only be
    # known to have changed by measuring it again).
    due = [c for c in neighbours if not self._ruled_out(c) and
           (self.batches - self.records[c].last >= self.records[c].interval
            if self.records[c].count else self._affordable(c))]
    if due:  # untried neighbours first (the local search; the more speculative first, where
      # greedy decoding gains most), then the longest unmeasured
      return min(due, key=lambda c: (self.records[c].last, -self.choices.index(c)))
    return self.current

  def choose(self, explore: bool = True) -> Any:
    """The choice for the next batch (the running one unless `explore`), process 0's in a
    multi-host job (all run one program)."""
    choice = self._next() if explore else self.current
    if self.measured and jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      index = multihost_utils.broadcast_one_to_all(np.int32(self.choices.index(choice)))
      choice = self.choices[int(index)]
    return choice

  def _lengths(self) -> Optional[np.ndarray]:
    """The recent batches' rows' output positions [batches, rows] (None before any); computed
    once per observed batch."""
    if self._rows is None and self.lengths:
      rows = max(len(batch) for batch in self.lengths)  # (a short last batch: padding rows)
      self._rows = np.zeros((len(self.lengths), rows), int)
      for i, batch in enumerate(self.lengths):
        self._rows[i, :len(batch)] = batch
    return self._rows

  def _predicted_ms(self, choice: Any) -> float:
    """The model's ms per output position of `choice` at the job's acceptance, for its recent
    batches' rows; computed once per observed batch."""
    if choice not in self._predictions:
      self._predictions[choice] = self.model.ms_per_position(choice, self.alpha(),
                                                             lengths=self._lengths())
    return self._predictions[choice]

  def _ruled_out(self, choice: Any) -> bool:
    """Whether the model predicts `choice` slower than the running choice by more than
    MODEL_SLACK, early in the job (`MODEL_TRUST`), or, checked, by more than that and
    CHECKED_MARGIN times its error."""
    alpha = self.alpha()
    if (alpha is None or not self.model.prices(choice) or not self.model.prices(self.current)
        or (self.batches >= MODEL_TRUST and self.model_error is None)):
      return False  # (alpha is None without a model)
    slack = MODEL_SLACK
    if self.batches >= MODEL_TRUST:
      slack += CHECKED_MARGIN * max(self.model_error, MIN_MODEL_ERROR)
    return self._predicted_ms(choice) > (1 + slack) * self._predicted_ms(self.current)

  def observe(self, choice: Any, seconds: float, decodes: Any,
              stats: Optional[Mapping[str, Any]] = None) -> None:
    """Records a decoded batch: its choice, wall seconds, decodes [batch, (beams,) length] and
    (for the model's acceptance) the decoder's per-row stats, `accepted` and `rollbacks`
    [batch]."""
    rows = row_positions(decodes)  # (one copy to the host, for both uses)
    record, positions, ms = self.records[choice], longest(rows), 1e3 * seconds
    if self.model is not None and self.setting == 'gamma':
      self.lengths.append(rows.reshape(-1))  # (each of num_decodes a row)
      if choice and stats and 'accepted' in stats and 'rollbacks' in stats:
        self.counts.append((choice, _total(stats['accepted']), _total(stats['rollbacks'])))
    if choice not in (self.current, self.choices[0]) and self.records[self.current].count:
      self.excess_ms += ms - self.records[self.current].cost * positions
    record.add(self.batches, ms, positions)
    self._sigma_cache, self._advantages, self._ours, self._alpha = None, {}, None, None
    self._predictions, self._rows = {}, None
    record.batches += 1
    record.last = self.batches
    self.batches += 1
    self.total_ms += ms
    if choice == self.current and len(self.choices) == 1:
      return
    advantages = {c: self._advantage(c) for c in self._neighbours()}
    surely = [c for c, (gain, error) in advantages.items() if gain - Z * error > MARGIN]
    if surely:
      best = max(surely, key=lambda c: advantages[c][0])
      self.records[self.current].interval = self.explore_every
      self.current, self._advantages, self._ours = best, {}, None
    elif choice in advantages and advantages[choice][0] + Z * advantages[choice][1] <= MARGIN:
      # (A multi-host job runs process 0's choice, which need not neighbour this process's.)
      record.interval = min(2 * record.interval, MAX_EXPLORE_EVERY)

  def stream(self, items: Iterable[Any], run: Callable[[Any, Any], Any],
             prepare: Optional[Callable[[Any, Any], bool]] = None, in_flight: int = IN_FLIGHT
             ) -> Iterator[Tuple[Any, Any, Any]]:
    """Decodes `items` in order, `in_flight` batches dispatched ahead: (item, choice, outputs).

    run(choice, item) -> (decodes, aux) dispatches a batch; its result is awaited only once
    `in_flight` later batches are dispatched, as a fixed decoder's loop over batches runs (the
    host's work on a batch overlaps the decoding of those before it, and on 2 cores two batches
    decode side by side). A batch's time runs from the previous batch's result to its own: the
    job's wall time, shared out. Without a model the first batch is awaited before the next is
    chosen: the search starts from its time. With one, the first batch runs the model's choice,
    and the batches dispatched before it lands run it too: awaiting it alone cost a 6-batch job
    at batch 32 1-3% here (two batches side by side decode faster than one after the other),
    while a search delayed by IN_FLIGHT batches cost simulated uncalibrated jobs up to 1%. While
    a batch of another choice than the running one (exploration) is in flight, the next batches
    run the running choice.
    prepare(choice, item) -> whether it compiled (and warmed up) a new executable: the batches
    in flight then shared the cores with the compiler, and their times are not recorded.
    """
    pending: Deque[Tuple[Any, Any, Any]] = collections.deque()  # (item, choice, outputs)
    mark = 0.0  # when the oldest batch in flight started to count

    def land(recorded: bool = True) -> Tuple[Any, Any, Any]:
      nonlocal mark
      landed = pending.popleft()
      jax.block_until_ready(landed[2])
      now = self.clock()
      if recorded:
        self.observe(landed[1], now - mark, landed[2][0], landed[2][1].get('stats'))
      mark = now
      return landed

    for item in items:
      while (pending and self.measured and self.model is None and
             not self.records[self.current].count):
        yield land()  # a job's first batch: an uncalibrated search starts from its time
      choice = self.choose(explore=all(c == self.current for _, c, _ in pending))
      if prepare is not None and prepare(choice, item):
        while pending:
          yield land(recorded=False)
      if not pending:
        mark = self.clock()
      pending.append((item, choice, run(choice, item)))
      while len(pending) > in_flight:
        yield land()
    while pending:
      yield land()

  def decode(self, run: Callable[[Any], Any]) -> Tuple[Any, Any]:
    """One batch, chosen, run(choice) -> (decodes, aux) to completion, observed: (choice,
    outputs). A job's loop over batches uses `stream`."""
    _, choice, outputs = next(self.stream([None], lambda choice, _: run(choice)))
    return choice, outputs

  def summary(self) -> Dict[str, Any]:
    """The measurements ({} for a fixed decoder): per choice tried, batches and median ms per
    output position; the best; whether the job was too short to search (fallback only)."""
    if not self.measured:
      return {}
    tried = {c: r for c, r in self.records.items() if r.batches}
    return {'setting': self.setting, 'fallback': _json(self.fallback), 'best': _json(self.best()),
            'fallback_only': list(tried) == [self.fallback],
            'exploration_share': round(self.excess_ms / max(self.total_ms, 1e-9), 4),
            **self._model_summary(),
            'measured': {str(_json(c)): {'batches': r.batches,
                                         'ms_per_position': round(r.cost, 4)}
                         for c, r in tried.items()}}

  def _model_summary(self) -> Dict[str, Any]:
    """The model's view ({} without a model): the observed acceptance, the choice it predicts
    fastest and its predicted ms per output position of each choice measured, beside the
    measured ones (`summary`'s)."""
    alpha = self.alpha()
    if self.model is None or alpha is None:
      return {}
    return {'model': {'alpha': round(alpha, 4), 'predicted_best': _json(self.predicted()),
                      'predicted_ms_per_position': {
                          costs.choice_name(c): round(self._predicted_ms(c), 4)
                          for c in self.choices if self.model.prices(c)}}}


def _total(values: Any) -> int:
  """The sum of a (possibly multi-host: this process's rows) per-row count."""
  return int(np.sum(_local_rows(values)))


def _json(choice: Any) -> Any:
  return list(choice) if isinstance(choice, tuple) else choice


def _name(fn: Callable) -> Optional[str]:
  return getattr(getattr(fn, 'func', fn), '__name__', None)


def plan(model: models.EncoderDecoderModel, decode_kwargs: Mapping[str, Any],
         max_gamma: int = MAX_GAMMA, calibration: Optional[costs.Calibration] = None,
         batch_size: Optional[int] = None, num_decodes: int = 1, **policy_kwargs: Any
         ) -> Tuple[DecodingPolicy, Dict[Any, models.EncoderDecoderModel]]:
  """The policy of a job and its decoders, {choice: model}.

  decode_kwargs: the effective arguments of model.decode_fn (gin-bound and the model's). A
  speculative_sample model with gamma='auto' gets gammas 0..max_gamma, a speculative_beam_search
  model with branching='auto' the `TREES`; any other model is its own single choice, None.
  calibration (speculative-t5x-calibrate's) and the job's batch_size: under gamma='auto' the
  first batch runs the schedule's entry for batch_size (the nearest calibrated size's, a gamma
  clipped to max_gamma or a tree the batch size's model prices; else `fallback_gamma`), and the
  policy follows the batch size's model
  (`DecodingPolicy`'s `model`) when the calibration has one, the trees it priced among its
  choices (`modelled`); a calibration made at another temperature than the job's is not used.
  Under branching='auto' a beam search calibration of num_decodes beams (the job's beam size)
  gives the batch size's model: the first batch runs the tree it predicts fastest, and choices
  it predicts much slower are not explored early.
  policy_kwargs go to `DecodingPolicy` (window, explore_every, clock).
  """
  name = _name(model.decode_fn)
  if name == _name(decoding.speculative_sample) and decode_kwargs.get('gamma') == AUTO:
    temperature = decode_kwargs.get('temperature', 1.0)
    if calibration is not None and not calibration.fits(temperature):
      calibration = None  # calibrated at another temperature: the timing search alone
    start = costs.scheduled(calibration.schedule, batch_size) if calibration else None
    if calibration is not None:
      policy_kwargs.setdefault('model', calibration.model(batch_size))
      policy_kwargs.setdefault('prior_alpha', calibration.alphas.get(batch_size))
      policy_kwargs.setdefault('model_error', calibration.errors.get(batch_size))
    priced = policy_kwargs.get('model')
    tree_choices = tuple(priced.lifts) if priced is not None else ()
    if isinstance(start, tuple) and start not in tree_choices:
      start = None  # a tree that this batch size's model does not price
    fallback = start if isinstance(start, tuple) else min(
        fallback_gamma(temperature, batch_size) if start is None else start, max_gamma)
    return (DecodingPolicy(range(max_gamma + 1), 'gamma', fallback, modelled=tree_choices,
                           **policy_kwargs),
            gamma_decoders(model, decode_kwargs, max_gamma, tree_choices))
  if (name == _name(beam_search.speculative_beam_search) and
      decode_kwargs.get('branching') == AUTO):
    priced = (calibration.model(batch_size) if calibration is not None and
              calibration.fits_beams(num_decodes) else None)
    fallback = FALLBACK_TREE
    if priced is not None:  # beam steps per call are the trees' lifts over an acceptance of 0
      policy_kwargs.setdefault('model', priced)
      policy_kwargs.setdefault('prior_alpha', 0.0)
      policy_kwargs.setdefault('model_error', calibration.errors.get(batch_size))
      fallback = priced.best(0.0, [t for t in TREES if priced.prices(t)])
    return (DecodingPolicy(TREES, 'branching', fallback, **policy_kwargs),
            tree_decoders(model, decode_kwargs))
  return DecodingPolicy((None,)), {None: model}


def fallback_gamma(temperature: Any, batch_size: Optional[int] = None) -> int:
  """The gamma of a job's first batch: FALLBACK_GAMMA when greedy; when sampling,
  ONE_ROW_SAMPLING_FALLBACK_GAMMA at batch size 1, SAMPLING_FALLBACK_GAMMA at batch sizes up
  to SAMPLING_FALLBACK_ROWS, else 0 (the target alone; also when the batch size is not known)."""
  if np.all(np.asarray(temperature) == 0.0):
    return FALLBACK_GAMMA
  if batch_size == 1:
    return ONE_ROW_SAMPLING_FALLBACK_GAMMA
  small = batch_size is not None and batch_size <= SAMPLING_FALLBACK_ROWS
  return SAMPLING_FALLBACK_GAMMA if small else 0


def gamma_decoders(model: models.EncoderDecoderModel, decode_kwargs: Mapping[str, Any],
                   max_gamma: int = MAX_GAMMA, tree_choices: Sequence[Tuple[int, ...]] = ()
                   ) -> Dict[costs.Choice, models.EncoderDecoderModel]:
  """{gamma: model decoding at that gamma}: 0 is the target alone (`temperature_sample` with the
  same temperature, topk and topp), 1..max_gamma speculative_sample; each of `tree_choices`,
  `trees.tree_speculative_sample` with that branching (a calibration priced it). Only exact
  speculative sampling qualifies: a lenience below 1 or a custom rule would make the choice
  change the output distribution."""
  if max_gamma < 1:
    raise ValueError(f'max_gamma must be >= 1, got {max_gamma}.')
  if decode_kwargs.get('lenience', 1.0) != 1.0 or decode_kwargs.get('rule') is not None:
    raise ValueError("gamma='auto' needs exact speculative sampling (lenience 1, no custom "
                     'rule): it also considers the target alone.')
  # Checked here too: the job's first batches may run the target alone and never trace it.
  decoding.resolve_verification(decode_kwargs.get('verification', decoding.AUTO_VERIFICATION),
                                max_gamma, decode_kwargs.get('temperature', 1.0))
  target_only = {k: decode_kwargs[k] for k in decoding.SAMPLING_ARGUMENTS if k in decode_kwargs}
  target_only.setdefault('topk', 0)  # speculative_sample's default, not T5X's topk=1
  out: Dict[costs.Choice, models.EncoderDecoderModel] = {
      0: model.with_decoder(decoding.temperature_sample, target_only)}
  for gamma in range(1, max_gamma + 1):
    out[gamma] = model.with_decoder(model.decode_fn, {**model.decode_kwargs, 'gamma': gamma})
  for tree in tree_choices:
    out[tree] = model.with_decoder(trees.tree_speculative_sample,
                                   {**target_only, 'branching': tuple(tree)})
  return out


def tree_decoders(model: models.EncoderDecoderModel, decode_kwargs: Mapping[str, Any]
                  ) -> Dict[Tuple[int, ...], models.EncoderDecoderModel]:
  """{branching: model}: () is beam_search itself with the same beam arguments, the others
  speculative_beam_search with that draft tree below each beam."""
  plain = inspect.signature(beam_search.beam_search).parameters
  out = {(): model.with_decoder(beam_search.beam_search,
                                {k: v for k, v in decode_kwargs.items() if k in plain})}
  for tree in TREES[1:]:
    out[tree] = model.with_decoder(model.decode_fn, {**model.decode_kwargs, 'branching': tree})
  return out

