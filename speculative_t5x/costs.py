"""A model of a speculative decode's time: measured step costs and observed acceptance.

The first paper chooses gamma from expected tokens per target call over a call's cost; this is
that model with the costs measured on the machine instead of assumed. One iteration of a decode
loop at one batch size costs

  gamma = 0 (the target alone):  target(1) + plain overhead
  gamma >= 1:                    draft(2) + (gamma - 1) draft(1) + target(gamma + 1)
                                 + overhead + gamma * overhead per draft token

where target(k) / draft(k) are one cached step appending k tokens per row, measured in
isolation (`calibrate.step_costs`; a draft phase's first call feeds 2 tokens), as are the
encoders a batch runs once; the overheads are what a real loop's iteration costs beyond its
steps (sampling, acceptance, cache bookkeeping, dispatch), fitted from a few real loops (`fit`). An iteration emits on average
(1 - a^(gamma + 1)) / (1 - a) tokens per row, a the acceptance; a batch's loop runs until its
longest row is done, so the acceptance that predicts a batch is an effective one, solved from
the batch's own count (`effective_alpha`: output positions / loop iterations) -- it absorbs the
spread of the rows. Time per output position is iteration ms over tokens per iteration, plus
what a batch costs once (the encoders, the dispatch) over its positions.

A draft token tree (`trees.tree_speculative_sample`, branching b0, b1, ...) is priced the same
way from its call shape (`call_shape`: one draft call per level, the first feeding 2 tokens and
level d its b0...b(d-1) nodes; one target call over all 1 + b0 + b0 b1 + ... nodes) and an
acceptance lift: its effective acceptance (solved at its depth) above the chains', measured by a
calibration that runs it (`tree_lifts`). A gamma is the chain (1,) * gamma.

Counting is exact where timing is noisy: a policy that knows the step costs follows a change
of acceptance from one batch's counts, where telling two gammas 4% apart by their batch times
takes dozens of batches.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

# A decoder choice: a gamma (0: the target alone) or a draft tree's branching.
Choice = Union[int, Tuple[int, ...]]


def branching(choice: Choice) -> Tuple[int, ...]:
  """A choice's draft tree: gamma g is the chain (1,) * g (0: no draft), a tree its branching."""
  return tuple(int(b) for b in choice) if isinstance(choice, tuple) else (1,) * int(choice)


def depth(choice: Choice) -> int:
  """Draft tokens on a root-to-leaf path: gamma, or the tree's levels."""
  return len(branching(choice))


def call_shape(choice: Choice) -> Tuple[Tuple[int, ...], int]:
  """(tokens per row of each draft call, of the target's call) in one loop iteration: the first
  draft call feeds 2 tokens (the token before the root, which the cache lacks after a path
  through a leaf, and the root), level d of a tree its b0...b(d-1) nodes; the target scores every
  node. The target alone: ((), 1)."""
  widths = np.cumprod(branching(choice)).astype(int)  # nodes per level below the root
  if not len(widths):
    return (), 1
  return (2,) + tuple(int(w) for w in widths[:-1]), 1 + int(widths.sum())


def choice_name(choice: Choice) -> str:
  """A choice as JSON keys and tables name it: '3', or '(2,1,1)' for a tree."""
  if isinstance(choice, tuple):
    return '(' + ','.join(str(b) for b in choice) + ')'
  return str(int(choice))


def parse_choice(name: Any) -> Choice:
  """The inverse of `choice_name` (an int or a list/tuple also pass); ValueError otherwise."""
  if isinstance(name, (list, tuple)):
    return tuple(int(b) for b in name)
  text = str(name).strip()
  if text.startswith('('):
    return tuple(int(b) for b in text.strip('()').split(',') if b.strip())
  return int(text)


def expected_tokens(alpha: float, gamma: int) -> float:
  """The paper's expected output tokens per target call: (1 - alpha^(gamma + 1)) / (1 - alpha)."""
  if alpha >= 1.0:
    return float(gamma + 1)
  return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def effective_alpha(tokens_per_iteration: float, gamma: int) -> float:
  """The acceptance a with expected_tokens(a, gamma) == tokens_per_iteration (clipped to the
  achievable range [1, gamma + 1]); bisection, as the map is increasing in a."""
  if gamma < 1:
    raise ValueError(f'effective_alpha needs gamma >= 1, got {gamma}.')
  target = min(max(tokens_per_iteration, 1.0), gamma + 1.0)
  low, high = 0.0, 1.0
  for _ in range(50):
    mid = (low + high) / 2
    low, high = (mid, high) if expected_tokens(mid, gamma) < target else (low, mid)
  return (low + high) / 2


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """What one batch size's decode is made of, in ms (module docstring).

  target_ms: {k: one cached target step appending k tokens per row}, k = 1..max gamma + 1 and
    the node counts of the trees priced.
  draft_ms: {k: a draft step of k tokens per row}: 1, 2 and the trees' level widths.
  batch_ms: what a batch costs once: both encoders and their caches, measured in isolation
    (host work and dispatch go into the fitted overheads).
  plain_overhead_ms, overhead_ms, overhead_per_token_ms: fitted from real loops (`fit`); a tree
    pays overhead_per_token_ms per level.
  lifts: {tree branching: its effective acceptance above the chains'} (`tree_lifts`): the trees
    this model prices.
  """
  batch_size: int
  target_ms: Mapping[int, float]
  draft_ms: Mapping[int, float]
  batch_ms: float = 0.0
  plain_overhead_ms: float = 0.0
  overhead_ms: float = 0.0
  overhead_per_token_ms: float = 0.0
  lifts: Mapping[Tuple[int, ...], float] = dataclasses.field(default_factory=dict)

  @property
  def max_gamma(self) -> int:
    """The largest gamma whose verify steps 1..gamma + 1 are all measured."""
    gamma = 0
    while gamma + 2 in self.target_ms:
      gamma += 1
    return gamma

  def choices(self) -> List[Choice]:
    """What the model prices: gammas 0..max_gamma, then its trees."""
    return list(range(self.max_gamma + 1)) + list(self.lifts)

  def prices(self, choice: Choice) -> bool:
    """Whether every step of `choice` is measured (and, for a tree, its lift)."""
    if isinstance(choice, tuple) and choice and choice not in self.lifts:
      return False  # (() is beam search itself: a plain decoder)
    draft, target = call_shape(choice)
    return target in self.target_ms and all(k in self.draft_ms for k in draft)

  def steps_ms(self, choice: Choice) -> float:
    """The steps of one iteration of `choice` (0: the target alone), without loop overhead."""
    draft, target = call_shape(choice)
    if target not in self.target_ms:
      raise ValueError(f'no measured {target}-token target step (max gamma '
                       f'{self.max_gamma}).')
    return sum(self.draft_ms[k] for k in draft) + self.target_ms[target]

  def iteration_ms(self, choice: Choice) -> float:
    if not branching(choice):
      return self.steps_ms(0) + self.plain_overhead_ms
    return (self.steps_ms(choice) + self.overhead_ms +
            depth(choice) * self.overhead_per_token_ms)

  def tokens(self, choice: Choice, alpha: float) -> float:
    """Expected output tokens per iteration of `choice` at the chains' acceptance `alpha`."""
    if not branching(choice):
      return 1.0
    lift = self.lifts.get(choice, 0.0) if isinstance(choice, tuple) else 0.0
    return expected_tokens(min(max(alpha + lift, 0.0), 1.0), depth(choice))

  def ms_per_position(self, choice: Choice, alpha: float, positions: float = 0.0) -> float:
    """Predicted ms per output position of `choice` with acceptance `alpha` (effective: see
    `effective_alpha`), the batch's one-off cost spread over `positions` when given."""
    once = self.batch_ms / positions if positions else 0.0
    return self.iteration_ms(choice) / self.tokens(choice, alpha) + once

  def best(self, alpha: float, choices: Optional[Iterable[Choice]] = None) -> Choice:
    """The choice with the lowest predicted ms per position (ties: the shallower, then the
    smaller tree); by default every gamma and tree the model prices."""
    choices = self.choices() if choices is None else choices
    return min(choices, key=lambda c: (self.ms_per_position(c, alpha), depth(c),
                                       call_shape(c)[1]))

  def to_json(self) -> Dict[str, Any]:
    out = dataclasses.asdict(self)
    for name in ('target_ms', 'draft_ms'):
      out[name] = {str(k): v for k, v in getattr(self, name).items()}
    out['lifts'] = {choice_name(k): v for k, v in self.lifts.items()}
    return out

  @classmethod
  def from_json(cls, values: Mapping[str, Any]) -> 'StepCosts':
    values = dict(values)
    values['target_ms'] = {int(k): float(v) for k, v in values['target_ms'].items()}
    values['draft_ms'] = {int(k): float(v) for k, v in values['draft_ms'].items()}
    values['lifts'] = {parse_choice(k): float(v) for k, v in values.get('lifts', {}).items()}
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class LoopRun:
  """Real loops of one choice (a gamma or a tree) over some batches: their wall ms (encoders
  included), loop iterations (the batch's most target calls of a row) and output positions (its
  longest row), summed over the batches."""
  gamma: Choice
  batches: int
  ms: float
  iterations: int
  positions: int

  @property
  def tokens_per_iteration(self) -> float:
    return self.positions / max(self.iterations, 1)

  @property
  def ms_per_position(self) -> float:
    return self.ms / max(self.positions, 1)


def fit(costs: StepCosts, runs: Sequence[LoopRun]) -> StepCosts:
  """`costs` with the loops' overheads fitted to `runs`: the target alone's per iteration from
  its runs, the speculative loop's (fixed and per draft token) by least squares on
  ms - batches * batch_ms - iterations * steps = iterations * (overhead + gamma * per token),
  each run weighted by 1 / ms (relative errors count alike); negative fits clipped to 0.

  Needs the plain decoder (gamma 0; beam search itself, ()) and a speculative choice; two or
  more depths fit the growth with depth, one depth leaves it 0. A sampling calibration fits
  chains and checks its trees against the fit; a beam search one fits its trees (all depth 1).
  """
  names = sorted(choice_name(r.gamma) for r in runs)
  if all(branching(r.gamma) for r in runs) or not any(branching(r.gamma) for r in runs):
    raise ValueError(f'fit needs gamma 0 and a speculative gamma, got {names}.')

  def rest(r: LoopRun) -> float:  # what the run's loop iterations cost beyond their steps
    return r.ms - r.batches * costs.batch_ms - r.iterations * costs.steps_ms(r.gamma)

  plain = [r for r in runs if not branching(r.gamma)]
  plain_overhead = sum(rest(r) for r in plain) / sum(r.iterations for r in plain)
  spec = [r for r in runs if branching(r.gamma)]
  columns = [[r.iterations for r in spec]]
  if len({depth(r.gamma) for r in spec}) > 1:
    columns.append([r.iterations * depth(r.gamma) for r in spec])
  weights = np.array([1 / r.ms for r in spec])
  solution = np.linalg.lstsq(np.array(columns, float).T * weights[:, None],
                             np.array([rest(r) for r in spec]) * weights, rcond=None)[0]
  overhead, per_token = (list(np.maximum(solution, 0.0)) + [0.0])[:2]
  return dataclasses.replace(costs, plain_overhead_ms=max(float(plain_overhead), 0.0),
                             overhead_ms=float(overhead), overhead_per_token_ms=float(per_token))


def check(costs: StepCosts, runs: Sequence[LoopRun], alpha: float
          ) -> Dict[Choice, Dict[str, float]]:
  """Predicted against measured ms per output position for each run: {choice: {predicted,
  measured, error}} (error = predicted / measured - 1), the batches' positions and `alpha`
  (effective) given."""
  out = {}
  for r in runs:
    predicted = (r.batches * costs.batch_ms + r.positions * costs.ms_per_position(r.gamma, alpha)
                 ) / r.positions
    out[r.gamma] = dict(predicted=predicted, measured=r.ms_per_position,
                        error=predicted / r.ms_per_position - 1.0)
  return out


def pooled_alpha(runs: Sequence[LoopRun]) -> float:
  """The effective acceptance of the speculative chains' runs: each run's solved from its
  tokens per iteration, weighted by its iterations."""
  spec = [r for r in runs if not isinstance(r.gamma, tuple) and r.gamma > 0]
  if not spec:
    raise ValueError('pooled_alpha needs a speculative run.')
  weights = np.array([r.iterations for r in spec], float)
  alphas = np.array([effective_alpha(r.tokens_per_iteration, r.gamma) for r in spec])
  return float(np.sum(weights * alphas) / max(weights.sum(), 1.0))


def chain_alpha(choice: Choice, tokens_per_iteration: float,
                lifts: Mapping[Tuple[int, ...], float]) -> float:
  """The chains' effective acceptance that a run of `choice` counted: solved at its depth, less
  a tree's lift."""
  lift = lifts.get(choice, 0.0) if isinstance(choice, tuple) else 0.0
  return effective_alpha(tokens_per_iteration, depth(choice)) - lift


def tree_lifts(runs: Sequence[LoopRun], alpha: float) -> Dict[Tuple[int, ...], float]:
  """{tree: its effective acceptance (solved at its depth from its run's tokens per iteration)
  above the chains' `alpha`}: what a tree's extra children keep, for `StepCosts.lifts`."""
  return {r.gamma: effective_alpha(r.tokens_per_iteration, depth(r.gamma)) - alpha
          for r in runs if isinstance(r.gamma, tuple) and r.gamma}


Schedule = Mapping[int, Choice]  # batch size -> gamma or token tree


def scheduled(schedule: Schedule, batch_size: int) -> Optional[Choice]:
  """The schedule's choice for `batch_size`: its own entry, else the nearest calibrated batch
  size's (by ratio; ties: the smaller); None for an empty schedule."""
  if not schedule:
    return None
  nearest = batch_size if batch_size in schedule else min(
      schedule, key=lambda b: (abs(np.log(b / batch_size)), b))
  return parse_choice(schedule[nearest])


def parse_schedule(values: Mapping[Any, Any]) -> Dict[int, Choice]:
  """A schedule from gin or JSON ({batch size: gamma or tree}: keys ints, values a gamma, a
  branching as a tuple or list, or its `choice_name`); raises ValueError naming the entry that
  is not a positive batch size with a gamma >= 0 or a tree of positive branching."""
  out = {}
  for key, value in values.items():
    try:
      batch_size, choice = int(key), parse_choice(value)
    except (TypeError, ValueError):
      raise ValueError(f'schedule entry {key!r}: {value!r} is not batch_size: gamma (or a '
                       'token tree, e.g. (2, 1))') from None
    tree = isinstance(choice, tuple)
    if batch_size < 1 or (tree and (not choice or min(choice) < 1)) or (not tree and choice < 0):
      raise ValueError(f'schedule entry {key!r}: {value!r}: batch size must be >= 1, gamma >= 0 '
                       'and a tree\'s branching positive')
    out[batch_size] = choice
  return out


@dataclasses.dataclass(frozen=True)
class Calibration:
  """What speculative-t5x-calibrate measured (its calibration.json): {batch size: choice} and
  {batch size: the fitted model} and {batch size: the acceptance it measured}, at `temperature`
  (a sampling loop's overheads and acceptance are not a greedy one's), or for beam search at
  `beam_size` (then the schedule is empty: each model prices beam search itself, (), and its
  trees, their beam steps per call as lifts over an acceptance of 0)."""
  schedule: Dict[int, Choice]
  models: Dict[int, StepCosts]
  temperature: float = 0.0
  alphas: Dict[int, float] = dataclasses.field(default_factory=dict)  # effective, per batch size
  beam_size: int = 0  # 0: made for gamma (speculative_sample)
  # Per batch size, the model's largest |relative error| where its check timed every choice it
  # prices (`DecodingPolicy.model_error`).
  errors: Dict[int, float] = dataclasses.field(default_factory=dict)

  def fits(self, temperature: Any) -> bool:
    """Whether a speculative_sample job at `temperature` (a scalar or per row) was calibrated
    for: a gamma calibration, every row at the calibrated temperature."""
    return not self.beam_size and bool(
        np.all(np.asarray(temperature, np.float32) == np.float32(self.temperature)))

  def fits_beams(self, beam_size: int) -> bool:
    """Whether a beam search job of `beam_size` beams was calibrated for."""
    return self.beam_size > 0 and self.beam_size == beam_size

  def model(self, batch_size: int) -> Optional[StepCosts]:
    """The model of exactly this batch size (step costs do not carry to another)."""
    return self.models.get(batch_size)


def load_calibration(path: os.PathLike) -> Calibration:
  """Reads a calibration.json; raises ValueError naming the file when it is not one."""
  try:
    values = json.loads(open(path, encoding='utf-8').read())
    return Calibration(parse_schedule(values['schedule']), {
        int(b): StepCosts.from_json(block['costs'])
        for b, block in values['batch_sizes'].items()}, float(values.get('temperature', 0.0)),
        {int(b): float(block['alpha']) for b, block in values['batch_sizes'].items()
         if block.get('alpha') is not None}, int(values.get('beam_size', 0)),
        {int(b): max(abs(c['error']) for c in block['check'].values())
         for b, block in values['batch_sizes'].items()
         if block.get('check') and set(block['predicted_ms_per_position']) <= set(block['check'])})
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f'{path} is not a readable calibration.json from '
                     f'speculative-t5x-calibrate ({type(e).__name__}: {e})') from None
