"""The decoding policy: which compiled decoder each batch of a job runs.

A speculative decoder and its plain counterpart give the same output (greedy decoding: the same
tokens; sampling: the same distribution; beam search: the same beams), so which of them runs a
batch is a matter of speed alone, and the answer depends on the machine, the pair and the batch
size. `plan` turns a model that leaves the choice open into its candidates, ordered from the
plain decoder to the most speculative:

  speculative_sample, gamma='auto'              0 (temperature_sample: the target alone, same
                                                temperature / topk / topp), 1, ..., max_gamma,
                                                and a calibration's token trees (run only where
                                                its model predicts one fastest)
  speculative_beam_search, branching='auto'     () (beam_search itself), (1,), (2,), (4,), (8,)

and a `DecodingPolicy` picks one per batch, by the rule docs/policy.md states: with a
calibration, the choice its model predicts fastest at the job's counted acceptance, with the
plain decoder timed beside it at doubling intervals where the model cannot tell them apart (it
is dropped if that is surely faster); without one, a bandit over the candidates
(`DecodingPolicy._explore`). Every batch is a real batch of the job, its cost its share of the job's wall time over its longest
output's positions, and two choices are compared within blocks of `WINDOW` consecutive batches:
the machine's speed drifts by more than the differences sought.

BiLD is never chosen automatically: it is lossy, so choosing it is the user's decision.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
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

# The figures below are benchmarks.policy_sim's (30 seeds: "job" a fresh 192-sentence job,
# "rounds" its later passes; results/cpu/policy_sim.md) unless they name a measured run. Each
# value was moved alone to the neighbours given; "lost" is a scenario where the policy then fell
# below the target (0.97 of the best fixed choice, 0.99 of the plain decoder) that it
# meets at this value.

AUTO = 'auto'
# gamma='auto' candidates: the target alone and gammas 1 to MAX_GAMMA, each a compiled loop.
# Gamma 4 was the fastest fixed gamma at batch 1 greedy and at T=1 (1.84x and 1.57x,
# results/cpu/speed_greedy/speed.md, speed_t1/speed.md); gammas 1-2 at batch 8 and 32.
MAX_GAMMA = 4
# branching='auto' candidates, () = beam_search itself (where an uncalibrated job starts: the
# tree (1,) ran 0.74-0.82x of it on the project's CPU, results/cpu/speed_beam4/speed.md).
TREES: Tuple[Tuple[int, ...], ...] = ((), (1,), (2,), (4,), (8,))
# Where an uncalibrated gamma job starts (`fallback_gamma`). One row: MAX_GAMMA, as a verify call
# of a few tokens for one row costs about a step on every machine (embedded pair, batch 1: job
# 0.972 greedy and 0.975 at T=1 from gamma 4; from gamma 2, 0.959 and 0.937). More rows, greedy:
# FALLBACK_GAMMA (1 lost both batch 8 greedy jobs, 0.965 and 0.964; 3 lost those, their rounds
# and the separate draft's batch 32 greedy job). Sampling, up to SAMPLING_FALLBACK[0] rows: its gamma, 1 (from 2 the fresh batch 8
# T=1 jobs fell from 0.958 to 0.929 and from 0.974 to 0.967; measured on the CPU, gamma 1 was
# the fastest at T=1 batch 8, results/cpu/speed_t1/speed.md); above, the target alone: at
# batch 32 speculation paid with one pair (gamma 3 1.19x) and lost with the other (0.82-0.95x),
# and 6 batches cannot find out which (rows up to 32 lost the separate draft's batch 32 T=1
# job and rounds: 0.969, 0.982).
FALLBACK_GAMMA = 2
SAMPLING_FALLBACK = (8, 1)
# Blocks of WINDOW consecutive batches are where choices are compared; a choice's estimate is
# over its last WINDOW batches, and the job's last WINDOW blocks are kept (so a long job follows
# a change within WINDOW ** 2 batches). 16 lost the separate draft's batch 1 T=1 rounds (0.985)
# and batch 8 greedy job (0.967); 32 lost nothing. 24: one batch 8 job of 192 sentences.
WINDOW = 24
# A choice may be faster while its measured gain (log ms per position, the running choice's over
# its) plus Z standard errors is positive, and is surely faster once the gain less Z standard
# errors is (the bandit's exploration, the guard's plain decoder and its verdict). 0.6 lost the embedded pair's batch 8 greedy job (0.969) and the separate draft's
# batch 1 T=1 rounds (0.989); 0.3 lost nothing.
Z = 0.5
# A choice off the search's path is first tried EXPLORE_EVERY batches into the job, and one
# measured slower is re-measured EXPLORE_EVERY batches after it last ran, then after twice as
# many each time: exploration costs ever less. 16 lost both batch 8 beam jobs (0.987, 0.988: a
# tree tried in a 24-batch job) and the separate draft's batch 8 greedy job (0.969); 64 lost
# nothing.
EXPLORE_EVERY = 32


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
  """One choice's batches: the job's batch number and log ms per output position of each in the
  job's last `window` blocks, and the ms and positions of its last `window` batches."""
  window: int
  interval: int  # batches after its last batch until it is due for a re-measure
  batches: int = 0
  last: int = 0  # the job's batch number after its last batch (0: the job's start)
  numbers: Deque[int] = dataclasses.field(default_factory=collections.deque)
  logs: Deque[float] = dataclasses.field(default_factory=collections.deque)
  recent: Deque[Tuple[float, int]] = dataclasses.field(default_factory=collections.deque)

  def add(self, number: int, ms: float, positions: int) -> None:
    self.batches += 1
    self.last = number + 1
    self.numbers.append(number)
    self.logs.append(float(np.log(max(ms, 1e-9) / positions)))
    self.recent.append((ms, positions))
    if len(self.recent) > self.window:
      self.recent.popleft()

  def forget_before(self, number: int) -> None:
    """Forgets its batches before batch `number`."""
    while self.numbers and self.numbers[0] < number:
      self.numbers.popleft()
      self.logs.popleft()

  @property
  def cost(self) -> float:
    """ms per output position over its window (a ratio of sums), inf before any batch."""
    if not self.recent:
      return float('inf')
    ms, positions = np.sum(np.array(self.recent), axis=0)
    return float(ms / positions)

  def arrays(self, last: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(batch numbers, log ms per position) of the kept batches, or of the last `last`."""
    numbers, logs = np.array(self.numbers, int), np.array(self.logs)
    return (numbers, logs) if last is None else (numbers[-last:], logs[-last:])


Gain = Tuple[float, float]  # (log of the running choice's cost over a choice's, standard error)


class DecodingPolicy:
  """Which decoder each batch of a job runs (module docstring; docs/decoding.md).

  choices: the keys of the job's compiled decoders (`plan`), ordered from the plain decoder to
    the most speculative; `(None,)` for a fixed decoder.
  setting: what a choice sets ('gamma' or 'branching'; None for a fixed decoder), the name under
    which the infer job records it per example.
  fallback: the first batch's choice; window, explore_every: `WINDOW`, `EXPLORE_EVERY`.
  clock: injectable for tests.
  model: the batch size's `costs.StepCosts` (speculative-t5x-calibrate's): each batch runs the
    choice it predicts fastest at the acceptance the job's speculative batches count
    (`observe`'s stats; before any, `prior_alpha`, the calibration's), and for their rows.
  modelled: choices outside the line of `choices` that only the model reaches (token trees the
    calibration priced).
  model_error: the model's largest relative error over the choices it prices, as its
    calibration checked them (None: not all checked): the guard's width (`_guards`).
  """

  def __init__(self, choices: Sequence[Any], setting: Optional[str] = None,
               fallback: Any = None, window: Optional[int] = None,
               explore_every: Optional[int] = None,
               clock: Callable[[], float] = time.perf_counter,
               model: Optional[costs.StepCosts] = None, prior_alpha: Optional[float] = None,
               modelled: Sequence[Any] = (), model_error: Optional[float] = None):
    if not choices:
      raise ValueError('DecodingPolicy needs at least one choice.')
    self.line = tuple(choices)  # ordered from the plain decoder to the most speculative
    self.choices = self.line + tuple(c for c in modelled if c not in self.line)
    self.setting = setting
    self.fallback = fallback if fallback in self.choices else self.choices[0]
    self.window = window or WINDOW  # (read when made: a test may set the module's)
    self.explore_every = explore_every or EXPLORE_EVERY
    self.clock = clock
    self.model = model
    self.prior_alpha = prior_alpha
    self.model_error = model_error
    self.dropped = False  # whether the guard dropped the model
    # (choice, accepted, rejected draft tokens) of the last `window` speculative batches, and
    # the rows' output positions of the last `window` batches: the model's view of the job.
    self.counts: Deque[Tuple[Any, int, int]] = collections.deque(maxlen=self.window)
    self.lengths: Deque[np.ndarray] = collections.deque(maxlen=self.window)
    self.records = {c: _Record(self.window, self.explore_every) for c in self.choices}
    self.current = self.fallback  # the running choice
    self.batches = 0
    self.total_ms = 0.0
    self.excess_ms = 0.0  # what batches of other choices cost beyond the running choice's
    self._cache: Dict[Any, Any] = {}  # estimates of this batch, read several times each
    self._previous: Any = self.current  # the last choice made

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
    """The running choice (the fallback before any batch)."""
    return self.current

  def _cached(self, key: Hashable, compute: Callable[[], Any]) -> Any:
    if key not in self._cache:
      self._cache[key] = compute()
    return self._cache[key]

  def alpha(self) -> Optional[float]:
    """The chains' acceptance in the job's recent speculative batches (the paper's: accepted
    over accepted and rejected draft tokens, a tree's lift taken off); before any, the
    calibration's (`prior_alpha`; None without a model)."""
    return self._cached('alpha', self._counted_alpha)

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
    or an acceptance)."""
    if self.model is None or self.alpha() is None:
      return None
    return costs.cheapest([c for c in self.choices if self.model.prices(c)], self._predicted_ms)

  def _predicted_ms(self, choice: Any) -> float:
    """The model's ms per output position of `choice` at the job's acceptance, for its recent
    batches' rows."""
    return self._cached(('predicted', choice), lambda: self.model.ms_per_position(
        choice, self.alpha(), lengths=self._lengths()))

  def _lengths(self) -> Optional[np.ndarray]:
    """The recent batches' rows' output positions [batches, rows] (None before any)."""
    def padded() -> Optional[np.ndarray]:
      if not self.lengths:
        return None
      rows = max(len(batch) for batch in self.lengths)  # (a short last batch: padding rows)
      out = np.zeros((len(self.lengths), rows), int)
      for i, batch in enumerate(self.lengths):
        out[i, :len(batch)] = batch
      return out
    return self._cached('lengths', padded)

  def _follows_model(self) -> bool:
    return not self.dropped and self.predicted() is not None

  def _blocks(self, choice: Any, last: Optional[int] = None) -> Dict[int, Tuple[int, float]]:
    """{block: (batches, mean log ms per position)} of `choice`'s kept batches (its last `last`
    if given), a block being `window` consecutive batches of the job."""
    numbers, logs = self.records[choice].arrays(last)
    blocks, inverse, counts = np.unique(numbers // self.window, return_inverse=True,
                                        return_counts=True)
    means = np.bincount(inverse, logs) / counts
    return {int(b): (int(n), float(m)) for b, n, m in zip(blocks, counts, means)}

  def _sigma(self) -> float:
    """The noise of one batch's log ms per position: its spread about its choice's mean in its
    block (the machine's drift across blocks left out), pooled over the choices; inf before a
    choice ran twice in a block."""
    def pooled() -> float:
      squares, dof = 0.0, 0
      for record in self.records.values():
        numbers, logs = record.arrays()
        for block in np.unique(numbers // self.window):
          within = logs[numbers // self.window == block]
          squares += float(np.sum((within - within.mean()) ** 2))
          dof += len(within) - 1
      return float(np.sqrt(squares / dof)) if dof else float('inf')
    return self._cached('sigma', pooled)

  def _gain(self, choice: Any) -> Optional[Gain]:
    """(log of the running choice's ms per position over `choice`'s: > 0 when `choice` is
    faster, its standard error), None before `choice` ran. Block by block (the machine's speed
    drifts by more than the differences sought): the blocks of its last `window` batches where
    the running choice ran too, each weighted by n m / (n + m) for their n and m batches."""
    def blocked() -> Optional[Gain]:
      if not self.records[choice].batches:
        return None
      if choice == self.current:
        return 0.0, 0.0
      theirs, ours = self._blocks(choice, self.window), self._blocks(self.current)
      common = [b for b in theirs if b in ours]
      if not common:
        return 0.0, float('inf')
      weights = np.array([theirs[b][0] * ours[b][0] / (theirs[b][0] + ours[b][0])
                          for b in common])
      differences = np.array([ours[b][1] - theirs[b][1] for b in common])
      return (float(np.dot(weights, differences) / weights.sum()),
              float(self._sigma() / np.sqrt(weights.sum())))
    return self._cached(('gain', choice, self.current), blocked)

  def _optimism(self, choice: Any) -> float:
    """How much faster `choice` may be: its gain plus Z standard errors (-inf untried)."""
    gain = self._gain(choice)
    return -float('inf') if gain is None else gain[0] + Z * gain[1]

  def _guards(self) -> bool:
    """Whether the plain decoder is timed beside the model's choice: the model predicts that
    choice faster by less than the model's error, the calibration's checked one (unchecked:
    always) or its error on the running choice in this job, whichever is larger."""
    plain = self.line[0]
    if plain == self.current or not self.model.prices(plain):
      return False
    checked = self.model_error if self.model_error is not None else float('inf')
    observed = np.log(self.records[self.current].cost / self._predicted_ms(self.current))
    gain = np.log(self._predicted_ms(plain) / self._predicted_ms(self.current))
    return bool(gain < max(checked, abs(observed) if np.isfinite(observed) else 0.0))

  def _update(self) -> None:
    """After a batch: the running choice. The model's pick, unless the guard finds the plain
    decoder surely faster (Z standard errors): then the model is dropped for the job. Without
    a model, the choice measured fastest."""
    if self._follows_model():
      self.current = self.predicted()
      if self._guards():
        gain = self._gain(self.line[0])
        if gain is not None and gain[0] - Z * gain[1] > 0:
          self.dropped, self.current = True, self.line[0]
      return
    gains = {c: self._gain(c) for c in self.line if c != self.current}
    faster = [c for c, gain in gains.items() if gain is not None and gain[0] > 0]
    if faster:
      self.records[self.current].interval = self.explore_every
      self.current = max(faster, key=lambda c: gains[c][0])

  def observe(self, choice: Any, seconds: float, decodes: Any,
              stats: Optional[Mapping[str, Any]] = None) -> None:
    """Records a decoded batch: its choice, wall seconds, decodes [batch, (beams,) length] and
    (for the model's acceptance) the decoder's per-row stats, `accepted` and `rollbacks`
    [batch]."""
    rows = row_positions(decodes)  # (one copy to the host, for both uses)
    positions, ms = longest(rows), 1e3 * seconds
    if self.model is not None and self.setting == 'gamma':
      self.lengths.append(rows.reshape(-1))  # (each of num_decodes a row)
      if choice and stats and 'accepted' in stats and 'rollbacks' in stats:
        self.counts.append((choice, _total(stats['accepted']), _total(stats['rollbacks'])))
    running = self.records[self.current]
    if choice != self.current and running.batches:
      self.excess_ms += ms - running.cost * positions
    self.records[choice].add(self.batches, ms, positions)
    horizon = (self.batches // self.window - self.window + 1) * self.window
    for record in self.records.values():  # (the last `window` blocks)
      record.forget_before(horizon)
    self.batches += 1
    self.total_ms += ms
    self._cache = {}
    if self.measured:
      self._update()

  def _next(self) -> Any:
    """The next batch's choice while no other choice than the running one is in flight: the
    running choice, the plain decoder beside the model's choice where the guard needs it and
    it is due (`_interval_up`: a short job never pays for the guard), or the bandit's
    (`_explore`)."""
    if not self.measured or not self.records[self.current].batches:
      return self.current  # the first batch, or the model's new choice
    if self._follows_model():
      plain = self.line[0]
      if self._guards() and self._interval_up(plain):
        self.records[plain].interval *= 2  # (guarding costs ever less)
        return plain
      return self.current
    if self.current not in self.line:  # (a tree the schedule named, before any acceptance)
      return self.current
    return self._explore()

  def _explore(self) -> Any:
    """The bandit's exploration: a measured choice that may be faster (the one that may gain
    most), the plain decoder untried, an untried neighbour downhill, or a due re-measure."""
    others = [c for c in self.line if c != self.current]
    hopeful = [c for c in others if self._optimism(c) > 0]
    if hopeful:
      return max(hopeful, key=self._optimism)
    plain = self.line[0]
    if plain != self.current and not self.records[plain].batches:
      return plain  # (time on it is never lost against decoding without speculation)
    i = self.line.index(self.current)
    for step in (1, -1):  # the more speculative first, where greedy decoding gains most
      j, k = i + step, i - step
      other_side = self.line[k::-step] if 0 <= k < len(self.line) else ()
      behind = [self._gain(c)[0] for c in other_side if self.records[c].batches]
      if (0 <= j < len(self.line) and not self.records[self.line[j]].batches and behind and
          behind[0] < 0):
        return self.line[j]  # the step from the other side saved time: keep going
    due = [c for c in others if self._due(c, i)]
    if not due:
      return self.current
    choice = min(due, key=lambda c: self.records[c].last)  # the longest unmeasured first
    self.records[choice].interval *= 2  # (re-measuring costs ever less)
    return choice

  def _interval_up(self, choice: Any) -> bool:
    """Whether `choice`'s interval (EXPLORE_EVERY, doubling each time it runs off the running
    choice) is up since its last batch or the job's start."""
    record = self.records[choice]
    return self.batches - record.last >= record.interval

  def _due(self, choice: Any, i: int) -> bool:
    """Whether `choice` is due for a (re-)measure: its interval is up (`_interval_up`), and,
    untried, it neighbours the running choice (line index i) or lies past a measured choice
    that may be faster."""
    record, j = self.records[choice], self.line.index(choice)
    if not self._interval_up(choice):
      return False
    if record.batches or abs(j - i) == 1:
      return True
    between = self.line[j - int(np.sign(j - i))]
    return self._optimism(between) > 0

  def choose(self, explore: bool = True) -> Any:
    """The choice for the next batch (the running one unless `explore`), process 0's in a
    multi-host job (all run one program)."""
    # (An exploration follows a batch of the running choice: its comparison, and in a loop
    # without batches in flight, the running choice's own progress.)
    explore = explore and self._previous == self.current
    choice = self._next() if explore else self.current
    self._previous = choice
    if self.measured and jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      index = multihost_utils.broadcast_one_to_all(np.int32(self.choices.index(choice)))
      choice = self.choices[int(index)]
    return choice

  def stream(self, items: Iterable[Any], run: Callable[[Any, Any], Any],
             prepare: Optional[Callable[[Any, Any], bool]] = None, in_flight: int = 2
             ) -> Iterator[Tuple[Any, Any, Any]]:
    """Decodes `items` in order, `in_flight` batches dispatched ahead: (item, choice, outputs).

    run(choice, item) -> (decodes, aux) dispatches a batch; its result is awaited only once
    `in_flight` later batches are dispatched, as a fixed decoder's loop over batches runs (the
    host's work on a batch overlaps the decoding of those before it, and on 2 cores two batches
    decode side by side: timing each batch alone cost the target alone 10% and gamma 3 5% at
    batch 1). A batch's time runs from the previous batch's result to its own: the job's wall
    time, shared out. Without a model the first batch is awaited before the next is chosen: the
    search starts from its time. With one, the first batch runs the model's choice, and the
    batches dispatched before it lands run it too: awaiting it alone cost a 6-batch job at
    batch 32 1-3% here (two batches side by side decode faster than one after the other).
    While a batch of another choice than the running one is in flight, the next batches run
    the running choice.
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
             not self.records[self.current].batches):
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
    """The measurements ({} for a fixed decoder): per choice tried, batches and ms per output
    position over its window; the best; whether the job ran only the fallback."""
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
    fastest, its predicted ms per output position of each choice, and whether the guard
    dropped it."""
    alpha = self.alpha()
    if self.model is None or alpha is None:
      return {}
    return {'model': {'alpha': round(alpha, 4), 'predicted_best': _json(self.predicted()),
                      'dropped': self.dropped,
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
  gives the batch size's model, which the policy follows likewise.
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
    trees_drafted = priced is not None and not model.draft_config.feature_width  # (chains only)
    tree_choices = tuple(priced.lifts) if trees_drafted else ()
    if isinstance(start, tuple) and start not in tree_choices:
      start = None  # a tree that this batch size's model does not price
    fallback = start if isinstance(start, tuple) else min(
        fallback_gamma(temperature, batch_size, max_gamma) if start is None else start,
        max_gamma)
    return (DecodingPolicy(range(max_gamma + 1), 'gamma', fallback, modelled=tree_choices,
                           **policy_kwargs),
            gamma_decoders(model, decode_kwargs, max_gamma, tree_choices))
  if (name == _name(beam_search.speculative_beam_search) and
      decode_kwargs.get('branching') == AUTO):
    priced = (calibration.model(batch_size) if calibration is not None and
              calibration.fits_beams(num_decodes) else None)
    fallback = TREES[0]
    if priced is not None:  # beam steps per call are the trees' lifts over an acceptance of 0
      policy_kwargs.setdefault('model', priced)
      policy_kwargs.setdefault('prior_alpha', 0.0)
      policy_kwargs.setdefault('model_error', calibration.errors.get(batch_size))
      fallback = priced.best(0.0, [t for t in TREES if priced.prices(t)])
    return (DecodingPolicy(TREES, 'branching', fallback, **policy_kwargs),
            tree_decoders(model, decode_kwargs))
  return DecodingPolicy((None,)), {None: model}


def fallback_gamma(temperature: Any, batch_size: Optional[int] = None,
                   max_gamma: int = MAX_GAMMA) -> int:
  """The gamma of an uncalibrated job's first batch: max_gamma for one row, else
  FALLBACK_GAMMA when greedy and SAMPLING_FALLBACK when sampling (the target alone above its
  rows, or for batches of an unknown size)."""
  if batch_size == 1:
    return max_gamma
  if np.all(np.asarray(temperature) == 0.0):
    return FALLBACK_GAMMA
  rows, gamma = SAMPLING_FALLBACK
  return gamma if batch_size is not None and batch_size <= rows else 0


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

