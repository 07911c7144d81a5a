"""Benchmarks of speculative_t5x, run from the repository root as `python -m benchmarks.<name>`.

  speed          target-only vs speculative (greedy gammas incl. 'auto', sampling), BiLD, beam
                 vs speculative beam, optional Hugging Face assisted generation
  drafts         draft models for one target: alpha, c, BLEU, speedup
  vs_t5x         this project's decoders against real T5X's greedy decoder (needs T5X)
  profile        step costs, kernel breakdown, the loop's own overhead, one iteration's cost
  encoder_width  inputs padded to 64 vs each batch's longest rounded up
  numerics       bfloat16 greedy identity: speculative vs target-only vs float32, near-ties,
                 and the float32_logits option
  scale          T5 1.1 large/XL/XXL + small compiled for 8 fake devices: memory, loop
                 collectives, step costs, T5X's loop beside, roofline onto TPU v4/v5e/H100
                 (recorded in results/scale/; helpers: compiled, roofline, scale_t5x)
  accelerator    steps and loops at T5 1.1 large/XL shapes on a GPU/TPU beside the projection
                 (recorded in results/gpu/; --tiny on CPU)

All of them share `harness` (the pair, test-split batches, per-shape compilation, round-robin
timing, machine probes) and its flags (--sentences 1:80,8:160, --gammas 1,2,auto, --rounds N,
--machine, --out_dir, --data_dir), and write runs/<machine>/<name>.json and <name>.md (the
recorded runs: `--out_dir results/<machine>`).
"""
