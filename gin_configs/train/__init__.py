"""Gin configs (a package so that gin's Python-path lookup finds them: gin_configs/__init__.py)."""
