"""Benchmarks of speculative_t5x, run from the repository root as `python -m benchmarks.<name>`.

  speed           how fast the embedded pair decodes: target-only against speculative (greedy
                  gammas incl. 'auto', sampling), BiLD, beam against speculative beam
  verifiers       which verifier keeps more of a draft: token vs block, chains vs token trees
  drafts          how good a draft is: alpha and tokens per call by split, temperature, gamma
  vs_ctranslate2  against CTranslate2; vs_t5x: against real T5X's greedy decoder (needs T5X)
  policy_sim      gamma='auto' in simulated jobs
  scale           T5 1.1 large/XL/XXL compiled for TPU topologies (or 8 CPU devices): fit,
                  collectives, XLA:TPU's estimates (helpers: compiled, scale_t5x)
  accelerator     steps and loops at T5 1.1 large/XL shapes on a GPU/TPU (--tiny on a CPU)

All but scale share `harness` (the pair, batches, per-shape compilation, round-robin timing)
and its flags, and write <out_dir>/<name>.json and <name>.md (default runs/<machine>/).
"""
