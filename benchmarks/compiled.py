"""What a compiled XLA program says about itself: memory, cost, and the collectives of its loops.

Imports only JAX and numpy, so that the T5X side of `benchmarks.scale` (a separate process in
T5X's own environment, `benchmarks.scale_t5x`) reads its programs with the same code. XLA's
cost analysis counts a `while` body once, not times its trip count (`while_cost_is_per_body`):
per-step figures come from programs compiled without loops. The HLO text parser reads the
optimised module (`compiled.as_text()`); collectives are counted per computation, following
calls, conditionals and nested loops but not fusions (a collective is never fused).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import math
import re
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute',
               'collective-broadcast')
# Instructions that move data between host and device (a loop body should hold none).
HOST_TRANSFERS = ('send', 'recv', 'send-done', 'recv-done', 'infeed', 'outfeed')
_DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2, 's32': 4,
                'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8, 'c128': 16,
                'f8e4m3fn': 1, 'f8e5m2': 1, 'token': 0}
_COMPUTATION = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$')
_INSTRUCTION = re.compile(r'^\s*(ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*?)\s+([a-z][\w\-]*)\((.*)$')
_ARRAY = re.compile(r'\b([a-z]+\d*(?:e\dm\d\w*)?)\[([\d,]*)\]')
_CALLEES = re.compile(r'(?:calls|to_apply|body|condition|true_computation|false_computation)='
                      r'%?([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')


def shape_bytes(shape_text: str) -> int:
  """Bytes of an HLO result type: 'bf16[8,64]{1,0}' or a tuple of such."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape_text):
    if dtype in _DTYPE_BYTES:
      total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(',') if d)
  return total


@dataclasses.dataclass
class Instruction:
  name: str
  opcode: str
  shape: str       # the result type as printed
  rest: str        # operands and attributes
  computations: Tuple[str, ...] = ()   # called computations (not fusion bodies' internals)

  @property
  def bytes(self) -> int:
    return shape_bytes(self.shape)


@dataclasses.dataclass
class Module:
  """An HLO module's computations (name -> instructions) and its ENTRY's name."""
  computations: Dict[str, List[Instruction]]
  entry: str

  @classmethod
  def parse(cls, text: str) -> 'Module':
    computations, entry, current = {}, '', None
    for line in text.splitlines():
      header = _COMPUTATION.match(line)
      if header:
        current = header.group(2)
        computations[current] = []
        if header.group(1):
          entry = current
        continue
      if current is None:
        continue
      match = _INSTRUCTION.match(line)
      if match:
        _, name, shape, opcode, rest = match.groups()
        called = _CALLEES.findall(rest)
        for group in _BRANCHES.findall(rest):
          called += [c.strip().lstrip('%') for c in group.split(',')]
        if opcode == 'fusion':
          called = []  # a fusion's body holds no collective and no loop
        computations[current].append(Instruction(name, opcode, shape, rest, tuple(called)))
    return cls(computations, entry)

  def whiles(self, computation: Optional[str] = None) -> List[Tuple[str, str]]:
    """(while instruction, body computation) reachable from `computation` (default ENTRY),
    outermost first, each loop's nested loops after it."""
    out = []
    for inst in self.computations.get(computation or self.entry, []):
      if inst.opcode == 'while':
        body = re.search(r'body=%?([\w.\-]+)', inst.rest).group(1)
        out.append((inst.name, body))
        out += self.whiles(body)
      else:
        for callee in inst.computations:
          if callee in self.computations and 'condition=' not in inst.rest:
            out += self.whiles(callee)
    return out

  def instructions(self, computation: str, into_loops: bool = False) -> List[Instruction]:
    """Instructions of `computation` and of what it calls (not fusion internals); a nested
    while's body and condition only with into_loops."""
    out = []
    for inst in self.computations.get(computation, []):
      out.append(inst)
      if inst.opcode == 'while' and not into_loops:
        continue
      for callee in inst.computations:
        if callee in self.computations and callee != computation:
          out += self.instructions(callee, into_loops)
    return out


def entry_ops(module: Module) -> int:
  """Ops a program's ENTRY runs (fusions, dots, copies, collectives, ...), not counting
  parameters, constants and tuple plumbing: the kernel launches of a straight-line program."""
  plumbing = ('parameter', 'constant', 'tuple', 'get-tuple-element', 'bitcast')
  return sum(i.opcode not in plumbing for i in module.computations[module.entry])


def entry_cycles(text: str) -> int:
  """XLA:TPU's scheduled estimate of a straight-line program: the sum of the `estimated_cycles`
  its backend config gives each ENTRY instruction. Unlike `optimal_seconds` (a bound for the
  whole program, in which a draft's second call costs a fraction of its first) it adds up call
  by call, so a loop's own work is what an iteration's sum exceeds its calls' sums by."""
  entry = text[text.index('\nENTRY'):]
  return sum(int(c) for c in re.findall(r'"estimated_cycles":"(\d+)"', entry))


def collectives(instructions: List[Instruction]) -> Dict[str, Dict[str, int]]:
  """{kind: {'count', 'bytes'}} of the collectives among `instructions` (result bytes; an async
  pair counts once, at its start)."""
  out = collections.defaultdict(lambda: {'count': 0, 'bytes': 0})
  for inst in instructions:
    kind = inst.opcode[:-len('-start')] if inst.opcode.endswith('-start') else inst.opcode
    if kind in COLLECTIVES:
      out[kind]['count'] += 1
      # An async start returns (operand, result, ...): the result is its largest array.
      out[kind]['bytes'] += (max((shape_bytes(m.group(0)) for m in _ARRAY.finditer(inst.shape)),
                                 default=0) if inst.opcode.endswith('-start') else inst.bytes)
  return dict(out)


_SHORT = {'all-reduce': 'AR', 'all-gather': 'AG', 'reduce-scatter': 'RS', 'all-to-all': 'A2A',
          'collective-permute': 'CP', 'collective-broadcast': 'CB'}


def collective_text(table: Mapping[str, Mapping[str, int]]) -> str:
  """A `collectives` table as 'AR 75 (2.3 MB), AG 32 (0.4 MB)', or '0'."""
  if not table:
    return '0'
  return ', '.join(f"{_SHORT.get(k, k)} {v['count']} ({v['bytes'] / 1e6:.2g} MB)"
                   for k, v in sorted(table.items()))


def loop_report(text: str, big_bytes: int) -> List[Dict[str, Any]]:
  """Per while loop of a compiled module: its collectives per iteration (the body alone, nested
  loops apart), copies of at least `big_bytes` (e.g. one cache layer's shard) inside the body,
  and how many dtype conversions of that size it runs."""
  module = Module.parse(text)
  out = []
  for _, body in module.whiles():
    own = module.instructions(body)
    big = [i for i in own if i.opcode in ('copy', 'copy-start') and i.bytes >= big_bytes]
    # Cache-sized dtype conversions: XLA:CPU computes bfloat16 scatters and dots in float32, so
    # it converts each cache layer up and back around its in-place update.
    converts = [i for i in own if i.bytes >= big_bytes and (
        i.opcode == 'convert' or (i.opcode == 'fusion' and i.name.startswith('wrapped_convert')))]
    host = [i for i in own if i.opcode in HOST_TRANSFERS or (
        i.opcode == 'custom-call' and 'host' in i.rest.lower())]
    out.append({'body': body, 'host_transfers': len(host), 'collectives': collectives(own),
                'nested': [b for _, b in module.whiles(body)], 'big_converts': len(converts),
                'big_copies': [{'name': i.name, 'shape': i.shape, 'bytes': i.bytes} for i in big]})
  return out


def memory(compiled: Any) -> Dict[str, int]:
  """Per-device bytes from XLA's memory analysis (arguments, outputs, temporaries, code)."""
  analysis = compiled.memory_analysis()
  fields = ('argument_size_in_bytes', 'output_size_in_bytes', 'temp_size_in_bytes',
            'alias_size_in_bytes', 'generated_code_size_in_bytes')
  return {f.replace('_size_in_bytes', '_bytes'): int(getattr(analysis, f, 0) or 0)
          for f in fields}


def cost(compiled: Any) -> Dict[str, float]:
  """flops and bytes accessed of one device's program (loop bodies counted once)."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  out = {'flops': float(analysis.get('flops', 0.0)),
         'bytes_accessed': float(analysis.get('bytes accessed', 0.0))}
  if 'optimal_seconds' in analysis:  # XLA:TPU's own estimate of the program's time
    out['optimal_seconds'] = float(analysis['optimal_seconds'])
  return out


def sharded_bytes(tree: Any, shardings: Any) -> int:
  """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) under `shardings`; for a
  sharding that splits unevenly, the largest shard."""
  total = 0
  for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    shard = sharding.shard_shape(leaf.shape)
    total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
  return total


def while_cost_is_per_body(trips: Tuple[int, int] = (1, 16)) -> Dict[str, float]:
  """Flops XLA's cost analysis gives a fori_loop of a [64, 64] matmul at two trip counts: equal
  values mean a while body is counted once, whatever its trip count."""
  x = jnp.ones((64, 64), jnp.float32)
  out = {}
  for n in trips:
    fn = jax.jit(lambda a, n=n: jax.lax.fori_loop(0, n, lambda _, b: jnp.tanh(b @ a), a))
    out[str(n)] = cost(fn.lower(x).compile())['flops']
  return out


def config_values(gin_file: Path) -> Dict[str, Any]:
  """`scope/network.T5Config.<field> = <literal>` bindings of a shipped model gin file, as a dict
  of field values (the model files hold only literals)."""
  values = {}
  for line in Path(gin_file).read_text().splitlines():
    match = re.match(r'^\s*[\w/.]*T5Config\.(\w+)\s*=\s*(.+?)\s*$', line)
    if match:
      values[match.group(1)] = ast.literal_eval(match.group(2))
  return values


def time_compile(fn: Callable[[], Any]) -> Tuple[Any, float]:
  """(fn(), seconds)."""
  start = time.perf_counter()
  result = fn()
  return result, time.perf_counter() - start


def summarize_loops(loops: List[Dict[str, Any]]) -> Mapping[str, Any]:
  """Collectives of one iteration of each loop, as {'outer': ..., 'inner': ...}: the outermost
  loop's body and the first loop nested in it (the speculative loop's draft phase)."""
  if not loops:
    return {}
  outer = loops[0]
  inner = next((l for l in loops[1:] if l['body'] in outer['nested']), None)
  return {'outer': outer['collectives'],
          'inner': inner['collectives'] if inner else {},
          'big_copies': sum(len(l['big_copies']) for l in loops),
          'host_transfers': sum(l['host_transfers'] for l in loops),
          'big_converts': {'outer': outer['big_converts'],
                           'inner': inner['big_converts'] if inner else 0}}
