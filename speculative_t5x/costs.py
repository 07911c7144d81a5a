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
steps (sampling, acceptance, cache bookkeeping, dispatch), fitted from a few real loops (`fit`).

An iteration emits per row 1 + a run of accepted draft tokens, each accepted at a, the paper's
acceptance (accepted / (accepted + rejected) draft tokens, which the decoders count exactly:
`row_alpha`), (1 - a^(gamma + 1)) / (1 - a) tokens on average. A batch's loop runs until its
slowest row is done: `batch_iterations` is the expected most of its rows' iterations, from
their output positions (a row's last iteration is cut short by its end, and 32 rows racing
take more iterations than one), times a `spread` fitted to the calibration's loops (rows do
not all accept alike). Time per output position is a batch's iterations times iteration ms,
plus what it costs once (the encoders), over its longest row's positions. Without rows (beam
search, whose tokens per iteration are beam steps per call) the per-row formula serves, at an
effective acceptance solved from tokens per iteration (`effective_alpha`).

Where a calibration also timed a choice's real loop (`check`), the model's prediction for it
is scaled by what that loop measured over what the model predicted for it (`corrections`): the
fit's few terms miss what one shape costs of its own (an XLA fusion, a verify call that
streams no more weights than a shorter one), and at batch 32 the fitted model ranked gamma 3
0.4% ahead of gamma 2 where its loops ran gamma 2 3.2% faster (and a later job 8%). The model
still carries a choice's time to another acceptance and other rows; the check's error, before
the correction, stays the model's error.

A draft token tree (`trees.tree_speculative_sample`, branching b0, b1, ...) is priced the same
way from its call shape (`call_shape`: one draft call per level, the first feeding 2 tokens and
level d its b0...b(d-1) nodes; one target call over all 1 + b0 + b0 b1 + ... nodes), the
overhead per draft token paid for each of its b0 + b0 b1 + ... proposed nodes (`proposed`:
each is sampled, drawn from and walked as a chain's token is), and an acceptance lift: its
acceptance above the chains', counted by a calibration that runs it (`tree_lifts`). A gamma is
the chain (1,) * gamma.

Counting is exact where timing is noisy: a policy that knows the step costs follows a change
of acceptance from one batch's counts, where telling two gammas 4% apart by their batch times
takes dozens of batches.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
from typing import (Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple,
                    Union)

import numpy as np

# A decoder choice: a gamma (0: the target alone) or a draft tree's branching.
Choice = Union[int, Tuple[int, ...]]


@functools.lru_cache(maxsize=None)  # (the policy asks it of its few choices many times a batch)
def branching(choice: Choice) -> Tuple[int, ...]:
  """A choice's draft tree: gamma g is the chain (1,) * g (0: no draft), a tree its branching."""
  return tuple(int(b) for b in choice) if isinstance(choice, tuple) else (1,) * int(choice)


def proposed(choice: Choice) -> int:
  """Draft tokens proposed per loop iteration: gamma, or the tree's nodes below the root."""
  return call_shape(choice)[1] - 1


def depth(choice: Choice) -> int:
  """Draft tokens on a root-to-leaf path: gamma, or the tree's levels."""
  return len(branching(choice))


@functools.lru_cache(maxsize=None)  # (likewise)
def call_shape(choice: Choice, feature_draft: bool = False) -> Tuple[Tuple[int, ...], int]:
  """(tokens per row of each draft call, of the target's call) in one loop iteration: the first
  draft call feeds 2 tokens (the token before the root, which the cache lacks after a path
  through a leaf, and the root), a feature draft's gamma + 1 (it rewrites the positions it
  drafted on its own features); level d of a tree its b0...b(d-1) nodes; the target scores
  every node. The target alone: ((), 1)."""
  widths = np.cumprod(branching(choice)).astype(int)  # nodes per level below the root
  if not len(widths):
    return (), 1
  first = len(widths) + 1 if feature_draft else 2
  return (first,) + tuple(int(w) for w in widths[:-1]), 1 + int(widths.sum())


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


def row_alpha(accepted: float, rejected: float) -> float:
  """The paper's acceptance: accepted / (accepted + rejected) draft tokens (a call's first
  rejection ends its run, so this is the rate of a run of acceptances); 0 without any."""
  return accepted / (accepted + rejected) if accepted + rejected else 0.0


@functools.lru_cache(maxsize=1024)
def _done_within(alpha: float, depth: int, max_length: int) -> np.ndarray:
  """[n, L] for n, L = 0..max_length: the probability that a row of L output positions is done
  within n loop iterations, each emitting 1 + a run of acceptances (each alpha, at most
  `depth`): a recurrence over the positions emitted so far (capped at max_length)."""
  emit = np.array([alpha ** (k - 1) * (1 - alpha) for k in range(1, depth + 1)] +
                  [alpha ** depth])  # P(k positions), k = 1..depth + 1
  emitted = np.zeros(max_length + 1)
  emitted[0] = 1.0
  out = np.empty((max_length + 1, max_length + 1))
  for n in range(max_length + 1):
    out[n] = np.cumsum(emitted[::-1])[::-1]  # P(emitted >= L)
    after = np.zeros_like(emitted)
    after[max_length] = emitted[max_length]
    for k, p in enumerate(emit, start=1):
      after[k:max_length] += p * emitted[:max(max_length - k, 0)]
      after[max_length] += p * emitted[max(max_length - k, 0):max_length].sum()
    emitted = after
  return out


def batch_iterations(lengths: Any, alpha: float, depth: int) -> np.ndarray:
  """Expected loop iterations of each batch of rows with `lengths` output positions ([batches,
  rows]; 0 for padding rows), every row accepting at `alpha`: the expected most of its rows'
  (a batch's loop runs until its slowest row is done). Exact under that model, linear in
  alpha between tables at steps of 0.01 (computed once each)."""
  lengths = np.atleast_2d(np.asarray(lengths, int))
  top = max(16, 1 << (int(lengths.max()) - 1).bit_length())  # a few table sizes
  grid = min(max(alpha, 0.0), 1.0) * 100
  low = min(int(grid), 99)

  def expected(a: float) -> np.ndarray:
    done = _done_within(round(a, 2), depth, top)[:, lengths]  # [n, batches, rows]
    return (1.0 - done.prod(axis=-1)).sum(axis=0)

  weight = grid - low
  return (1 - weight) * expected(low / 100) + weight * expected((low + 1) / 100)


def cheapest(choices: Iterable[Choice], price: Callable[[Choice], float]) -> Choice:
  """The choice of the lowest price (ties: the shallower, then the smaller tree)."""
  return min(choices, key=lambda c: (price(c), depth(c), call_shape(c)[1]))


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """What one batch size's decode is made of, in ms (module docstring).

  target_ms: {k: one cached target step appending k tokens per row}, k = 1..max gamma + 1 and
    the node counts of the trees priced.
  draft_ms: {k: a draft step of k tokens per row}: 1, 2 and the trees' level widths (a feature
    draft's: 1..max gamma + 1).
  batch_ms: what a batch costs once: both encoders and their caches, measured in isolation
    (host work and dispatch go into the fitted overheads).
  plain_overhead_ms, overhead_ms, overhead_per_token_ms: fitted from real loops (`fit`); a tree
    pays overhead_per_token_ms per proposed node.
  lifts: {tree branching: its acceptance above the chains'} (`tree_lifts`): the trees this
    model prices.
  spread: a batch's measured loop iterations over `batch_iterations`' (`fit_spread`): the rows
    of a batch do not all accept alike, and its slowest rows set its iterations.
  corrections: {choice: its calibration loop's measured ms per position over the model's
    prediction for it} (`corrected`), a factor on that choice's predictions; 1 for the others.
  """
  batch_size: int
  target_ms: Mapping[int, float]
  draft_ms: Mapping[int, float]
  batch_ms: float = 0.0
  plain_overhead_ms: float = 0.0
  overhead_ms: float = 0.0
  overhead_per_token_ms: float = 0.0
  lifts: Mapping[Tuple[int, ...], float] = dataclasses.field(default_factory=dict)
  spread: float = 1.0
  corrections: Mapping[Choice, float] = dataclasses.field(default_factory=dict)
  feature_draft: bool = False  # (its first draft call: `call_shape`)

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
    draft, target = call_shape(choice, self.feature_draft)
    return target in self.target_ms and all(k in self.draft_ms for k in draft)

  def steps_ms(self, choice: Choice) -> float:
    """The steps of one iteration of `choice` (0: the target alone), without loop overhead."""
    draft, target = call_shape(choice, self.feature_draft)
    if target not in self.target_ms:
      raise ValueError(f'no measured {target}-token target step (max gamma '
                       f'{self.max_gamma}).')
    return sum(self.draft_ms[k] for k in draft) + self.target_ms[target]

  def iteration_ms(self, choice: Choice) -> float:
    if not branching(choice):
      return self.steps_ms(0) + self.plain_overhead_ms
    return (self.steps_ms(choice) + self.overhead_ms +
            proposed(choice) * self.overhead_per_token_ms)

  def acceptance(self, choice: Choice, alpha: float) -> float:
    """The per-token acceptance of `choice` at the chains' `alpha`: a tree's with its lift."""
    lift = self.lifts.get(choice, 0.0) if isinstance(choice, tuple) else 0.0
    return min(max(alpha + lift, 0.0), 1.0)

  def tokens(self, choice: Choice, alpha: float, lengths: Optional[Any] = None) -> float:
    """Expected output tokens per iteration of `choice` at the chains' acceptance `alpha`: per
    row (the paper's formula), or with `lengths` ([batches, rows] or [rows] output positions)
    per iteration of those batches' loops, which run until their longest row is done
    (`batch_iterations`, times `spread`)."""
    if not branching(choice):
      return 1.0
    if lengths is None:
      return expected_tokens(self.acceptance(choice, alpha), depth(choice))
    lengths = np.atleast_2d(lengths)
    return float(lengths.max(axis=1).sum() / (self.spread * batch_iterations(
        lengths, self.acceptance(choice, alpha), depth(choice)).sum()))

  def ms_per_position(self, choice: Choice, alpha: float, positions: float = 0.0,
                      lengths: Optional[Any] = None) -> float:
    """Predicted ms per output position of `choice` at acceptance `alpha`, the batch's one-off
    cost spread over `positions` when given; with `lengths` (rows' output positions of one or
    more batches, [batches, rows]) over those batches, alpha then the paper's (`row_alpha`),
    else an effective one (`effective_alpha`); times the choice's correction (`corrections`)."""
    if lengths is not None:
      positions = float(np.atleast_2d(lengths).max(axis=1).mean())
    once = self.batch_ms / positions if positions else 0.0
    return ((self.iteration_ms(choice) / self.tokens(choice, alpha, lengths) + once) *
            self.corrections.get(choice, 1.0))

  def best(self, alpha: float, choices: Optional[Iterable[Choice]] = None,
           lengths: Optional[Any] = None) -> Choice:
    """The choice with the lowest predicted ms per position (ties: the shallower, then the
    smaller tree); by default every gamma and tree the model prices."""
    return cheapest(self.choices() if choices is None else choices,
                    lambda c: self.ms_per_position(c, alpha, lengths=lengths))

  def to_json(self) -> Dict[str, Any]:
    out = dataclasses.asdict(self)
    for name in ('target_ms', 'draft_ms'):
      out[name] = {str(k): v for k, v in getattr(self, name).items()}
    out['lifts'] = {choice_name(k): v for k, v in self.lifts.items()}
    out['corrections'] = {choice_name(k): v for k, v in self.corrections.items()}
    return out

  @classmethod
  def from_json(cls, values: Mapping[str, Any]) -> 'StepCosts':
    values = dict(values)
    values['target_ms'] = {int(k): float(v) for k, v in values['target_ms'].items()}
    values['draft_ms'] = {int(k): float(v) for k, v in values['draft_ms'].items()}
    for name in ('lifts', 'corrections'):  # (a calibration before corrections has none)
      values[name] = {parse_choice(k): float(v) for k, v in values.get(name, {}).items()}
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class LoopRun:
  """Real loops of one choice (a gamma or a tree) over some batches: their wall ms (encoders
  included), loop iterations (the batch's most target calls of a row) and output positions (its
  longest row), summed over the batches; the draft tokens its rows accepted and the calls that
  rejected one, and each batch's rows' output positions (none for beam search)."""
  gamma: Choice
  batches: int
  ms: float
  iterations: int
  positions: int
  accepted: int = 0
  rejected: int = 0
  lengths: Tuple[Tuple[int, ...], ...] = ()

  @property
  def alpha(self) -> float:
    """The paper's acceptance its rows counted (`row_alpha`)."""
    return row_alpha(self.accepted, self.rejected)

  @property
  def tokens_per_iteration(self) -> float:
    return self.positions / max(self.iterations, 1)

  @property
  def ms_per_position(self) -> float:
    return self.ms / max(self.positions, 1)


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """x >= 0 minimising |a x - b| for the few columns of a fit (every subset of columns tried).

  Clipping a negative least-squares term to 0 would leave the others fitted beside it: at T=1
  batch 1 the per-draft-token overhead fitted negative, and the fixed overhead fitted with it
  over-priced gamma 4, one of the fit's own loops, by 12%.
  """
  columns = a.shape[1]
  best, best_residual = np.zeros(columns), float(np.sum(b ** 2))
  for k in range(1, columns + 1):
    for subset in itertools.combinations(range(columns), k):
      x = np.zeros(columns)
      x[list(subset)] = np.linalg.lstsq(a[:, list(subset)], b, rcond=None)[0]
      residual = float(np.sum((a @ x - b) ** 2))
      if x.min() >= 0 and residual < best_residual - 1e-12 * max(best_residual, 1.0):
        best, best_residual = x, residual
  return best


def fit(costs: StepCosts, runs: Sequence[LoopRun]) -> StepCosts:
  """`costs` with the loops' overheads fitted to `runs`: the target alone's per iteration from
  its runs, the speculative loop's (fixed and per draft token) by least squares on
  ms - batches * batch_ms - iterations * steps = iterations * (overhead + proposed * per token),
  each run weighted by 1 / ms (relative errors count alike), neither overhead negative
  (`nonnegative_lstsq`).

  Needs the plain decoder (gamma 0; beam search itself, ()) and a speculative choice; two or
  more numbers of proposed tokens fit the growth with them, one leaves it 0. A sampling
  calibration fits chains and checks its trees against the fit; a beam search one fits its
  trees (one level of 1 to 8 nodes).
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
  if len({proposed(r.gamma) for r in spec}) > 1:
    columns.append([r.iterations * proposed(r.gamma) for r in spec])
  weights = np.array([1 / r.ms for r in spec])
  overhead, per_token = (list(nonnegative_lstsq(np.array(columns, float).T * weights[:, None],
                                                np.array([rest(r) for r in spec]) * weights))
                         + [0.0])[:2]
  return dataclasses.replace(costs, plain_overhead_ms=max(float(plain_overhead), 0.0),
                             overhead_ms=float(overhead), overhead_per_token_ms=float(per_token))


def check(costs: StepCosts, runs: Sequence[LoopRun], alpha: float
          ) -> Dict[Choice, Dict[str, float]]:
  """Predicted against measured ms per output position for each run: {choice: {predicted,
  measured, error}} (error = predicted / measured - 1), the acceptance `alpha` and the runs'
  rows' output positions given (without them, their longest rows' and an effective alpha)."""
  out = {}
  for r in runs:
    if r.lengths:
      predicted = costs.ms_per_position(r.gamma, alpha, lengths=r.lengths)
    else:
      predicted = costs.ms_per_position(r.gamma, alpha, r.positions / r.batches)
    out[r.gamma] = dict(predicted=predicted, measured=r.ms_per_position,
                        error=predicted / r.ms_per_position - 1.0)
  return out


def corrected(costs: StepCosts, checked: Mapping[Choice, Mapping[str, float]]) -> StepCosts:
  """`costs` with each choice that `check` timed corrected by its measured over predicted ms
  per position (`StepCosts.corrections`; `checked` is `check`'s answer for the uncorrected
  model)."""
  return dataclasses.replace(costs, corrections={
      c: v['measured'] / v['predicted'] for c, v in checked.items() if v['predicted'] > 0})


def pooled_alpha(runs: Sequence[LoopRun]) -> float:
  """The paper's acceptance over the speculative chains' runs: their accepted draft tokens over
  accepted and rejected."""
  spec = [r for r in runs if not isinstance(r.gamma, tuple) and r.gamma > 0]
  if not spec:
    raise ValueError('pooled_alpha needs a speculative run.')
  return row_alpha(sum(r.accepted for r in spec), sum(r.rejected for r in spec))


def chain_alpha(choice: Choice, accepted: float, rejected: float,
                lifts: Mapping[Tuple[int, ...], float]) -> float:
  """The chains' acceptance that a batch of `choice` counted: its own less a tree's lift."""
  lift = lifts.get(choice, 0.0) if isinstance(choice, tuple) else 0.0
  return row_alpha(accepted, rejected) - lift


def tree_lifts(runs: Sequence[LoopRun], alpha: float) -> Dict[Tuple[int, ...], float]:
  """{tree: its acceptance above the chains' `alpha`}, what a tree's extra children keep, for
  `StepCosts.lifts`: the paper's acceptance its run counted, or where a run counts none (beam
  search, whose tokens per iteration are beam steps per call) the effective one solved at its
  depth."""
  return {r.gamma: (r.alpha if r.accepted + r.rejected else
                    effective_alpha(r.tokens_per_iteration, depth(r.gamma))) - alpha
          for r in runs if isinstance(r.gamma, tuple) and r.gamma}


def fit_spread(costs: StepCosts, runs: Sequence[LoopRun], alpha: float) -> float:
  """`StepCosts.spread`: the speculative runs' loop iterations over what `batch_iterations`
  predicts for their batches at `alpha` (1 without rows' lengths)."""
  spec = [r for r in runs if branching(r.gamma) and r.lengths]
  if not spec:
    return 1.0
  predicted = sum(float(np.sum(batch_iterations(r.lengths, costs.acceptance(r.gamma, alpha),
                                                depth(r.gamma)))) for r in spec)
  return sum(r.iterations for r in spec) / predicted


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
  alphas: Dict[int, float] = dataclasses.field(default_factory=dict)  # the paper's, per batch size
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
