"""Run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8 (see test_partitioning).

Decodes one batch with greedy speculative sampling (with a separate draft and with a
decoder-only draft that reads the target's encoder) and greedy BiLD on a single device and on
(data, model) meshes given on the command line; prints one JSON line with, per mesh and
algorithm, whether decodes/scores/stats equal the single-device ones and the shardings seen.
"""

import dataclasses
import json
import sys
import time

import jax
import numpy as np

from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import partitioning
from fast_params import random_params


def main(mesh_shapes):
  # Heads, vocab and mlp divisible by 4 so that the (2, 4) mesh really splits them.
  target_cfg = network.T5Config(vocab_size=64, emb_dim=16, num_heads=4, head_dim=4,
                                num_encoder_layers=1, num_decoder_layers=2, mlp_dim=32,
                                mlp_activations=('gelu', 'linear'), dropout_rate=0.0)
  draft_cfg = network.T5Config(vocab_size=64, emb_dim=16, num_heads=4, head_dim=4,
                               num_encoder_layers=1, num_decoder_layers=1, mlp_dim=32,
                               mlp_activations=('gelu', 'linear'), dropout_rate=0.0)
  target = random_params(target_cfg, 0)
  draft = random_params(draft_cfg, 1)
  # Make the draft agree with the target often (shared embeddings and logits), so the
  # runs contain both acceptances and rejections.
  draft['token_embedder'] = target['token_embedder']
  # A sharper draft, so BiLD's small model is sometimes confident enough to lead.
  draft['decoder']['logits_dense'] = {'kernel': target['decoder']['logits_dense']['kernel'] * 6}
  params = jax.tree.map(np.asarray, {'target': target, 'draft': draft})
  rng = np.random.default_rng(0)
  enc = rng.integers(2, 64, (8, 8)).astype(np.int32)
  enc[:, 6:] *= (rng.random((8, 2)) < 0.5)  # ragged inputs
  batch = {'encoder_input_tokens': enc, 'decoder_input_tokens': np.zeros((8, 10), np.int32)}
  # The same draft decoder without an encoder of its own: it reads the target's.
  reader_cfg = dataclasses.replace(draft_cfg, num_encoder_layers=0,
                                   encoded_width=target_cfg.emb_dim)
  reader = {**params, 'draft': {k: v for k, v in params['draft'].items() if k != 'encoder'}}
  greedy = (decoding.speculative_sample, {'gamma': 3, 'temperature': 0.0})
  algorithms = {
      'speculative': (*greedy, draft_cfg, params),
      'bild': (decoding.bild_decode, {'fallback_threshold': 0.3, 'rollback_threshold': 2.0,
                                      'max_small_steps': 3}, draft_cfg, params),
      'decoder_only_draft': (*greedy, reader_cfg, reader),
  }
  report = {'devices': jax.device_count(), 'results': {}}
  start = time.time()
  for name, (fn, kwargs, draft_cfg, params) in algorithms.items():
    # The decoder-only draft adds no sharding rule of its own: the widest model split suffices.
    shapes = mesh_shapes[-1:] if name == 'decoder_only_draft' else mesh_shapes
    model = models.EncoderDecoderModel(target_cfg, draft_cfg, decode_fn=fn, decode_kwargs=kwargs,
                                       eos_id=1)
    with jax.default_device(jax.devices()[0]):
      ref = jax.jit(model.predict_batch_with_aux)(params, batch, jax.random.PRNGKey(0))
    ref = jax.tree.map(np.asarray, ref)
    report['results'][name] = {'ref_accepted': int(ref[1]['stats']['accepted'].sum()),
                               'ref_rollbacks': int(ref[1]['stats']['rollbacks'].sum())}
    for shape in shapes:
      mesh = partitioning.create_mesh(shape)
      predict = partitioning.partition_predict(model, mesh)
      shardings = partitioning.pair_shardings(model, mesh)
      placed = partitioning.shard_params(params, shardings)
      out = predict(placed, partitioning.shard_batch(batch, mesh), jax.random.PRNGKey(0))
      qkv = placed['target']['decoder']['layers_0']['self_attention']['query']['kernel']
      got = jax.tree.map(np.asarray, out)
      same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), got, ref)
      report['results'][name][f'{shape[0]}x{shape[1]}'] = {
          'decodes_equal': same[0],
          'aux_equal': all(jax.tree.leaves(same[1])),
          'decodes_spec': str(out[0].sharding.spec),
          'query_kernel_spec': str(qkv.sharding.spec),
          'query_kernel_shards': len({tuple((s.start, s.stop) for s in idx)
                                      for idx in qkv.sharding.devices_indices_map(qkv.shape).values()}),
      }
  report['seconds'] = round(time.time() - start, 1)
  print('RESULT ' + json.dumps(report))


if __name__ == '__main__':
  main([tuple(int(x) for x in s.split('x')) for s in sys.argv[1:]])
