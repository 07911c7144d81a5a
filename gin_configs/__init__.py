"""Gin configs, shipped inside the wheel as `speculative_t5x.gin_configs` (setup.py's package_dir).

Every folder is a regular package: gin tries a relative path through the Python path before its
search paths ('gin_configs/runs/infer.gin' as the module gin_configs.runs), and a folder without
`__init__.py` makes that lookup raise TypeError instead of falling through (so with the clone's
root on sys.path, e.g. under pytest or PYTHONPATH, every include from another directory failed).
As packages, both 'gin_configs/...' and T5X's 'speculative_t5x/gin_configs/t5x/...' resolve.
"""
