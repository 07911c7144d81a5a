"""What every benchmark command shares: flags, the pair, batches, compilation, timing, probes.

Timing has one mode: every configuration is compiled for every encoder width its batches need
(compile seconds reported apart), run once untimed (the outputs reported), then all are timed
round-robin for --rounds rounds, taking turns every --piece_batches batches: a speedup is the
median over rounds of the baseline's pass time over the configuration's in the same round, so
that slow phases of a shared machine hit both alike. gamma='auto' is planned and chosen per
batch as the infer job does it (`policy.plan`); each pass is a job from scratch, its search
timed with it. Batches: the first N test_2016_flickr sentences (`--sentences batch:N,...`),
output length 64, encoder width each batch's longest input rounded up to --input_length_step.
Every command writes <out_dir>/<name>.json and .md (default runs/<machine>, untracked).
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import functools
import importlib.util
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import (Any, Callable, Dict, Hashable, Iterator, List, Mapping, NamedTuple, Optional,
                    Sequence, Tuple, Union)

import jax
import jax.numpy as jnp
import numpy as np

from speculative_t5x import beam_search
from speculative_t5x import calibrate
from speculative_t5x import costs
from speculative_t5x import data
from speculative_t5x import decoding
from speculative_t5x import network
from speculative_t5x import partitioning
from speculative_t5x import pipeline
from speculative_t5x import policy
from speculative_t5x import trees

# The repository's root: where commands run from and recorded paths are relative to.
REPO = Path(__file__).resolve().parents[1]
INPUT_LENGTH = 64
INPUT_LENGTH_STEP = 16  # encoder width: each batch's longest input rounded up to this
OUTPUT_LENGTH = 64
BILD_MAX_SMALL_STEPS = 10  # bild_decode's default, the paper's
BEAM_ALPHA = 0.6  # T5X's brevity penalty default
# A pass's piece: at batch 1 on this CPU a fifth of a second, short against the machine's drift.
PIECE_BATCHES = 16
# Resamples of the rounds behind a summed speedup's interval (`speedups_per_token`).
BOOTSTRAP = 4000
# (module, purpose) of an optional module a command needs; every one is in the bench extra.
BLEU = ('sacrebleu', 'BLEU scores')

Batch = Dict[str, jax.Array]
Outputs = List[Tuple[Any, Dict[str, Any]]]  # one pass: (decodes, aux) per batch


class Setting(NamedTuple):
  """One decoding configuration."""
  method: str      # 'baseline', 'speculative', 'tree', 'bild', 'beam' or 'speculative_beam'
  temperature: float = 0.0
  gamma: Union[int, str] = 0     # speculative: (maximum) draft tokens per target call, or 'auto'
  adaptive: bool = False
  fallback: float = 0.0          # bild
  rollback: float = 0.0          # bild
  beam: int = 0                  # beam and speculative_beam: the beam size (num_decodes)
  branching: str = ''            # tree, speculative_beam: the token tree's children per depth
  topp: float = 0.0              # baseline and speculative: nucleus sampling
  verification: str = 'auto'     # speculative: 'token', 'block' or 'auto' (what users get)
  policy: str = ''               # 'auto' under another policy.py than the package's (its label)

  @property
  def name(self) -> str:
    return self._name + (f' ({self.policy})' if self.policy else '')

  @property
  def _name(self) -> str:
    sampling = f'T={self.temperature:g}' + (f' top-p={self.topp:g}' if self.topp else '')
    if self.method == 'baseline':
      return f'target-only {sampling}'
    if self.method == 'bild':
      return f'BiLD fb={self.fallback:g} rb={self.rollback:g}'
    if self.method == 'beam':
      return f'beam_search beam={self.beam}'
    if self.method == 'speculative_beam':
      return f'speculative beam={self.beam} tree={self.branching}'
    if self.method == 'tree':
      return f'tree ({self.branching}) {sampling}'
    gamma = f'adaptive<={self.gamma}' if self.adaptive else f'gamma={self.gamma}'
    verifier = '' if self.verification == decoding.AUTO_VERIFICATION else f' {self.verification}'
    return f'speculative {gamma}{verifier} {sampling}'

  @property
  def baseline(self) -> 'Setting':
    """What this setting's speedup is measured against (the same search on the target alone)."""
    if self.method in ('beam', 'speculative_beam'):
      return Setting('beam', beam=self.beam)
    if self.method == 'bild':
      return Setting('baseline')
    return Setting('baseline', self.temperature, topp=self.topp)

  @property
  def tree(self) -> Tuple[int, ...]:
    return () if self.branching == policy.AUTO else tuple(
        int(b) for b in self.branching.split(',') if b)

  def decoder(self) -> Tuple[Callable, Dict[str, Any]]:
    """(decode_fn, decode_kwargs) for models.EncoderDecoderModel."""
    if self.method == 'beam':
      return beam_search.beam_search, {'alpha': BEAM_ALPHA}
    if self.method == 'speculative_beam':
      branching = policy.AUTO if self.branching == policy.AUTO else self.tree
      return beam_search.speculative_beam_search, {'alpha': BEAM_ALPHA, 'branching': branching}
    if self.method == 'baseline':
      # topk=0: T5X's temperature_sample defaults to top-1, i.e. greedy even at temperature 1.
      return decoding.temperature_sample, {'temperature': self.temperature, 'topk': 0,
                                           'topp': self.topp}
    if self.method == 'tree':
      return trees.tree_speculative_sample, {'temperature': self.temperature, 'topp': self.topp,
                                             'branching': self.tree}
    if self.method == 'bild':
      return decoding.bild_decode, {'fallback_threshold': self.fallback,
                                    'rollback_threshold': self.rollback, 'temperature': 0.0}
    return decoding.speculative_sample, {'temperature': self.temperature, 'gamma': self.gamma,
                                         'adaptive_gamma': self.adaptive, 'topp': self.topp,
                                         'verification': self.verification}


def check_needs(needs: Sequence[Tuple[str, str]], extra: str = 'bench') -> None:
  """Exits with one line naming the missing modules of `needs` ((module, purpose) pairs), looked
  up, not imported: before anything compiles, and torch stays out of a timed XLA process."""
  missing = [(m, purpose) for m, purpose in needs if importlib.util.find_spec(m) is None]
  if missing:
    purposes = ', '.join(dict.fromkeys(purpose for _, purpose in missing))
    raise SystemExit(f"error: {', '.join(m for m, _ in missing)} not installed ({purposes}): "
                     f"pip install -e '.[{extra}]' (or pip install 'speculative_t5x[{extra}]')")


class _Parser(argparse.ArgumentParser):
  """parse_args also checks the command's optional modules (after the flags: --help works)."""

  def __init__(self, needs: Sequence[Tuple[str, str]], **kwargs: Any):
    super().__init__(**kwargs)
    self.needs = tuple(needs)

  def parse_args(self, *args: Any, **kwargs: Any) -> argparse.Namespace:
    namespace = super().parse_args(*args, **kwargs)
    check_needs(self.needs)
    return namespace


def parser(doc: str, *, sentences: str, gammas: Optional[str] = None, rounds: int = 3,
           needs: Sequence[Tuple[str, str]] = ()) -> argparse.ArgumentParser:
  """The flags every command shares, with the command's defaults; `doc` is its docstring and
  `needs` its optional modules ((module, purpose), e.g. BLEU), checked as it parses its flags."""
  p = _Parser(needs, description=doc, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--sentences', default=sentences,
                 help='batch_size:number_of_sentences pairs (the first N test sentences)')
  if gammas is not None:
    p.add_argument('--gammas', default=gammas,
                   help="greedy speculative gammas ('auto': planned as the infer job does)")
  p.add_argument('--rounds', type=int, default=rounds, help='timed round-robin rounds')
  p.add_argument('--piece_batches', type=int, default=PIECE_BATCHES,
                 help="batches of a pass run before the next configuration's turn")
  output_flags(p)
  p.add_argument('--data_dir', default=None, help='folder holding multi30k/ (default: '
                 f'${data.DATA_ENV_VAR} or ../shared/data)')
  p.add_argument('--input_length_step', type=int, default=INPUT_LENGTH_STEP,
                 help="encoder width: each batch's longest input rounded up to a multiple of "
                      f'this (0: every batch padded to {INPUT_LENGTH})')
  return p


def output_flags(p: argparse.ArgumentParser) -> None:
  """--machine and --out_dir, where every command writes (`out_dir`)."""
  p.add_argument('--machine', default='cpu', help='names the machine: results go to '
                 'runs/<machine>/ unless --out_dir')
  p.add_argument('--out_dir', default=None, help='default runs/<machine> (untracked); the '
                 'recorded results: results/<machine>')


def parse_sentences(spec: str) -> Dict[int, int]:
  """'1:80,8:160' -> {1: 80, 8: 160} (batch size: sentences; '' -> {}); exits on bad input."""
  try:
    pairs = dict(item.split(':') for item in spec.split(',') if item)
    return {int(b): int(n) for b, n in pairs.items()}
  except ValueError:
    raise SystemExit(f'error: --sentences wants pairs like 1:80,8:160, got {spec!r}') from None


def parse_ints(spec: str, flag: str, auto: bool = False) -> List[Union[int, str]]:
  """'1,2' -> [1, 2] ('' -> []), with auto also 'auto'; exits naming `flag` on bad input."""
  try:
    return [g if auto and g == policy.AUTO else int(g) for g in spec.split(',') if g]
  except ValueError:
    allowed = " (or 'auto')" if auto else ''
    raise SystemExit(f'error: {flag} wants integers{allowed} like 1,2, got {spec!r}') from None


def command_line(name: str, argv: Optional[Sequence[str]]) -> str:
  """The command as it was run, for the results' meta."""
  argv = sys.argv[1:] if argv is None else argv
  return shlex.join(['python', '-m', f'benchmarks.{name}', *argv])


def test_split(data_dir: Optional[str]) -> Tuple[List[str], List[str]]:
  """(German sources, English references) of test_2016_flickr; exits with one line if absent."""
  try:
    return data.load_split('test', data_dir=data_dir)
  except data.DataNotFound as e:
    raise SystemExit(f'error: {e}') from None


@functools.lru_cache(maxsize=None)
def partitioner() -> partitioning.Partitioner:
  """The one mesh of this process (all local devices on 'data', as the infer job's default)."""
  return partitioning.Partitioner()


def make_batches(token_rows: Sequence[Sequence[int]], batch_size: int,
                 length_step: int = INPUT_LENGTH_STEP, width: Optional[int] = None
                 ) -> List[Batch]:
  """[batch_size, width] batches on the mesh, the last padded with all-zero rows; width: each
  batch's longest input rounded up to length_step (0: INPUT_LENGTH), or the given width."""
  max_length, step = (width, 0) if width else (INPUT_LENGTH, length_step)
  return [partitioning.shard_batch(data.pad_batch(
      token_rows[start:start + batch_size], None, max_length, OUTPUT_LENGTH, batch_size, step),
      partitioner().mesh) for start in range(0, len(token_rows), batch_size)]


def _sharded(pair: pipeline.Pair) -> pipeline.Pair:
  """The pair with its (prepared) params placed on the mesh, as the infer job places them."""
  shardings = partitioner().pair_shardings(pair.model(), pair.params)
  return dataclasses.replace(pair, params=partitioning.shard_params(pair.params, shardings))


@functools.lru_cache(maxsize=4)
def load_pair(target: str = str(pipeline.EMBEDDED_TARGET),
              draft: str = str(pipeline.EMBEDDED_DRAFT), dtype: Optional[str] = None
              ) -> pipeline.Pair:
  """A target/draft pair (default: the embedded one), prepared and sharded, in `dtype` (None: as
  stored; 'bfloat16': parameters and activations); loaded once per process (the tests')."""
  return _sharded(pipeline.load_pair(target, draft, dtype=dtype))


def make_pair(target_config: network.T5Config, draft_config: network.T5Config,
              params: Mapping[str, Any]) -> pipeline.Pair:
  """A pair of given (e.g. random) params {'target', 'draft'}, prepared as `load_pair`'s."""
  prepared = pipeline.prepare_params(target_config, draft_config, params)
  vocabulary = data.SentencePieceVocabulary(str(data.VOCAB_PATH))
  return _sharded(pipeline.Pair(target_config, draft_config, prepared, vocabulary))


@dataclasses.dataclass
class Compiled:
  """A setting compiled for every width of `batches`, with its policy; `one_pass` decodes every
  batch once, `pieces` too, in pieces that take turns with other passes'. Each pass is a job
  from scratch (under 'auto' a fresh policy, its search timed with the job); choices_used
  counts every pass's choices. keys: each pass's key per batch (`pass_keys`), pass p the
  (p mod len(keys))-th; history: every pass's outputs, in order (the untimed one first)."""
  setting: Setting
  predictor: pipeline.Predictor
  decoding_policy: policy.DecodingPolicy
  batches: List[Batch]
  keys: List[List[jax.Array]]
  choices_used: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  history: List[Outputs] = dataclasses.field(default_factory=list)

  def pieces(self, batches_per_piece: int) -> Iterator[Outputs]:
    """Every batch once as the infer job runs them (`DecodingPolicy.stream`: under 'auto' each
    chosen and timed by the policy), `batches_per_piece` at a time."""
    self.decoding_policy = self.decoding_policy.fresh()
    items = list(zip(self.batches, self.keys[len(self.history) % len(self.keys)]))
    self.history.append([])
    for start in range(0, len(items), batches_per_piece):
      outputs = []
      for _, choice, out in self.decoding_policy.stream(
          items[start:start + batches_per_piece], lambda c, item: self.predictor(c, *item)):
        self.choices_used[choice] += 1
        outputs.append(out)
      self.history[-1].extend(outputs)
      yield outputs

  def one_pass(self) -> Outputs:
    """Every batch once, in one piece."""
    return next(self.pieces(len(self.batches)))

  def info(self) -> Dict[str, Any]:
    """compile_s, and under gamma='auto' the policy's measurements and batches per gamma."""
    out = {'compile_s': self.predictor.compile_seconds}
    if policy.AUTO in (self.setting.gamma, self.setting.branching):
      out.update(gammas_used={str(g): n for g, n in sorted(self.choices_used.items())},
                 policy=self.decoding_policy.summary())
    return out


def pass_keys(seed: int, num_batches: int, passes: int = 1) -> List[List[jax.Array]]:
  """[passes][num_batches] keys: pass 0's batch i fold_in(PRNGKey(seed), i) (the infer job's),
  pass p's that key folded with p; made before anything is timed (or it would be timed too)."""
  first = [jax.random.fold_in(jax.random.PRNGKey(seed), i) for i in range(num_batches)]
  return [first] + [[jax.random.fold_in(key, p) for key in first] for p in range(1, passes)]


def compile_setting(setting: Setting, pair: pipeline.Pair, batches: List[Batch], *,
                    decode_overrides: Optional[Mapping[str, Any]] = None,
                    eos_id: Optional[int] = None, seed: int = 0,
                    calibration: Optional[costs.Calibration] = None,
                    sampled_passes: int = 1, policy_module: Any = policy) -> Compiled:
  """`setting` on `pair`, compiled for every (choice, encoder width) `batches` need (under
  'auto' every choice `policy.plan` gives). decode_overrides: extra decode_fn arguments;
  eos_id: replaces the vocabulary's (-1: no row stops early); calibration: where 'auto' starts
  (`policy.plan`); sampled_passes: how many passes draw their own samples (`pass_keys`);
  policy_module: the module whose `plan` makes the policy (another policy.py, to compare)."""
  decode_fn, kwargs = setting.decoder()
  kwargs = {**kwargs, **(decode_overrides or {})}
  model = pair.model(decode_fn, kwargs)
  if eos_id is not None:
    model = copy.copy(model)
    model.eos_id = model.draft_eos_id = eos_id
  decoding_policy, decoders = policy_module.plan(
      model, kwargs, calibration=calibration,
      batch_size=len(batches[0]['encoder_input_tokens']) if batches else None,
      num_decodes=max(setting.beam, 1))
  predictor = pipeline.Predictor(decoders, pair.params, partitioner(),
                                 num_decodes=max(setting.beam, 1))
  keys = pass_keys(seed, len(batches), sampled_passes)
  for choice in predictor.choices:
    for batch in batches:
      predictor.compile(choice, batch, keys[0][0])
  return Compiled(setting, predictor, decoding_policy, batches, keys)


def warm(passes: Mapping[Hashable, Callable[[], Any]]) -> Dict[Hashable, Any]:
  """One untimed call of every pass (compiles what is left, warms caches): their outputs (a
  pass in pieces, `Compiled.pieces`: its pieces' outputs, joined)."""
  outputs = {key: one_pass() for key, one_pass in passes.items()}
  return {key: jax.block_until_ready([o for piece in out for o in piece]
                                     if isinstance(out, Iterator) else out)
          for key, out in outputs.items()}


def speedups(times: Mapping[Hashable, Sequence[float]], base: Hashable
             ) -> Dict[Hashable, Dict[str, float]]:
  """Per key: speedup over `base` (1 / the median over rounds of its time relative to base's in
  the same round, `policy.relative_medians`) and its min and max over rounds."""
  relative = policy.relative_medians(times, base)
  ratios = {key: np.asarray(times[base]) / np.asarray(seconds) for key, seconds in times.items()}
  return {key: {'speedup': 1.0 / relative[key], 'speedup_min': float(r.min()),
                'speedup_max': float(r.max())} for key, r in ratios.items()}


def collect(outputs: Outputs, num_sentences: int) -> Dict[str, Any]:
  """{'decodes', 'stats'} of one pass without the padding rows, and for a draft-verify loop
  'loop_iterations': the target calls its batches made (per batch, its row with the most)."""
  decodes = np.concatenate([np.asarray(d) for d, _ in outputs])[:num_sentences]
  per_batch = [jax.tree.map(np.asarray, aux.get('stats', {})) for _, aux in outputs]
  stats = pipeline.merge_stats(per_batch, [len(d) for d, _ in outputs], num_sentences)
  out = {'decodes': decodes, 'stats': stats}
  if per_batch and all('target_calls' in s for s in per_batch):
    # A batch's loop runs until its slowest row (padding rows included) is done.
    out['loop_iterations'] = int(sum(np.max(s['target_calls']) for s in per_batch))
  return out


def collect_passes(passes: Sequence[Outputs], num_sentences: int) -> Dict[str, Any]:
  """`collect` over every pass of a setting (`Compiled.history`): the first pass's decodes, every
  pass's stats pooled (each row once per pass), loop_iterations the mean per pass, and
  tokens_per_pass, each pass's tokens written (EOS included: what a per-token speed counts)."""
  runs = [collect(p, num_sentences) for p in passes]
  out = {**runs[0], 'tokens_per_pass': [int(np.sum(r['decodes'] > 0)) for r in runs]}
  keys = sorted({k for r in runs for k in r['stats']})
  if keys:
    width = max([np.shape(r['stats'][k])[1] for r in runs for k in r['stats']
                 if np.ndim(r['stats'][k]) == 2] or [0])
    out['stats'] = {k: np.concatenate([_row_field(r['stats'], k, num_sentences, width)
                                       for r in runs]) for k in keys}
  iterations = [r['loop_iterations'] for r in runs if 'loop_iterations' in r]
  if iterations:
    out['loop_iterations'] = float(np.mean(iterations))
  return out


def _row_field(stats: Mapping[str, np.ndarray], key: str, rows: int, width: int) -> np.ndarray:
  """One pass's per-row field, zeros where the pass ran no decoder with statistics (the target
  alone under 'auto'), a [rows, gamma] field padded to `width`."""
  value = stats.get(key, np.zeros((rows, width) if key == 'accepted_at' else rows, np.int32))
  if np.ndim(value) == 2:
    value = np.pad(value, ((0, 0), (0, width - value.shape[1])))
  return value


def speedups_per_token(times: Mapping[Hashable, Sequence[float]],
                       tokens: Mapping[Hashable, Sequence[int]], base: Hashable
                       ) -> Dict[Hashable, Dict[str, float]]:
  """Per key: its speedup over `base` per output token (as `speedups`, each round counting the
  tokens its own passes wrote: `tokens`, each pass's, the untimed first), and summed times over
  summed tokens of all rounds (`speedup_summed`: a slow round weighs by its time, as in a long
  job) with its 90% interval, rounds resampled with replacement (BOOTSTRAP draws, fixed seed)."""
  timed = {k: (np.asarray(t), np.asarray(tokens[k][-len(t):], float)) for k, t in times.items()}
  picks = np.random.default_rng(0).integers(0, len(times[base]), (BOOTSTRAP, len(times[base])))
  summed = {k: t[picks].sum(1) / n[picks].sum(1) for k, (t, n) in timed.items()}
  out = {}
  for key, (seconds, count) in timed.items():
    ratios = (timed[base][0] / timed[base][1]) / (seconds / count)
    low, high = np.percentile(summed[base] / summed[key], [5, 95])
    out[key] = {'speedup_per_token': 1.0 / float(np.median(1.0 / ratios)),
                'speedup_per_token_min': float(ratios.min()),
                'speedup_per_token_max': float(ratios.max()),
                'speedup_summed': float((timed[base][0].sum() / timed[base][1].sum()) /
                                        (seconds.sum() / count.sum())),
                'speedup_summed_low': float(low), 'speedup_summed_high': float(high)}
  return out


def ms_per(seconds: Sequence[float], count: int) -> float:
  """Median over rounds of a pass's seconds, in ms per one of its `count` items."""
  return 1e3 * float(np.median(seconds)) / count


def count_acceptance(pair: pipeline.Pair, sources: Sequence[str], settings: Sequence[Setting],
                     batch_size: int,
                     written: Optional[Callable[[List[Dict[str, Any]]], Any]] = None
                     ) -> List[Dict[str, Any]]:
  """Hardware-free counts: one pass of each setting over `sources` (the same seeds for all), a
  row each: alpha, accepted and emitted tokens per target call; `written(rows)` after each."""
  batches = make_batches(data.encode(sources, INPUT_LENGTH), batch_size, width=INPUT_LENGTH)
  rows = []
  for setting in settings:
    counts = acceptance(collect(compile_setting(setting, pair, batches).one_pass(),
                                len(sources))['stats'])
    rows.append({'name': setting.name, **setting._asdict(), **{k: counts[k] for k in (
        'alpha', 'accepted_per_call', 'tokens_per_call', 'accepted_fraction')}})
    print(f"{setting.name}: alpha {counts['alpha']:.3f}, {counts['tokens_per_call']:.3f} "
          'tokens per call', flush=True)
    if written:
      written(rows)
  return rows


# The step probe is the calibrate command's (one implementation).
step_times_ms = calibrate.step_times_ms


def _timed_best(fn: Callable[[], Any], rounds: int) -> float:
  """The fastest of `rounds` calls of fn (after one that compiles)."""
  return min(policy.round_robin({'fn': fn}, rounds + 1)['fn'][1:])


def probe_machine(pair: pipeline.Pair) -> Dict[str, Any]:
  """Memory bandwidth (a jitted sum streaming 64 MB), the matmul peak (a float32 1024x1024
  matmul) and each model's weight-streaming floor of one step (`step_weight_bytes`)."""
  x, m = jnp.ones((2**24,), jnp.float32), jnp.ones((1024, 1024), jnp.float32)
  total, product = jax.jit(jnp.sum), jax.jit(jnp.matmul)
  bandwidth = x.size * 4 / _timed_best(lambda: total(x), 30) / 1e9
  gflops = 2 * 1024 ** 3 / _timed_best(lambda: product(m, m), 10) / 1e9
  return {'memory_bandwidth_gbs': bandwidth, 'matmul_gflops': gflops,
          'weight_streaming_floor_ms': {
              name: 1e3 * step_weight_bytes(pair.params[name]) / (bandwidth * 1e9)
              for name in pair.configs}}


def step_weight_bytes(params: Any) -> int:
  """Parameter bytes a cached decoder step reads: the decoder without its cross-attention k/v
  kernels (applied once, to the encoder output), plus the embedding (lookup and tied logits)."""
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params['decoder'])[0]:
    names = [getattr(k, 'key', '') for k in path]
    if not ('encoder_decoder_attention' in names and ('key' in names or 'value' in names)):
      total += leaf.size * leaf.dtype.itemsize
  embedding = params['token_embedder']['embedding']
  return total + embedding.size * embedding.dtype.itemsize


def compute_floor_ms(config: network.T5Config, batch: int, k: int, gflops: float) -> float:
  """ms of a k-token step's arithmetic at `gflops`: 2 flops per multiply-add, batch * k rows."""
  return 2e3 * config.decode_flops_per_token() * batch * k / (gflops * 1e9)


def param_count(params: Any) -> int:
  return int(sum(x.size for x in jax.tree_util.tree_leaves(params)))


def summarize(setting: Setting, run: Mapping[str, Any], baseline_decodes: np.ndarray,
              steps: Mapping[str, Mapping[int, float]], c_hat: float,
              references: Sequence[str], vocabulary: Any) -> Dict[str, Any]:
  """The table row of one configuration (JSON-ready). run: `collect_passes`' decodes and stats,
  the timing (ms_per_sentence, speedups) and `Compiled.info()`; steps: {'target': {k: ms},
  'draft': {k: ms}} (`step_times_ms`). ms_per_call: ms per loop iteration (one target call)."""
  row = _summary(setting, run, baseline_decodes, steps, c_hat, references, vocabulary)
  if run.get('loop_iterations') and 'ms_per_sentence' in row:
    # What one target call (with its draft phase) costs: two verifiers' calls compare directly.
    row['ms_per_call'] = row['ms_per_sentence'] * len(baseline_decodes) / run['loop_iterations']
  return row


def _summary(setting: Setting, run: Mapping[str, Any], baseline_decodes: np.ndarray,
             steps: Mapping[str, Mapping[int, float]], c_hat: float,
             references: Sequence[str], vocabulary: Any) -> Dict[str, Any]:
  texts = [vocabulary.decode(row) for row in run['decodes']]
  row = {'name': setting.name, **setting._asdict(),
         **{k: v for k, v in run.items() if k not in ('decodes', 'stats')},
         'bleu': data.corpus_bleu(texts, references),
         'same_as_baseline': float(np.mean(np.all(run['decodes'] == baseline_decodes, axis=1))),
         'target_step_ms': steps['target'][1]}
  stats = run['stats']
  if setting.method == 'speculative_beam':
    return {**row, **beam_row(setting, stats, steps)}
  if setting.method in ('baseline', 'beam') or not stats:
    # Tokens written, EOS included (it is a token > 0): what the loops' `emitted` counts.
    row['tokens_per_sentence'] = float(np.mean(run.get('tokens_per_pass') or
                                               [np.sum(run['decodes'] > 0)]) / len(run['decodes']))
    return row
  row.update(acceptance(stats))
  if setting.method == 'tree':
    return row  # no chain cost model for a tree (its verify call scores all nodes)
  gamma = setting.gamma
  if gamma == policy.AUTO:
    # Predictions for the gamma chosen most often.
    gamma = int(max(run['gammas_used'].items(), key=lambda item: item[1])[0])
    if gamma == 0:
      return row
  row.update(predictions(setting, gamma, row, steps, c_hat))
  return row


def acceptance(stats: Mapping[str, np.ndarray]) -> Dict[str, Any]:
  """The draft-verify loop's counts per target call, from per-row `DecodeStats` fields."""
  totals = {k: int(v.sum()) for k, v in stats.items() if k != 'accepted_at'}
  calls = max(totals['target_calls'], 1)
  proposed, accepted = totals['proposed'], totals['accepted']
  # The paper's alpha is the acceptance probability of a draft position that is reached (one
  # after a rejection is not): every reached position ends in an acceptance or in a rejection,
  # and a call has at most one rejection (counted in `rollbacks`).
  return dict(totals=totals, alpha=accepted / max(accepted + totals['rollbacks'], 1),
              accepted_fraction=accepted / max(proposed, 1), accepted_per_call=accepted / calls,
              tokens_per_call=totals['emitted'] / calls,
              draft_calls_per_target_call=totals['draft_calls'] / calls,
              tokens_per_sentence=float(np.mean(stats['emitted'])),
              fallbacks=totals['fallbacks'], rollbacks=totals['rollbacks'],
              # P(the first i+1 proposals of a target call were all accepted), i = 0..gamma-1.
              accepted_at=(stats['accepted_at'].sum(axis=0) / calls).tolist())


def predictions(setting: Setting, gamma: int, row: Mapping[str, Any],
                steps: Mapping[str, Mapping[int, float]], c_hat: float) -> Dict[str, Any]:
  """c, the paper's predicted speedup, efficiency, extra arithmetic and the step-cost
  prediction of a speculative or BiLD row at (static) gamma."""
  # The verify chunk is always (static gamma) + 1 tokens wide; BiLD's gamma is max_small_steps.
  verify_k = (gamma if setting.method == 'speculative' else BILD_MAX_SMALL_STEPS) + 1
  c = steps['draft'][1] / steps['target'][1]
  out = dict(c=c, c_hat=c_hat, draft_step_ms=steps['draft'][1],
             verify_step_ms=steps['target'].get(verify_k))
  if setting.method != 'speculative':
    return out
  calls = max(row['totals']['target_calls'], 1)
  mean_gamma = row['totals']['proposed'] / calls if setting.adaptive else gamma
  tokens = costs.expected_tokens(row['alpha'], mean_gamma)
  # Leviathan et al.: the expected walltime improvement (Theorem 3.8) and the operations per
  # token relative to the baseline (Theorem 3.11).
  prediction = tokens / (mean_gamma * c + 1)
  out.update(gamma_mean=mean_gamma, predicted_speedup=prediction,
             efficiency=row['speedup'] / prediction,
             extra_arithmetic=(mean_gamma * c_hat + mean_gamma + 1) / tokens)
  if not setting.adaptive and verify_k in steps['target']:
    # The same expected tokens per call, but the verify call costs its measured k-token time.
    # Each draft phase's first call feeds 2 tokens (see decoding._draft_phase).
    cost = (steps['draft'][2] + (row['draft_calls_per_target_call'] - 1) * steps['draft'][1] +
            steps['target'][verify_k])
    out['step_cost_prediction'] = row['tokens_per_call'] * steps['target'][1] / cost
  return out


def verify_sizes(settings: Sequence[Setting]) -> List[int]:
  """The target step sizes (tokens per row) the rows of `settings` need: 1, 2, every verify
  chunk (gamma + 1; every candidate's under 'auto'; BiLD's max_small_steps + 1)."""
  sizes = {1, 2}
  for s in settings:
    if s.method == 'speculative':
      gammas = range(1, policy.MAX_GAMMA + 1) if s.gamma == policy.AUTO else [s.gamma]
      sizes.update(g + 1 for g in gammas)
    elif s.method == 'bild':
      sizes.add(BILD_MAX_SMALL_STEPS + 1)
  return sorted(sizes)


def tree_levels(branching: Sequence[int]) -> List[int]:
  """Nodes per depth of one beam's token tree (root first): (4, 2) -> [1, 4, 8]."""
  return np.cumprod((1, *branching)).tolist()


def beam_steps_ms(pair: pipeline.Pair, rows: int, branching: Sequence[int]
                  ) -> Dict[str, Dict[int, float]]:
  """Step times of speculative beam search's calls at batch x beam `rows`: the target with 1
  token and with the whole tree, the draft per tree level."""
  levels = tree_levels(branching)
  return {'target': step_times_ms(pair, 'target', rows, (1, sum(levels))),
          'draft': step_times_ms(pair, 'draft', rows, sorted(set(levels[:-1])))}


def beam_row(setting: Setting, stats: Mapping[str, np.ndarray],
             steps: Mapping[str, Mapping[int, float]]) -> Dict[str, Any]:
  """Speculative beam search's columns: beam steps and tree nodes per target call, and the
  step-cost prediction (steps per call x a beam_search step / (draft levels + tree verify)).
  Per-example stats: `emitted` counts beam steps, `proposed` tree nodes below the roots (none
  where no batch ran a tree: branching='auto' that kept to beam_search)."""
  if 'target_calls' not in stats:
    return {}
  levels = tree_levels(setting.tree)
  calls = max(int(stats['target_calls'].sum()), 1)
  steps_per_call = int(stats['emitted'].sum()) / calls
  draft_ms = sum(steps['draft'][n] for n in levels[:-1])
  verify_ms = steps['target'][sum(levels)]
  return {'steps_per_call': steps_per_call, 'tokens_per_call': steps_per_call,
          'nodes_per_call': int(stats['proposed'].sum()) / calls + 1,
          'target_calls': calls, 'beam_step_ms': steps['target'][1],
          'verify_step_ms': verify_ms, 'draft_step_ms': draft_ms,
          'step_cost_prediction': steps_per_call * steps['target'][1] / (draft_ms + verify_ms)}


def machine() -> Dict[str, Any]:
  """What the numbers were measured on."""
  device = jax.devices()[0]
  return {'machine': f'{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, '
                     f'jax {jax.__version__} on {device.platform} ({device.device_kind}, '
                     f'{jax.device_count()} device(s))',
          'jax': jax.__version__, 'xla_flags': os.environ.get('XLA_FLAGS', '')}


def meta(name: str, argv: Optional[Sequence[str]], args: argparse.Namespace,
         **extra: Any) -> Dict[str, Any]:
  """The results' 'meta': the command, the machine and the shapes every command shares."""
  return {'command': command_line(name, argv), **machine(), 'rounds': args.rounds,
          'input_length': INPUT_LENGTH, 'input_length_step': args.input_length_step,
          'output_length': OUTPUT_LENGTH, **extra}


def repo_path(path: str) -> str:
  """`path` relative to the repository where it lies inside it (results name no machine's)."""
  try:
    return str(Path(path).resolve().relative_to(REPO))
  except ValueError:
    return path


def out_dir(args: argparse.Namespace) -> Path:
  return Path(args.out_dir) if args.out_dir else Path('runs') / args.machine


def _json_ready(value: Any) -> Any:
  """numpy scalars and arrays, tuples and non-string keys as JSON takes them."""
  if isinstance(value, dict):
    return {str(k): _json_ready(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_json_ready(v) for v in value]
  if isinstance(value, (np.ndarray, np.generic)):
    return value.tolist()
  return value


def write_results(args: argparse.Namespace, name: str, results: Mapping[str, Any],
                  markdown: Callable[[Dict[str, Any]], str]) -> Tuple[Path, Path]:
  """Writes <out_dir>/<name>.json and .md, the tables `markdown` makes of the results as read
  back from the JSON (a saved file renders the same); after every block (a killed run keeps it)."""
  directory = out_dir(args)
  directory.mkdir(parents=True, exist_ok=True)
  paths = directory / f'{name}.json', directory / f'{name}.md'
  text = json.dumps(_json_ready(results), indent=1)
  paths[0].write_text(text + '\n')
  paths[1].write_text(markdown(json.loads(text)).rstrip('\n') + '\n')
  return paths


def greedy_settings(gammas: str, auto: bool = True) -> List[Setting]:
  """Target-only greedy decoding, then greedy speculative decoding at each of --gammas."""
  return [Setting('baseline')] + [Setting('speculative', gamma=g)
                                  for g in parse_ints(gammas, '--gammas', auto)]


def auto_note(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]] = ()) -> str:
  """One line on a gamma='auto' row: what the policy measured and the batches per gamma; then
  its time against the fastest fixed gamma among `rows` of its sampling (by summed time) and the
  target alone: the median over rounds of their pass time over its in the same round (the
  figure 'auto' is held to), and their summed times over its."""
  used = ', '.join(f'gamma {g}: {n}' for g, n in row['gammas_used'].items())
  measured = row['policy'].get('measured', {})
  line = (f"{row['name']}: batches per gamma over all passes (the untimed one included), each "
          f"pass a job from scratch: {used}; the last pass's ms per output position: " +
          ', '.join(f"gamma {g}: {m['ms_per_position']}" for g, m in measured.items()) + '.')
  peers = [r for r in rows if not (r['policy'] or r['adaptive']) and all(
      r[k] == row[k] for k in ('temperature', 'topp', 'verification'))]
  fixed = [r for r in peers if r['method'] == 'speculative' and r['gamma'] != policy.AUTO]
  best = [min(fixed, key=lambda r: sum(r['seconds_per_round']))] if fixed else []
  for other in best + [r for r in peers if r['method'] == 'baseline'][:1]:
    times = other['seconds_per_round'], row['seconds_per_round']
    line += (f" Against {other['name']}: {np.median(np.divide(*times)):.3f} by the paired "
             f"median, {sum(times[0]) / sum(times[1]):.3f} summed.")
  return line


def fmt(value: Any, spec: str) -> str:
  """value formatted with spec, or '' for a missing value (a table cell)."""
  return '' if value is None else format(value, spec)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
  """Markdown table lines."""
  return (['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)] +
          ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows])


def heading(title: str, results: Mapping[str, Any]) -> List[str]:
  """A results file's title, command and machine lines."""
  return [f'# {title}', '', f"Command: `{results['meta']['command']}`", '',
          f"Machine: {results['meta']['machine']}", '']
