"""Run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8 (see test_train).

One distillation step of a small draft (a T5 with its own encoder, and a decoder-only draft
reading the teacher's encoder), its teacher a larger T5, on one device and on the (data, model)
meshes given on the command line; prints one JSON line with, per draft and mesh, the largest
differences from one device in the loss, the gradients and the params after the step (Adafactor
included), and how many shards the student's query kernel and the teacher's have; then a
training run on a mesh, stopped and resumed (`resumed_on_a_mesh`), and the distillation step's
memory per mesh (`distill_memory`). Arguments: RUN_DIR TRAINING_FILE MESH...
"""

import dataclasses
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from speculative_t5x import data
from speculative_t5x import evaluation
from speculative_t5x import network
from speculative_t5x import partitioning
from speculative_t5x import train
from benchmarks import scale
from fast_params import random_params

# Heads, mlp and vocab divisible by 8, so that every mesh really splits them.
TEACHER = network.T5Config(vocab_size=64, emb_dim=16, num_heads=8, head_dim=4,
                           num_encoder_layers=2, num_decoder_layers=2, mlp_dim=32,
                           mlp_activations=('gelu', 'linear'), dropout_rate=0.1)
DRAFT = dataclasses.replace(TEACHER, num_encoder_layers=1, num_decoder_layers=1)
READER = dataclasses.replace(DRAFT, num_encoder_layers=0, encoded_width=TEACHER.emb_dim)


def batch_of(rows: int = 8, length: int = 12) -> dict:
  """A packed batch: two segments a row, the second one short."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(2, 64, (rows, length)).astype(np.int32)
  segments = np.where(np.arange(length) < 7, 1, 2)[None].repeat(rows, 0).astype(np.int32)
  segments[:, -2:] = 0  # padding
  tokens = tokens * (segments > 0)
  inputs = np.where(np.arange(length) == 0, 0, np.roll(tokens, 1, axis=1)) * (segments > 0)
  inputs[:, 7] = 0  # the second segment starts with BOS
  return {'encoder_input_tokens': tokens, 'encoder_segment_ids': segments,
          'decoder_input_tokens': inputs.astype(np.int32), 'decoder_target_tokens': tokens,
          'decoder_segment_ids': segments,
          'decoder_loss_weights': (segments > 0).astype(np.float32)}


def run_step(objective, params, teacher, encoder, partitioner):
  """(loss, grads, params after one step, the step's state) on `partitioner`'s mesh or one
  device (None)."""
  placement = train._Placement(partitioner)
  tx = train.make_optimizer(1.0, 10)
  state = placement.state(placement.params(objective.config, params), tx)
  teacher_params = placement.params(TEACHER, teacher)
  encoder_params = placement.params(TEACHER, encoder) if encoder is not None else None
  batch = placement.batch(batch_of())
  rng = jax.random.PRNGKey(3)
  (loss, _), grads = jax.jit(jax.value_and_grad(objective.loss, has_aux=True))(
      state['params'], batch, rng, teacher_params, encoder_params)
  step = placement.step(objective, 1.0, 10, 0, state)
  query = state['params']['decoder']['layers_0']['self_attention']['query']['kernel']
  teacher_query = teacher_params['decoder']['layers_0']['self_attention']['query']['kernel']
  shards, teacher_shards = num_shards(query), num_shards(teacher_query)
  new_state, _ = step(state, batch, teacher_params, encoder_params)
  return (np.asarray(loss), jax.tree.map(np.asarray, grads),
          jax.tree.map(np.asarray, new_state['params']), (shards, teacher_shards))


def num_shards(x) -> int:
  """How many distinct pieces of `x` its devices hold (1 for a host array)."""
  return len({str(s.index) for s in getattr(x, 'addressable_shards', [])}) or 1


def largest(a, b) -> float:
  return float(max(np.max(np.abs(x - y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


def step_on_meshes(mesh_shapes) -> dict:
  """Per student and mesh: one step's differences from one device (the module's docstring)."""
  teacher = random_params(TEACHER, 0)
  students = {
      'draft': (evaluation.Objective(DRAFT, distillation='token', teacher_config=TEACHER,
                                     kd_weight=0.5), random_params(DRAFT, 1), None),
      'decoder_only_draft': (evaluation.Objective(READER, distillation='token',
                                                  teacher_config=TEACHER, encoder_config=TEACHER),
                             random_params(READER, 2), teacher),
  }
  report = {'devices': jax.device_count(), 'results': {}}
  for name, (objective, params, encoder) in students.items():
    loss, grads, after, _ = run_step(objective, params, teacher, encoder, None)
    result = {'loss': float(loss), 'grad_scale': largest(grads, jax.tree.map(jnp.zeros_like,
                                                                              grads))}
    # The decoder-only draft adds no sharding of its own: the last mesh suffices.
    for shape in mesh_shapes[-1:] if name == 'decoder_only_draft' else mesh_shapes:
      data_size, model_size = (int(n) for n in shape.split('x'))
      partitioner = partitioning.Partitioner(mesh_shape=(data_size, model_size))
      got = run_step(objective, params, teacher, encoder, partitioner)
      result[shape] = {'loss': abs(float(got[0]) - float(loss)), 'grads': largest(got[1], grads),
                       'params_after_step': largest(got[2], after),
                       'query_shards': got[3][0], 'teacher_query_shards': got[3][1]}
    report['results'][name] = result
  return report


def distill_memory(out_dir: str) -> dict:
  """`benchmarks.scale --tiny --distill` on the (1, 8) and (8, 1) meshes: its blocks."""
  scale.main(['--tiny', '--distill', '--batches', '8', '--meshes', 'model,data',
              '--out_dir', out_dir])
  return json.loads(pathlib.Path(out_dir, 'distill_scale.json').read_text())['blocks']


def resumed_on_a_mesh(run_dir: str, data_file: str) -> dict:
  """`train.train` of a tiny model on the (2, 4) mesh, over the pairs of `data_file`: 4 steps
  straight, and 2 steps then a restart to 4; the largest differences in the per-step losses and
  the final state, and the losses' gap to the same run on one device."""
  tiny = dataclasses.replace(DRAFT, vocab_size=data.padded_vocab_size())
  files = {'train': data_file, 'validation': data_file}
  settings = dict(config=tiny, data_files=files, max_input_length=16, max_target_length=16,
                  batch_size=8, learning_rate_scale=0.1, warmup_steps=1, log_every=1,
                  eval_every=0, final_eval_splits=())

  def run(name, steps, partitioner, **more):
    return train.train(model_dir=f'{run_dir}/{name}', num_train_steps=steps,
                       partitioner=partitioner, **{**settings, **more})

  def losses(name):
    lines = pathlib.Path(run_dir, name, 'metrics.jsonl').read_text().splitlines()
    return np.array([r['loss'] for r in map(json.loads, lines) if 'loss' in r])

  mesh = lambda: partitioning.Partitioner(mesh_shape=(2, 4))
  full = run('full', 4, mesh())
  run('resumed', 2, mesh(), checkpoint_every=2)
  resumed = run('resumed', 4, mesh())
  run('one_device', 4, None)
  return {'steps': int(resumed['state']['step']),
          'losses': float(np.max(np.abs(losses('resumed') - losses('full')))),
          'state': largest(full['state'], resumed['state']),
          'one_device_losses': float(np.max(np.abs(losses('one_device') - losses('full'))))}


if __name__ == '__main__':
  run_dir, data_file, *meshes = sys.argv[1:]
  print('RESULT ' + json.dumps({'step': step_on_meshes(meshes),
                                'resume': resumed_on_a_mesh(run_dir, data_file),
                                'distill_memory': distill_memory(f'{run_dir}/scale')}), flush=True)
