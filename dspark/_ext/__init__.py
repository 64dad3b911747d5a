"""Compiled extensions built from cython_ext/ by setup.py."""
