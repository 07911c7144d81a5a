"""This project's decoders against CTranslate2 on the embedded target, each in its own process.

  python -m benchmarks.vs_ctranslate2 --sentences 1:64,8:192,32:320 --gammas 2,4 --rounds 3

Needs CTranslate2, transformers, torch and sacrebleu (`pip install -e '.[bench]'`; without them,
one line before anything compiles). The target is exported as a Hugging Face folder and
converted to float32 and int8 in a process of its own, with the project's SentencePiece pieces,
so both engines see the same ids. Ours: target-only greedy, speculative greedy at each --gammas,
beam search (--beam, brevity penalty 0.6). CTranslate2's (a spawned process, inter_threads=1,
intra_threads=--ct2_threads): greedy and beam search per compute type, on the same groups.

Each round times one engine's passes round-robin, then the other's (alternating which first);
the waiting engine blocks on a pipe, so their threads never share the cores. Speedups: the
median over rounds of our target-only greedy pass (and our pass of the same search) over the
configuration's; per batch size also the share of ids equal to ours and rows per target call
against the machine's bandwidth/arithmetic crossover (`harness.probe_machine`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import importlib.metadata
import json
import multiprocessing
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import numpy as np

from benchmarks import harness
from benchmarks.harness import Setting
from speculative_t5x import data
from speculative_t5x import hf
from speculative_t5x import pipeline
from speculative_t5x import policy

NAME = 'vs_ctranslate2'
# CTranslate2 and its converter's (transformers, torch); sacrebleu for the BLEU column.
NEEDS = (('ctranslate2', 'CTranslate2'), ('transformers', "CTranslate2's T5 converter"),
         ('torch', "CTranslate2's T5 converter"), harness.BLEU)
COMPUTE_TYPES = ('float32', 'int8')
# Between one engine's turn and the other's: OpenMP (CTranslate2's libgomp) and XLA's thread
# pool keep spinning for a while after their last parallel region; a pause keeps that spin out
# of the other engine's timed turn.
HANDOFF_PAUSE_S = 0.3
OURS = Setting('baseline').name  # what every speedup is measured against


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = harness.parser(__doc__, sentences='1:64,8:192,32:320', gammas='2,4', needs=NEEDS)
  p.add_argument('--beam', type=int, default=4,
                 help='beam size of both engines (below 2: no beam search)')
  p.add_argument('--ct2_threads', type=int, default=2, help="CTranslate2's intra_threads")
  return p.parse_args(argv)


def convert_models(hf_dir: str, outputs: Mapping[str, str], pieces: Sequence[str]) -> None:
  """Converts the Hugging Face folder to CTranslate2 once per {quantization: output folder}.
  Runs in a process of its own (it imports torch and transformers)."""
  import ctranslate2  # pylint: disable=g-import-not-at-top
  converter = ctranslate2.converters.TransformersConverter(hf_dir)
  # The folder has no tokenizer files: the converter's AutoTokenizer would then build a stock
  # T5 tokenizer (104 tokens, none of them ours) and pad it to vocab_size with '<extra_id_N>',
  # 100 of them twice, without a word. Hand it what it reads of one: the project's pieces in id
  # order, so that a piece names the same id in both engines.
  tokenizer = types.SimpleNamespace(
      pad_token=pieces[data.PAD_ID], eos_token=pieces[data.EOS_ID], unk_token=pieces[data.UNK_ID],
      get_vocab=lambda: {piece: i for i, piece in enumerate(pieces)},
      convert_ids_to_tokens=lambda i: pieces[i])
  converter.load_tokenizer = lambda *args, **kwargs: tokenizer
  for quantization, output in outputs.items():
    converter.convert(output, quantization=quantization, force=True)


def export_and_convert(pair: pipeline.Pair, folder: Path) -> Dict[str, Any]:
  """{'dirs': {compute type: CTranslate2 folder}, 'tokens': the models' vocabulary} of the
  pair's target, checked to be the project's pieces (then the unused ids' '<extra_id_N>')."""
  hf.save_hf_t5(folder / 'hf', pair.target_config, pair.params['target'])
  dirs = {ct: str(folder / ct) for ct in COMPUTE_TYPES}
  sp = data.get_sentencepiece()
  pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
  start = time.perf_counter()
  with concurrent.futures.ProcessPoolExecutor(
      1, mp_context=multiprocessing.get_context('spawn')) as pool:
    pool.submit(convert_models, str(folder / 'hf'), dirs, pieces).result()
  print(f'converted to CTranslate2 ({", ".join(COMPUTE_TYPES)}) in '
        f'{time.perf_counter() - start:.1f}s', flush=True)
  tokens = json.loads((Path(dirs['float32']) / 'shared_vocabulary.json').read_text())
  if (tokens[:len(pieces)] != pieces or len(set(tokens)) != len(tokens) or
      len(tokens) != pair.target_config.vocab_size):
    raise SystemExit("error: CTranslate2's converted vocabulary is not the project's pieces")
  return {'dirs': dirs, 'tokens': tokens}


def ct2_options(beam: int) -> Dict[str, Any]:
  """translate_batch's options for greedy (beam 1) or beam search as this project decodes."""
  return dict(beam_size=beam, length_penalty=harness.BEAM_ALPHA,
              max_decoding_length=harness.OUTPUT_LENGTH, return_end_token=True,
              min_decoding_length=0,  # ours may end at the first position too
              max_input_length=0)  # the inputs were truncated as ours were (data.encode)


def ct2_passes(translators: Mapping[str, Any], beams: Sequence[int],
               batches: Sequence[List[List[str]]], piece_batches: int
               ) -> Dict[str, Callable[[], Iterator[List[Any]]]]:
  """{name: one pass} per (search, compute type), each in pieces as `Compiled.pieces`."""

  def pieces(translator: Any, options: Mapping[str, Any]) -> Iterator[List[Any]]:
    for start in range(0, len(batches), piece_batches):
      yield [translator.translate_batch(b, **options)
             for b in batches[start:start + piece_batches]]

  return {f"CTranslate2 {'greedy' if beam == 1 else f'beam={beam}'} {ct}":
          functools.partial(pieces, translator, ct2_options(beam))
          for beam in beams for ct, translator in translators.items()}


def serve(conn: Any, dirs: Mapping[str, str], tokens: Sequence[str], threads: int) -> None:
  """The CTranslate2 process: answers ('block', id batches, beams, piece_batches) with the
  warm pass's ids per pass and ('round',) with one round's seconds per pass; None ends it."""
  import ctranslate2  # pylint: disable=g-import-not-at-top
  try:
    translators = {ct: ctranslate2.Translator(d, device='cpu', compute_type=ct, inter_threads=1,
                                              intra_threads=threads) for ct, d in dirs.items()}
    ids = {token: i for i, token in enumerate(tokens)}
    passes = {}
    while (request := conn.recv()) is not None:
      if request[0] == 'block':
        _, id_batches, beams, piece_batches = request
        batches = [[[tokens[i] for i in row] for row in batch] for batch in id_batches]
        passes = ct2_passes(translators, beams, batches, piece_batches)
        outputs = harness.warm(passes)
        conn.send({name: [[ids[t] for t in result.hypotheses[0]]
                          for batch in batch_results for result in batch]
                   for name, batch_results in outputs.items()})
      else:
        conn.send({name: t[0] for name, t in policy.round_robin(passes, 1).items()})
  except Exception:  # pylint: disable=broad-except
    conn.send(('error', traceback.format_exc()))


class CTranslate2Process:
  """The CTranslate2 process (spawned: a fresh interpreter, no XLA threads), driven over a
  pipe; it runs only while this process waits for its answer."""

  def __init__(self, dirs: Mapping[str, str], tokens: Sequence[str], threads: int):
    context = multiprocessing.get_context('spawn')
    self.conn, child = context.Pipe()
    self.process = context.Process(target=serve, args=(child, dict(dirs), list(tokens), threads),
                                   daemon=True)
    self.process.start()
    child.close()

  def request(self, *message: Any) -> Dict[str, Any]:
    self.conn.send(message)
    try:
      answer = self.conn.recv()
    except EOFError:
      raise RuntimeError(f'the CTranslate2 process died (exit code {self.process.exitcode})'
                         ) from None
    if isinstance(answer, tuple):
      raise RuntimeError(f'the CTranslate2 process failed:\n{answer[1]}')
    return answer

  def close(self) -> None:
    if self.process.is_alive():
      self.conn.send(None)
    self.process.join(30)
    if self.process.is_alive():
      self.process.terminate()


def as_rows(ids: Sequence[Sequence[int]]) -> np.ndarray:
  """[n, OUTPUT_LENGTH] int32, zero after each row's ids (EOS included), as our decodes are."""
  rows = np.zeros((len(ids), harness.OUTPUT_LENGTH), np.int32)
  for row, out in zip(rows, ids):
    out = out[:harness.OUTPUT_LENGTH]
    row[:len(out)] = out
  return rows


def timed_rounds(ours: Mapping[str, Callable[[], Any]], theirs: CTranslate2Process,
                 rounds: int) -> Dict[str, List[float]]:
  """Seconds per pass and round: each round one engine's passes round-robin, then the other's,
  the first alternating between rounds (slow phases of a shared machine hit both alike)."""
  turns = [lambda: {k: t[0] for k, t in policy.round_robin(ours, 1).items()},
           lambda: theirs.request('round')]
  times: Dict[str, List[float]] = {}
  for r in range(rounds):
    for turn in (turns if r % 2 == 0 else turns[::-1]):
      for name, seconds in turn().items():
        times.setdefault(name, []).append(seconds)
      time.sleep(HANDOFF_PAUSE_S)
  return times


def rows_per_call(name: str, setting: Optional[Setting], batch_size: int, beam: int) -> int:
  """Target rows one decoder call processes: the batch (greedy), batch x (gamma + 1) (a
  speculative verify call, where the target's time goes), batch x beam (beam search)."""
  if setting is None:
    return batch_size * (beam if 'beam=' in name else 1)
  if setting.method == 'speculative':
    return batch_size * (setting.gamma + 1)
  return batch_size * max(setting.beam, 1)


def block_rows(names: Sequence[str], settings: Mapping[str, Setting],
               decodes: Mapping[str, np.ndarray], times: Mapping[str, Sequence[float]],
               batch_size: int, references: Sequence[str], args: argparse.Namespace,
               crossover: float) -> List[Dict[str, Any]]:
  """One row per pass: ms/sentence, speedups over our target-only greedy and over our pass of
  the same search, identity of ids with that pass, BLEU, rows per call and their regime."""
  ours_beam = Setting('beam', beam=args.beam).name
  by_base = {base: harness.speedups(times, base) for base in {OURS, ours_beam} if base in times}
  vocabulary = data.SentencePieceVocabulary(str(data.VOCAB_PATH))
  rows = []
  for name in names:
    setting = settings.get(name)
    beam = (setting.method == 'beam') if setting else 'beam=' in name
    same = ours_beam if beam else OURS
    calls = rows_per_call(name, setting, batch_size, args.beam)
    rows.append({
        'name': name, 'engine': 'speculative_t5x' if setting else 'ctranslate2',
        'compute_type': name.split()[-1] if not setting else 'float32',
        'search': 'beam' if beam else 'greedy',
        'ms_per_sentence': harness.ms_per(times[name], len(references)),
        **by_base[OURS][name], 'speedup_same_search': by_base[same][name]['speedup'],
        'same_search_as': same,
        'same_ids': float(np.mean(np.all(decodes[name] == decodes[same], axis=1))),
        'bleu': data.corpus_bleu([vocabulary.decode(r) for r in decodes[name]], references),
        'rows_per_call': calls,
        'regime': 'bandwidth-bound' if calls < crossover else 'arithmetic-bound'})
    r = rows[-1]
    print(f"batch {batch_size} {name}: {r['ms_per_sentence']:.1f} ms/sentence, "
          f"{r['speedup']:.2f}x our target-only greedy, same ids as {same} "
          f"{r['same_ids']:.0%}, BLEU {r['bleu']:.2f}", flush=True)
  return rows


def batch_block(pair: pipeline.Pair, settings: Sequence[Setting], theirs: CTranslate2Process,
                batch_size: int, sources: Sequence[str], references: Sequence[str],
                args: argparse.Namespace, crossover: float) -> Dict[str, Any]:
  """Both engines on the first len(sources) sentences: the block's rows and identities."""
  count = len(sources)
  ids = data.encode(sources, harness.INPUT_LENGTH)
  batches = harness.make_batches(ids, batch_size, args.input_length_step)
  compiled = {}
  for s in settings:
    compiled[s.name] = harness.compile_setting(s, pair, batches)
    print(f"batch {batch_size} {s.name}: compiled in {compiled[s.name].info()['compile_s']:.1f}s",
          flush=True)
  ours = {name: functools.partial(c.pieces, args.piece_batches) for name, c in compiled.items()}
  decodes = {name: harness.collect(out, count)['decodes']
             for name, out in harness.warm(ours).items()}
  # The same sentences in the same groups; CTranslate2 pads each to its longest row itself.
  beams = [1] + ([args.beam] if args.beam > 1 else [])
  outputs = theirs.request('block', [ids[i:i + batch_size] for i in range(0, count, batch_size)],
                           beams, args.piece_batches)
  decodes.update({name: as_rows(out) for name, out in outputs.items()})
  times = timed_rounds(ours, theirs, args.rounds)
  rows = block_rows(list(decodes), {s.name: s for s in settings}, decodes, times, batch_size,
                    references, args, crossover)
  for r in rows:
    if r['name'] in compiled:
      r.update(compiled[r['name']].info())
  return {'sentences': count, 'num_batches': len(batches), 'rows': rows,
          'identity': {r['name']: r['same_ids'] for r in rows if r['engine'] == 'ctranslate2'}}


def block_markdown(batch_size: str, block: Mapping[str, Any]) -> List[str]:
  lines = [f"## Batch {batch_size} ({block['sentences']} sentences)", '',
           'Sentences whose CTranslate2 ids equal ours (greedy: our target-only greedy; beam: '
           'our beam best): ' + ', '.join(f'{name[len("CTranslate2 "):]} {same:.0%}'
                                         for name, same in block['identity'].items()) + '.', '']
  lines += harness.table(
      ('configuration', 'ms/sentence', 'speed vs our target-only greedy', 'range over rounds',
       'vs ours, same search', 'same ids as ours', 'BLEU', 'rows/call', 'regime', 'compile s'),
      [[r['name'], f"{r['ms_per_sentence']:.1f}", f"{r['speedup']:.2f}x",
        f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f}", f"{r['speedup_same_search']:.2f}x",
        f"{r['same_ids']:.0%}", f"{r['bleu']:.2f}", r['rows_per_call'], r['regime'],
        harness.fmt(r.get('compile_s'), '.1f')] for r in block['rows']])
  return lines + ['']


def markdown(results: Mapping[str, Any]) -> str:
  meta = results['meta']
  lines = harness.heading("This project's decoders against CTranslate2", results)
  lines += [
      f"CTranslate2 {meta['ctranslate2']} in a process of its own (inter_threads=1, "
      f"intra_threads={meta['ct2_threads']}), float32 and int8 weights; the engines take turns "
      f"every round. Speeds: median over rounds ({meta['rounds']}) of our target-only greedy pass "
      "time (or our pass of the same search) over the configuration's in the same round.", '',
      f"Regime of a target decoder call: below {meta['crossover_rows']:.1f} rows per call "
      f"streaming the float32 weights ({meta['weight_streaming_floor_ms']['target']:.2f} ms at "
      f"{meta['memory_bandwidth_gbs']:.1f} GB/s) takes longer than the arithmetic (at "
      f"{meta['matmul_gflops']:.0f} GFLOP/s, a 1024x1024 matmul): bandwidth-bound; above it "
      'arithmetic-bound. Speculative rows count the verify call (batch x (gamma + 1) rows), '
      'beam rows batch x beam. int8 weights are a quarter of the bytes.', '']
  for batch_size, block in results['batches'].items():
    lines += block_markdown(batch_size, block)
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  args = parse_args(argv)
  sizes = harness.parse_sentences(args.sentences)
  settings = harness.greedy_settings(args.gammas, auto=False)
  if args.beam > 1:
    settings.append(Setting('beam', beam=args.beam))
  sources, references = harness.test_split(args.data_dir)
  pair = harness.load_pair()
  probes = harness.probe_machine(pair)
  # Rows per target call where a float32 step's arithmetic (at the measured matmul rate) starts
  # to take longer than streaming its weights (at the measured bandwidth).
  crossover = probes['weight_streaming_floor_ms']['target'] / harness.compute_floor_ms(
      pair.target_config, 1, 1, probes['matmul_gflops'])
  results = {'meta': harness.meta(
      NAME, argv, args, ctranslate2=importlib.metadata.version('ctranslate2'),
      ct2_threads=args.ct2_threads, beam=args.beam, beam_alpha=harness.BEAM_ALPHA,
      crossover_rows=crossover, **probes), 'batches': {}}
  with tempfile.TemporaryDirectory(prefix=f'{NAME}_') as folder:
    models = export_and_convert(pair, Path(folder))
    theirs = CTranslate2Process(models['dirs'], models['tokens'], args.ct2_threads)
    try:
      for batch_size, count in sizes.items():
        count = min(count, len(sources))
        results['batches'][str(batch_size)] = batch_block(
            pair, settings, theirs, batch_size, sources[:count], references[:count], args,
            results['meta']['crossover_rows'])
        paths = harness.write_results(args, NAME, results, markdown)
    finally:
      theirs.close()
  print('wrote', *paths)
  return results


if __name__ == '__main__':
  main()
