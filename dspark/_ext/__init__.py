"""Compiled extensions built from cython_ext/ by setup.py.

DSPARK_EXT_PATH names another folder of these modules to load first (`make sanitize` points it
at its ASan + UBSan build)."""
import os

if os.environ.get("DSPARK_EXT_PATH"):
    __path__.insert(0, os.path.abspath(os.environ["DSPARK_EXT_PATH"]))
