"""Speculative and BiLD decoding with two random T5 models: runs on a fresh clone, no data needed.

  python examples/quickstart.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from speculative_t5x import decoding, models, network

target_config = network.T5Config(vocab_size=512, emb_dim=128, num_heads=4, head_dim=32,
                                 num_encoder_layers=2, num_decoder_layers=6, mlp_dim=256,
                                 mlp_activations=('gelu', 'linear'), dropout_rate=0.0)
target_params = network.init_params(target_config, jax.random.PRNGKey(0))[0]
# Untrained weights: a perturbed copy of the target stands in for a trained small draft (any
# T5Config with the same vocabulary works, e.g. 1 narrow decoder layer).
draft_config = target_config
draft_params = jax.tree_util.tree_map(
    lambda x: x * (1 + 0.03 * jax.random.normal(jax.random.PRNGKey(1), x.shape)), target_params)
params = {'target': target_params, 'draft': draft_params}
batch = {  # T5X feature dicts; the decoder inputs only fix the output length here.
    'encoder_input_tokens': jnp.array([[13, 7, 42, 1, 0], [5, 99, 1, 0, 0]], jnp.int32),
    'decoder_input_tokens': jnp.zeros((2, 16), jnp.int32),
}

for name, decode_fn, kwargs in [
    ('target only', decoding.temperature_sample, {'temperature': 0.0}),
    ('speculative', decoding.speculative_sample, {'temperature': 0.0, 'gamma': 4}),
    ('BiLD', decoding.bild_decode, {'fallback_threshold': 0.0, 'rollback_threshold': 2.0}),
]:
  model = models.EncoderDecoderModel(target_config, draft_config, decode_fn=decode_fn,
                                     decode_kwargs=kwargs)
  decodes, aux = jax.jit(model.predict_batch_with_aux)(params, batch)
  stats = aux['stats']
  print(f'{name:12s} tokens {np.asarray(decodes[0, :8])} target calls '
        f'{np.asarray(stats["target_calls"])} accepted/proposed '
        f'{np.asarray(stats["accepted"])}/{np.asarray(stats["proposed"])}')
