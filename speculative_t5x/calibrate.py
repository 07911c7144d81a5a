"""Calibrates gamma for a pair on this machine: step costs, a few real loops, a schedule.

  speculative-t5x-calibrate --output_dir /tmp/calibration            (test captions, greedy)
  speculative-t5x-calibrate --input_file my_inputs.txt --batch_sizes 1,16 --temperature 1
  (or python -m speculative_t5x.calibrate ...)

For each batch size, on the first --sentences inputs (one per line of --input_file, or
Multi30k's test captions): the target's cached step for 1..max_gamma+1 tokens per row, the
draft's and the encoders, each in isolation (`probes`), and the real decode loops of
--fit_gammas (the target alone and two speculative gammas by default), the probes taking turns
in round-robin rounds, then the loops in theirs; from them the `costs.StepCosts` model of every
gamma, its overheads fitted to the loops, and the acceptance the loops counted. --check times
every other gamma's loop with them and reports the model's error on each (the other gammas are
not used for the fit) and corrects its predictions by it. Sampling (--temperature > 0), each
round draws its own samples, as a job's batches do, a loop's counts pool every timed round's
draws, and --rounds defaults to 10 (5 otherwise).
Each of --trees (token trees, `trees.tree_speculative_sample`) runs its real loop in the loops'
rounds: its count gives its acceptance lift over the chains, its time the model's error on it.
Each choice whose loop was timed has its predictions corrected by that loop's measured over
predicted time (`costs.corrected`; the error reported is the model's before it). The choice
the corrected model predicts fastest, a gamma or a tree, is the batch size's entry in the
schedule (T5X's adapter runs either; a job under gamma 'auto' starts there). --beam_size N
calibrates beam search of N beams instead: beam_search itself and the trees of
`branching='auto'`, each one's real loop timed; the job starts from the one the model predicts
fastest and does not explore early what it predicts much slower (no gamma schedule, no
t5x_schedule.gin).

--topology v5e:2x4 calibrates compile-only for a TPU job that has no chips yet: the step
costs, the prefill and one loop iteration at every gamma are XLA:TPU's estimates
(`aot.step_costs`: the pair's programs compiled for the topology's devices on this CPU, with
libtpu installed); no loop is timed. Acceptance is --alpha, or counted from the pair's own greedy (or sampled)
decodes of the inputs at --max_gamma on this machine. Estimates are a compiler's: a lower
bound of the time on an idle chip, not timings.

Writes to --output_dir:
  calibration.json   the figures: step costs, fitted overheads, acceptance, predicted (and with
                     --check measured) ms per output position per choice, the schedule
  calibration.md     the same as tables
  t5x_schedule.gin   for `python -m t5x.infer` with gin_configs/t5x/*: binds
                     SpeculativeEncoderDecoderModel.gamma_schedule, batch size -> gamma or tree
                     (T5X traces predict_batch at a static batch size; the adapter takes that
                     size's entry)
  infer_schedule.gin for speculative-t5x-infer: binds infer_script.infer.calibration to
                     calibration.json (with gamma 'auto' the job's policy starts from the
                     batch size's entry, follows its model, and keeps timing as a check)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from speculative_t5x import costs
from speculative_t5x import data
from speculative_t5x import network
from speculative_t5x import pipeline
from speculative_t5x import policy

OUTPUT_LENGTH = 64
PROBE_ROUNDS = 7  # rounds of the step probes (cheap; their first round compiles and is dropped)
LOOP_ROUNDS = 5
# A sampled calibration's rounds, each its own draw: at T=1 five draws priced some gamma 11-15%
# off its loop at batch 1 and 8, ten within 6.5% (a recorded study, in git history).
SAMPLED_LOOP_ROUNDS = 10
# Each probe call runs many steps (encodes): one short call per round is too noisy a sample
# beside loops of seconds.
ENCODE_REPEATS = 8
# The fewest batches a batch size's loops run over: at batch 32 greedy, a model fitted on 4
# batches priced gamma 3 1% faster than gamma 2, which ran 8% faster in a 6-batch job; fitted on
# 6 other batches it ranked them as the job did (a recorded study, in git history).
MIN_BATCHES = 6
# The token trees a calibration prices by default: the two shapes of the verifiers benchmark
# that kept most per call at depth 2 and 4 (results/cpu/verifiers/verifiers.md).
DEFAULT_TREES = '3,1;2,1,1,1'


# ------------------------------------------------------------------------------------------------
# Step costs, each step in isolation.


def step_setup(pair: pipeline.Pair, name: str, batch: int, position: int = 8,
               input_length: int = 20, output_length: int = OUTPUT_LENGTH
               ) -> Tuple[network.Transformer, Dict[str, Any], network.DecoderCache]:
  """(module, variables, cache) of `name`'s cached decoder over a random `input_length`-token
  input, the cache (`output_length` positions) holding `position` tokens; variables include
  the decode-time layouts."""
  config = pair.configs[name]
  module = network.Transformer(config)
  variables = {'params': pair.params[name],
               network.DECODE_COLLECTION: pair.params['decode'][name]}
  tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, input_length), 3, config.vocab_size)
  # Jitted: op by op, the encoder alone takes seconds.
  caches = jax.jit(functools.partial(pair.model().init_caches, max_length=output_length))
  cache = caches(pair.params, tokens)[0 if name == 'target' else 1]
  return module, variables, cache.with_index(jnp.full((batch,), position, jnp.int32))


def step_loop(pair: pipeline.Pair, name: str, batch: int, k: int, steps_per_call: int = 16,
              shapes: Tuple[int, int] = (20, OUTPUT_LENGTH)
              ) -> Tuple[Callable[[], jax.Array], Any]:
  """(call, compiled) of `steps_per_call` cached decode steps of `name` ('target' or 'draft')
  appending k tokens per row, as the decode loops run them: in one jitted `fori_loop` carrying
  the cache (each step's index stays put, and depends on its logits so that nothing is dead
  code), over an input of shapes[0] tokens with a cache of shapes[1] positions. `compiled` is
  the compiled program (for its HLO)."""
  module, variables, cache = step_setup(pair, name, batch, input_length=shapes[0],
                                        output_length=shapes[1])

  def steps(variables, cache):
    def body(_, cache):
      logits, new_cache = module.apply(variables, jnp.full((batch, k), 5, jnp.int32), cache,
                                       method=network.Transformer.decode_step)
      return new_cache.with_index(cache.index + (jnp.argmax(logits[:, -1], axis=-1) < 0))
    return jax.lax.fori_loop(0, steps_per_call, body, cache).index

  compiled = jax.jit(steps).lower(variables, cache).compile()
  return functools.partial(compiled, variables, cache), compiled


def step_times_ms(pair: pipeline.Pair, name: str, batch: int, chunk_sizes: Sequence[int],
                  rounds: int = PROBE_ROUNDS, steps_per_call: int = 16,
                  shapes: Tuple[int, int] = (20, OUTPUT_LENGTH)) -> Dict[int, float]:
  """Median ms of one cached decode step of `name` ('target' or 'draft') appending k tokens per
  row, for k in chunk_sizes, timed inside a loop (`step_loop`).

  A step jitted alone would add a dispatch (~0.3-1 ms on a CPU) that the loops do not pay and
  hide how the step grows with k. The sizes take turns in each round.
  """
  loops = {k: step_loop(pair, name, batch, k, steps_per_call, shapes)[0]
           for k in sorted(set(chunk_sizes))}
  times = policy.round_robin(loops, rounds + 1)  # the first round warms up
  return {k: 1e3 * float(np.median(t[1:])) / steps_per_call for k, t in times.items()}


def encode_call(pair: pipeline.Pair, batch_size: int, width: int,
                output_length: int = OUTPUT_LENGTH) -> Callable[[], Any]:
  """What a batch runs once, compiled: the encoders over [batch_size, width] inputs (one for a
  decoder-only draft) and both decoder caches, in one jitted call."""
  tokens = jax.random.randint(jax.random.PRNGKey(1), (batch_size, width), 3,
                              pair.configs['target'].vocab_size)
  start = functools.partial(pair.model().init_caches, max_length=output_length)
  return functools.partial(jax.jit(start).lower(pair.params, tokens).compile(), pair.params,
                           tokens)


def probes(pair: pipeline.Pair, batch_size: int, max_gamma: int, width: int,
           steps_per_call: int = 64, trees: Sequence[Tuple[int, ...]] = (), beams: int = 1
           ) -> Dict[Tuple[str, int], Tuple[Callable[[], Any], int]]:
  """The model's isolated costs as calls to time: {(part, k): (call, steps per call)}: the
  target's step for k = 1..max_gamma+1 tokens per row and each tree's nodes, the draft's for 1,
  2 (a feature draft's 1..max_gamma+1) and the trees' level widths (`costs.call_shape`), over
  batch_size x beams rows; the encoders ('encode', 0), over batch_size."""
  shapes = [costs.call_shape(t) for t in trees]
  first_calls = range(1, max_gamma + 2) if pair.configs['draft'].feature_width else (1, 2)
  sizes = {'target': set(range(1, max_gamma + 2)) | {target for _, target in shapes},
           'draft': set(first_calls).union(*[draft for draft, _ in shapes])}
  rows = batch_size * beams
  out = {(part, k): (step_loop(pair, part, rows, k, steps_per_call)[0], steps_per_call)
         for part, ks in sizes.items() for k in sorted(ks)}
  encode = encode_call(pair, batch_size, width)
  out['encode', 0] = (lambda: [encode() for _ in range(ENCODE_REPEATS)]), ENCODE_REPEATS
  return out


# ------------------------------------------------------------------------------------------------
# Real loops.


def _decoder(choice: costs.Choice, temperature: float, beams: int = 0
             ) -> Tuple[str, Dict[str, Any]]:
  if beams:
    if choice:
      return 'speculative_beam', {'branching': choice, 'num_decodes': beams}
    return 'beam', {'num_decodes': beams}
  if isinstance(choice, tuple):
    return 'speculative_tree', {'branching': choice, 'temperature': temperature}
  if choice == 0:
    return 'target', {'temperature': temperature}
  return 'speculative', {'gamma': choice, 'temperature': temperature}


def measure(pair: pipeline.Pair, pipe: pipeline.Pipeline, texts: Sequence[str],
            gammas: Sequence[costs.Choice], temperature: float, max_gamma: int,
            rounds: int = LOOP_ROUNDS, beams: int = 0
            ) -> Tuple[costs.StepCosts, List[costs.LoopRun]]:
  """The isolated step costs (overheads not yet fitted) and each choice's (gamma's or tree's)
  real decode of `texts`: a loop's ms, and the loop iterations and output positions it counted.

  The probes take turns in their own rounds, then the loops in theirs: timed in the same
  rounds as the probes, T=1 batch 8's loops ranked gamma 1 to 4 within 1% with twice the
  noise, where alone (and in jobs) gamma 1 and 2 ran 3-8% ahead of 3 and 4. A loop's ms per
  output position is its median over rounds relative to the other loops in the same round
  (`policy.paired_medians`). A sampled loop (temperature > 0) draws its own samples each round,
  as a job's batches do (one draw of 6 batches at batch 32 ranked choices within a few % that a
  job's draws ranked otherwise); its run pools every timed round's draws (`_loop_run`). beams:
  beam search of that many beams (the choices: () and trees), its steps over batch x beams
  rows."""
  widths = [b['encoder_input_tokens'].shape[1] for b in pipe.batches(texts)]
  calls = probes(pair, pipe.batch_size, max_gamma, int(np.median(widths)),
                 trees=[g for g in gammas if isinstance(g, tuple) and g], beams=max(beams, 1))
  sampled = temperature > 0 and not beams
  decodes: Dict[costs.Choice, List[pipeline.Decoded]] = {g: [] for g in gammas}
  passes = {}
  for g in gammas:
    name, kwargs = _decoder(g, temperature, beams)
    pipe.compile(texts, name, **kwargs)
    passes['loop', g] = _loop_pass(pipe, texts, name, kwargs, decodes[g], sampled)
    passes['loop', g]()  # warm
  probe_times = policy.round_robin({k: c for k, (c, _) in calls.items()}, rounds + 1)
  loop_times = policy.round_robin(passes, rounds + 1)  # (each first round warms up)
  ms = {key: 1e3 * np.median(t[1:]) / calls[key][1] for key, t in probe_times.items()}
  part_ms = lambda name: {k: float(v) for (part, k), v in ms.items() if part == name}
  model = costs.StepCosts(pipe.batch_size, part_ms('target'), part_ms('draft'),
                          batch_ms=float(ms['encode', 0]),
                          feature_draft=bool(pair.configs['draft'].feature_width))
  steps = None
  if beams:  # counted per beam step: every choice takes beam_search's steps (the same search)
    steps = _beam_steps(decodes[next(g for g in gammas if g)][0], pipe.batch_size)
  timed = slice(2, None) if sampled else slice(-1, None)  # (warm pass, warm round, rounds)
  counts = {g: [_counts(d, pipe.batch_size, steps) for d in decodes[g][timed]] for g in gammas}
  per_position = policy.paired_medians({g: [1e3 * s / c['positions'] for s, c in zip(
      loop_times['loop', g][1:], itertools.cycle(counts[g]))] for g in gammas})
  return model, [_loop_run(g, per_position[g], counts[g]) for g in gammas]


def _loop_pass(pipe: pipeline.Pipeline, texts: Sequence[str], name: str,
               kwargs: Mapping[str, Any], outputs: List[pipeline.Decoded], sampled: bool
               ) -> Callable[[], pipeline.Decoded]:
  """One real decode of `texts` per call, appended to `outputs`; sampled, each call draws with
  the next seed (the first with the infer job's keys, seed 0)."""
  def one_pass() -> pipeline.Decoded:
    outputs.append(pipe.decode(texts, name, seed=len(outputs) if sampled else 0, **kwargs))
    return outputs[-1]
  return one_pass


def _loop_run(choice: costs.Choice, ms_per_position: float,
              counts: Sequence[Dict[str, Any]]) -> costs.LoopRun:
  """A choice's `costs.LoopRun` at `ms_per_position` from the counts (`_counts`) of its timed
  decodes (one that every round decoded, or a sampled loop's draws, one per round), pooled."""
  pooled = {key: (sum((c[key] for c in counts), ()) if key == 'lengths' else
                  sum(c[key] for c in counts)) for key in counts[0]}
  return costs.LoopRun(choice, ms=float(ms_per_position * pooled['positions']), **pooled)


def _beam_steps(decoded: pipeline.Decoded, batch_size: int) -> List[int]:
  """Per batch, beam search's steps: speculative beam search's most beam steps of an example
  (its `emitted`; the search runs until every example has stopped)."""
  return [int(np.max(decoded.stats['emitted'][start:start + batch_size]))
          for start in range(0, len(decoded.tokens), batch_size)]


def _counts(decoded: pipeline.Decoded, batch_size: int,
            steps: Optional[Sequence[int]] = None) -> Dict[str, Any]:
  """The batches, loop iterations and output positions of a decode: per batch its most target
  calls of a row (the target alone, which counts none: one iteration per position) and its
  longest output, summed; the accepted draft tokens and the calls that rejected one, summed
  over rows; each batch's rows' output positions (padding rows 0). With `steps` (beam
  search's, per batch) positions are beam steps: beam_search takes more steps than its best
  output has tokens, one target call each (and nothing else is counted)."""
  out = dict(batches=0, iterations=0, positions=0, accepted=0, rejected=0, lengths=[])
  stats = decoded.stats or {}
  for i, start in enumerate(range(0, len(decoded.tokens), batch_size)):
    rows = slice(start, start + batch_size)
    lengths = policy.row_positions(decoded.tokens[rows])
    positions = policy.longest(lengths) if steps is None else steps[i]
    out['batches'] += 1
    out['positions'] += positions
    out['iterations'] += (int(np.max(stats['target_calls'][rows])) if stats else positions)
    if steps is None:
      out['lengths'].append(tuple(int(n) for n in lengths) + (0,) * (batch_size - len(lengths)))
    if steps is None and stats:
      out['accepted'] += int(np.sum(stats['accepted'][rows]))
      out['rejected'] += int(np.sum(stats['rollbacks'][rows]))
  out['lengths'] = tuple(out['lengths'])
  return out


# ------------------------------------------------------------------------------------------------
# One batch size, the schedule, the files.


def calibrate_batch_size(pair: pipeline.Pair, texts: Sequence[str], batch_size: int, *,
                         temperature: float, max_gamma: int, fit_gammas: Sequence[int],
                         check: bool, rounds: int = LOOP_ROUNDS,
                         trees: Sequence[Tuple[int, ...]] = ()) -> Dict[str, Any]:
  """The model of `batch_size` fitted on `texts` (its --fit_gammas loops; with `check` every
  gamma's loop is timed with them and the model's error on each reported): its figures, the
  gamma it predicts best and its best choice of all (the schedule's entry). Each of `trees` runs
  its real loop too: its tokens per iteration give its lift (`costs.tree_lifts`), its time
  checks the model."""
  pipe = pipeline.Pipeline(pair, batch_size=batch_size, max_output_length=OUTPUT_LENGTH)
  gammas = list(range(max_gamma + 1) if check else sorted(set(fit_gammas)))
  model, runs = measure(pair, pipe, texts, gammas + list(trees), temperature, max_gamma, rounds)
  fitted_on = [r for r in runs if r.gamma in fit_gammas]
  model, alpha = costs.fit(model, fitted_on), costs.pooled_alpha(fitted_on)
  model = dataclasses.replace(model, lifts=costs.tree_lifts(runs, alpha),
                              spread=costs.fit_spread(model, fitted_on, alpha))
  checked = [r for r in runs if check or isinstance(r.gamma, tuple)]  # trees: always
  return {**_figures(model, runs, alpha, model.choices(), checked, range(model.max_gamma + 1)),
          'fit_gammas': sorted(set(fit_gammas))}


def calibrate_beams(pair: pipeline.Pair, texts: Sequence[str], batch_size: int, *, beams: int,
                    rounds: int = LOOP_ROUNDS) -> Dict[str, Any]:
  """The model of beam search with `beams` beams at `batch_size`: beam_search itself and the
  trees `branching='auto'` offers (`policy.TREES`), all timed; fitted on (), (1,) and the widest
  tree, the others checked; times per beam step. A tree's beam steps per round give its lift
  over an acceptance of 0; its best is the choice a job starts from."""
  pipe = pipeline.Pipeline(pair, batch_size=batch_size, max_output_length=OUTPUT_LENGTH)
  model, runs = measure(pair, pipe, texts, list(policy.TREES), 0.0, 0, rounds, beams)
  fit_trees = [(), policy.TREES[1], policy.TREES[-1]]
  model = costs.fit(model, [r for r in runs if r.gamma in fit_trees])
  model = dataclasses.replace(model, lifts=costs.tree_lifts(runs, 0.0))
  block = _figures(model, runs, 0.0, list(policy.TREES), runs, policy.TREES)
  return {**block, 'best': costs.choice_name(block['best']),
          'fit_gammas': [costs.choice_name(t) for t in fit_trees]}


def _figures(model: costs.StepCosts, runs: Sequence[costs.LoopRun], alpha: float,
             choices: Sequence[costs.Choice], checked: Sequence[costs.LoopRun],
             line: Sequence[costs.Choice]) -> Dict[str, Any]:
  """A batch size's block of calibration.json: `model`'s error on the `checked` runs; the final
  model, `model` corrected by them (`costs.corrected`); each of `choices`' ms per output
  position as `model` predicts it and as the final model does (for the runs' batches: their
  rows' output positions, or for beam search their mean longest); the final model's best of
  `choices` (the schedule's entry) and of `line` (`best`); the runs."""
  positions = sum(r.positions for r in runs) / sum(r.batches for r in runs)  # per batch
  lengths, name = _lengths(runs), costs.choice_name
  errors = costs.check(model, checked, alpha)
  final = costs.corrected(model, errors)
  out = dict(costs=final.to_json(), alpha=alpha, positions_per_batch=positions,
             **{key: {name(c): m.ms_per_position(c, alpha, positions, lengths) for c in choices}
                for key, m in (('predicted_ms_per_position', model),
                               ('corrected_ms_per_position', final))},
             best_choice=name(final.best(alpha, choices, lengths)),
             best=final.best(alpha, line, lengths),
             runs=[{**dataclasses.asdict(r), 'gamma': name(r.gamma)} for r in runs])
  if errors:
    out['check'] = {name(c): v for c, v in errors.items()}
  return out


def _lengths(runs: Sequence[costs.LoopRun]) -> Optional[List[Tuple[int, ...]]]:
  """The runs' batches' rows' output positions, all runs' together (None for beam search)."""
  return [batch for r in runs for batch in r.lengths] or None


def schedule_gin(schedule: costs.Schedule, binding: str, header: Sequence[str],
                 imports: Sequence[str] = ()) -> str:
  """A gin file binding `binding` to the schedule ({batch size: gamma or tree})."""
  entries = ', '.join(f'{b}: {g}' for b, g in sorted(schedule.items()))
  return '\n'.join([f'# {line}' for line in header] + list(imports) +
                   [f'{binding} = {{{entries}}}', ''])


def markdown(results: Mapping[str, Any]) -> str:
  """calibration.md: per batch size, the model's prediction of each gamma beside what its loop
  measured (where timed), and the fitted costs."""
  lines = ['# Calibration', '', f"Command: `{results['command']}`", '',
           f"Devices: {results.get('devices', '')}; temperature {results.get('temperature')}.", '',
           'ms per output position of each gamma: predicted by the model (step costs measured in '
           'isolation, overheads fitted to the loops of the fit gammas) and measured (the real '
           'loop, its rounds paired with the other loops\'); tokens per loop iteration and the '
           'paper\'s alpha (accepted / (accepted + rejected) draft tokens) as counted (sampled: '
           'over every timed round\'s draws). Alpha is the chains\' '
           'over the fit gammas; a batch\'s loop runs until its slowest row is done, predicted '
           'from its rows\' output positions, times the spread: "predicted" is for all the '
           'runs\' batches, "predicted for its run" for that run\'s own (sampled outputs differ '
           'in length), which the error compares. "corrected": the prediction times the '
           'choice\'s measured over predicted for its run, where its loop was timed; the '
           'schedule picks by it, and the job\'s policy predicts with it.', '']
  if results.get('estimates'):
    lines += [f"**Compile-only:** {results['estimates']}", '']
  if results.get('beam_size'):
    lines += [f"Beam search of {results['beam_size']} beams: per beam step (beam search takes "
              'more steps than its best output has tokens), tokens per iteration are beam steps '
              'per target call, () is beam_search itself.', '']
  for batch_size, block in results['batch_sizes'].items():
    c, check = block['costs'], block.get('check', {})
    runs = {costs.choice_name(costs.parse_choice(r['gamma'])): r for r in block.get('runs', [])}
    lines += [f"## Batch {batch_size}: alpha {block['alpha']:.3f}, spread "
              f"{c.get('spread', 1.0):.3f}, best "
              f"{block['best']}, best choice {block.get('best_choice', block['best'])}, fitted "
              f"on {block.get('fit_gammas')}", '',
              '| gamma / tree | predicted | predicted for its run | measured | error | '
              'corrected | tokens/iteration | alpha |', '|---|---|---|---|---|---|---|---|']
    corrected = block.get('corrected_ms_per_position', block['predicted_ms_per_position'])
    for g, predicted in block['predicted_ms_per_position'].items():
      row, run = check.get(str(g), {}), runs.get(str(g))
      counted = (run or {}).get('accepted', 0) + (run or {}).get('rejected', 0)
      lines.append(f"| {g} | {predicted:.3f} | {row.get('predicted', float('nan')):.3f} | "
                   f"{row.get('measured', float('nan')):.3f} | "
                   f"{row.get('error', float('nan')):+.1%} | {corrected[g]:.3f} | " +
                   (f"{run['positions'] / max(run['iterations'], 1):.2f} |" if run else ' |') +
                   (f" {run['accepted'] / counted:.3f} |" if counted else ' |'))
    lines += ['', 'Costs (ms): target step by tokens per row ' + ', '.join(
        f'{k}: {v:.3f}' for k, v in c['target_ms'].items()) + '; draft ' + ', '.join(
        f'{k}: {v:.3f}' for k, v in c['draft_ms'].items()) +
        f"; encoders per batch {c['batch_ms']:.3f}; loop overhead per iteration: target alone "
        f"{c['plain_overhead_ms']:.3f}, speculative {c['overhead_ms']:.3f} + "
        f"{c['overhead_per_token_ms']:.3f} per draft token" + ''.join(
            f"; tree {t} acceptance lift {v:+.3f}" for t, v in c.get('lifts', {}).items()) +
        '.', '']
  return '\n'.join(lines)


def dumps(values: Mapping[str, Any]) -> str:
  """calibration.json's text: indented, each list of numbers (or of such lists) on one line (a
  sampled calibration's runs hold every draw's rows' output positions)."""
  lines: List[str] = []

  def numbers(value: Any) -> bool:
    return (isinstance(value, (int, float, np.number)) or
            isinstance(value, (list, tuple)) and all(map(numbers, value)))

  def marked(value: Any) -> Any:  # such a list as a marker string, written in one line later
    if isinstance(value, dict):
      return {k: marked(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and numbers(value):
      lines.append(json.dumps(value, default=float))
      return f'\0{len(lines) - 1}'
    return [marked(v) for v in value] if isinstance(value, (list, tuple)) else value

  text = json.dumps(marked(values), indent=1, default=float)
  return re.sub(r'"\\u0000(\d+)"', lambda m: lines[int(m.group(1))], text)


def write(output_dir: Path, results: Dict[str, Any], command: str) -> List[Path]:
  """calibration.json, calibration.md and the two schedule gin files (module docstring); a
  beam search calibration (`beam_size`) has no gamma schedule and no t5x_schedule.gin."""
  output_dir.mkdir(parents=True, exist_ok=True)
  beams = results.get('beam_size', 0)
  schedule = {} if beams else {int(b): costs.parse_choice(r.get('best_choice', r['best']))
                               for b, r in results['batch_sizes'].items()}
  header = [f'Written by: {command}', 'Batch size -> gamma (0: the target alone) or token tree, '
            'predicted fastest by the model (corrected by its loops) in calibration.json.'
            if not beams else
            f'Beam search of {beams} beams: the trees predicted fastest are in calibration.json.']
  files = {
      'calibration.json': dumps({**results, 'schedule': schedule}),
      'calibration.md': markdown(results),
      't5x_schedule.gin': schedule_gin(
          schedule, 't5x_adapter.SpeculativeEncoderDecoderModel.gamma_schedule',
          header + ['After a file binding MODEL to that class (gin_configs/t5x/multi30k_pair.gin).'],
          ['from __gin__ import dynamic_registration', 'from speculative_t5x import t5x_adapter',
           '']),
      'infer_schedule.gin': '\n'.join(
          [f'# {line}' for line in header] +
          [f"infer_script.infer.calibration = '{(output_dir / 'calibration.json').resolve()}'",
           '']),
  }
  if beams:
    del files['t5x_schedule.gin']  # T5X's adapter schedules speculative_sample, not beams
  for name, text in files.items():
    (output_dir / name).write_text(text)
  return [output_dir / name for name in files]


def _parse_ints(spec: str, flag: str) -> List[int]:
  try:
    values = [int(v) for v in spec.split(',') if v.strip()]
  except ValueError:
    raise SystemExit(f'error: {flag} wants integers like 1,8, got {spec!r}') from None
  if not values or min(values) < 0:
    raise SystemExit(f'error: {flag} wants non-negative integers like 1,8, got {spec!r}')
  return values


def _parse_trees(spec: str) -> List[Tuple[int, ...]]:
  """'3,1;2,1,1,1' -> [(3, 1), (2, 1, 1, 1)] ('' -> none)."""
  try:
    out = [tuple(int(b) for b in tree.split(',')) for tree in spec.split(';') if tree.strip()]
  except ValueError:
    out = [()]
  if any(not tree or min(tree) < 1 for tree in out):
    raise SystemExit(f"error: --trees wants branchings like '3,1;2,1,1,1' (positive integers, "
                     f"';' between trees), got {spec!r}")
  return out


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--output_dir', required=True, help='where the three files are written')
  p.add_argument('--input_file', default=None,
                 help="the job's inputs, one per line (default: Multi30k's test captions from "
                      f'--data_dir / ${data.DATA_ENV_VAR})')
  p.add_argument('--data_dir', default=None, help='folder holding multi30k/')
  p.add_argument('--batch_sizes', default='1,8,32', help='batch sizes to calibrate')
  p.add_argument('--sentences', type=int, default=64,
                 help=f'inputs per batch size (at least {MIN_BATCHES} batches: more are taken '
                      'if needed)')
  p.add_argument('--temperature', type=float, default=0.0, help='the job\'s temperature')
  p.add_argument('--max_gamma', type=int, default=policy.MAX_GAMMA)
  p.add_argument('--fit_gammas', default=None,
                 help='gammas whose real loops fit the model (default: 0, 1 and max_gamma)')
  p.add_argument('--trees', default=DEFAULT_TREES,
                 help="token trees to price, e.g. '3,1;2,1,1,1' ('' for none): each runs its "
                      'real loop; the policy runs one where the model predicts it fastest')
  p.add_argument('--check', action='store_true',
                 help="also time every other gamma: the model's error on each is reported and "
                      'its predictions corrected by its loop (near-ties ranked as the loops ran)')
  p.add_argument('--beam_size', type=int, default=0,
                 help="calibrate beam search of this many beams instead (branching='auto': beam "
                      'search itself and its trees, all timed); the infer job\'s num_decodes')
  p.add_argument('--rounds', type=int, default=None,
                 help=f'timed round-robin rounds (default {LOOP_ROUNDS}; sampling, each round a '
                      f'draw: {SAMPLED_LOOP_ROUNDS})')
  p.add_argument('--topology', default=None,
                 help='compile-only for this TPU topology (e.g. v5e:2x4; needs libtpu): step '
                      "costs from XLA:TPU's estimates, no loop timed")
  p.add_argument('--mesh', default=None,
                 help='with --topology: (data)x(model), e.g. 1x8 (default: 1 x its devices)')
  p.add_argument('--alpha', type=float, default=None,
                 help='with --topology: the acceptance to plan for (default: counted from the '
                      "pair's decodes of the inputs)")
  p.add_argument('--input_length', type=int, default=OUTPUT_LENGTH,
                 help='with --topology: the encoder length compiled')
  p.add_argument('--target', default=str(pipeline.EMBEDDED_TARGET))
  p.add_argument('--draft', default=str(pipeline.EMBEDDED_DRAFT))
  args = p.parse_args(argv)
  args.batch_sizes = _parse_ints(args.batch_sizes, '--batch_sizes')
  args.trees = _parse_trees(args.trees)
  if args.rounds is None:
    args.rounds = (SAMPLED_LOOP_ROUNDS if args.temperature > 0 and not args.beam_size else
                   LOOP_ROUNDS)
  if min(args.batch_sizes) < 1:
    p.error(f'--batch_sizes must be >= 1, got {args.batch_sizes}')
  if args.max_gamma < 1 or args.sentences < 1 or args.rounds < 1:
    p.error('--max_gamma, --sentences and --rounds must be >= 1')
  if args.beam_size < 0:
    p.error(f'--beam_size must be >= 1 (0: calibrate gamma), got {args.beam_size}')
  if args.topology is None and (args.alpha is not None or args.mesh is not None):
    p.error('--alpha and --mesh are for a compile-only calibration (--topology)')
  if args.topology is not None and args.beam_size:
    p.error('--topology calibrates gamma, not beam search (--beam_size)')
  if args.alpha is not None and not 0 <= args.alpha < 1:
    p.error(f'--alpha must be in [0, 1), got {args.alpha}')
  if args.mesh is not None:
    args.mesh = tuple(_parse_ints(args.mesh.replace('x', ','), '--mesh'))
    if len(args.mesh) != 2 or min(args.mesh) < 1:
      p.error(f'--mesh wants (data)x(model) like 1x8, got {args.mesh}')
  args.fit_gammas = (_parse_ints(args.fit_gammas, '--fit_gammas') if args.fit_gammas else
                     [0, 1, args.max_gamma])
  if 0 not in args.fit_gammas or max(args.fit_gammas) > args.max_gamma or len(
      set(args.fit_gammas)) < 2:
    p.error(f'--fit_gammas needs 0 and a speculative gamma <= --max_gamma, got '
            f'{args.fit_gammas}')
  return args


def read_inputs(args: argparse.Namespace) -> List[str]:
  if args.input_file is None:
    try:
      return data.load_split('test', data_dir=args.data_dir)[0]
    except data.DataNotFound as e:
      raise SystemExit(f'error: no --input_file, and {e}') from None
  try:
    lines = Path(args.input_file).read_text(encoding='utf-8').splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise SystemExit(f'error: cannot read --input_file {args.input_file}: {e}') from None
  lines = [line for line in lines if line.strip()]
  if not lines:
    raise SystemExit(f'error: --input_file {args.input_file} has no non-empty line')
  return lines


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  args = parse_args(argv)
  if args.topology:
    return compile_only(args, argv)
  texts = read_inputs(args)
  pair = pipeline.load_pair(args.target, args.draft)
  results = {'command': ' '.join(['speculative-t5x-calibrate'] + list(
      sys.argv[1:] if argv is None else argv)), 'temperature': args.temperature,
             'devices': str(jax.devices()), 'batch_sizes': {}}
  if args.beam_size:
    results['beam_size'] = args.beam_size
  for batch_size in args.batch_sizes:
    sample = (texts * (MIN_BATCHES * batch_size))[:max(args.sentences, MIN_BATCHES * batch_size)]
    print(f'batch {batch_size}: step costs, then {_what(args)} on {len(sample)} inputs...',
          file=sys.stderr, flush=True)
    if args.beam_size:
      block = calibrate_beams(pair, sample, batch_size, beams=args.beam_size, rounds=args.rounds)
    else:
      block = calibrate_batch_size(pair, sample, batch_size, temperature=args.temperature,
                                   max_gamma=args.max_gamma, fit_gammas=args.fit_gammas,
                                   check=args.check, rounds=args.rounds, trees=args.trees)
    results['batch_sizes'][batch_size] = block
    errors = ', '.join(f"{g}: {c['error']:+.1%}" for g, c in block.get('check', {}).items())
    print(f"batch {batch_size}: alpha {block['alpha']:.3f}, best {block['best']} "
          f"(of all: {block['best_choice']}), "
          f"predicted ms/position " + ', '.join(
              f'{g}: {v:.3f}' for g, v in block['predicted_ms_per_position'].items()) +
          (f'; model error {errors}; corrected by the loops ' + ', '.join(
              f'{g}: {v:.3f}' for g, v in block['corrected_ms_per_position'].items())
           if errors else ''), flush=True)
  for path in write(Path(args.output_dir), results, results['command']):
    print(path)
  return results


def counted_alpha(pair: pipeline.Pair, texts: Sequence[str], batch_size: int, gamma: int,
                  temperature: float) -> float:
  """The paper's acceptance in the pair's own decodes of `texts` at `gamma` (this machine)."""
  pipe = pipeline.Pipeline(pair, batch_size=batch_size, max_output_length=OUTPUT_LENGTH)
  counts = _counts(pipe.decode(texts, 'speculative', gamma=gamma, temperature=temperature),
                   batch_size)
  return costs.row_alpha(counts['accepted'], counts['rejected'])


def compiled_batch_size(model: costs.StepCosts, alpha: float) -> Dict[str, Any]:
  """A batch size's block of calibration.json from estimated costs: every gamma's predicted
  ms per output position (the prefill spread over OUTPUT_LENGTH positions), the best."""
  gammas = range(model.max_gamma + 1)
  predicted = {g: model.ms_per_position(g, alpha, OUTPUT_LENGTH) for g in gammas}
  best = costs.cheapest(gammas, predicted.__getitem__)
  return dict(costs=model.to_json(), alpha=alpha, positions_per_batch=OUTPUT_LENGTH,
              predicted_ms_per_position=predicted, corrected_ms_per_position=predicted,
              best_choice=best, best=best, runs=[], fit_gammas=[])


def compile_only(args: argparse.Namespace, argv: Optional[Sequence[str]]) -> Dict[str, Any]:
  """--topology: the schedule from XLA:TPU's estimates (module docstring)."""
  from speculative_t5x import aot  # pylint: disable=g-import-not-at-top  (libtpu's warnings)
  from speculative_t5x import partitioning  # pylint: disable=g-import-not-at-top
  devices = aot.topology_devices(args.topology)
  mesh = partitioning.create_mesh(args.mesh or (1, len(devices)), devices=devices)
  pair = pipeline.load_pair(args.target, args.draft)
  texts = None if args.alpha is not None else read_inputs(args)
  results = {'command': ' '.join(['speculative-t5x-calibrate'] + list(
      sys.argv[1:] if argv is None else argv)), 'temperature': args.temperature,
             'devices': f'{args.topology}: {len(devices)} x {devices[0].device_kind}, mesh '
                        f"{dict(mesh.shape)}",
             'estimates': "step costs, prefill and each gamma's iteration are XLA:TPU's "
                          'optimal_seconds of the compiled programs (a lower bound on an idle '
                          'chip, not timings); alpha ' + ('given' if texts is None else
                                                'counted from the pair\'s decodes here'),
             'batch_sizes': {}}
  for batch_size in args.batch_sizes:
    programs = aot.decode_programs(
        pair.target_config, pair.draft_config, mesh, batch_size, input_length=args.input_length,
        output_length=OUTPUT_LENGTH, target_ks=range(1, args.max_gamma + 2),
        iterations=[(g, args.temperature) for g in range(args.max_gamma + 1)])
    seconds = {}
    for name, build in programs.items():
      print(f'batch {batch_size}: compiling {name}...', file=sys.stderr, flush=True)
      try:
        seconds[name] = aot.optimal_seconds(aot.compile_program(build))
      except aot.DoesNotFit as error:
        raise SystemExit(f'error: the {name} program at batch {batch_size} does not fit '
                         f'{args.topology} (mesh {dict(mesh.shape)}): {error}') from None
    model = aot.step_costs(seconds, batch_size, args.max_gamma, args.temperature)
    alpha = args.alpha if texts is None else counted_alpha(
        pair, texts[:args.sentences], batch_size, args.max_gamma, args.temperature)
    block = results['batch_sizes'][batch_size] = compiled_batch_size(model, alpha)
    print(f"batch {batch_size}: alpha {alpha:.3f}, best gamma {block['best']}, estimated ms "
          'per position ' + ', '.join(f'{g}: {v:.4f}' for g, v in
                                       block['predicted_ms_per_position'].items()), flush=True)
  for path in write(Path(args.output_dir), results, results['command']):
    print(path)
  return results


def _what(args: argparse.Namespace) -> str:
  """What a batch size's loops are, for the progress line."""
  if args.beam_size:
    return f'beam search of {args.beam_size} beams and its trees ' + ', '.join(
        costs.choice_name(t) for t in policy.TREES[1:])
  gammas = list(range(args.max_gamma + 1)) if args.check else sorted(set(args.fit_gammas))
  return f'gammas {gammas}' + ''.join(f', tree {costs.choice_name(t)}' for t in args.trees)


def run() -> None:
  """The console script: main() without its return value (which would be the exit status)."""
  main()


if __name__ == '__main__':
  run()
