"""Benchmarks of speculative_t5x, run from the repository root as `python -m benchmarks.<name>`:
speed, verifiers, drafts, vs_ctranslate2, vs_t5x, policy_sim, scale (helpers compiled and
scale_t5x) and accelerator; each module's docstring says what it measures, and
results/README.md which recorded run answers which question. All but scale share `harness` and
write <out_dir>/<name>.json and <name>.md (default runs/<machine>/).
"""
