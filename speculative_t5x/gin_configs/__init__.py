"""Gin configs shipped with the package (a package so that gin finds them on the Python path)."""
