"""Gin files for T5X's own CLI, `python -m t5x.infer` (see speculative_t5x/t5x_adapter.py).

A package: gin reads `speculative_t5x/gin_configs/t5x/NAME.gin` through the Python path (its
fallback for paths not found under the search paths), so T5X finds these files from any
working directory, without --gin_search_paths.
"""
