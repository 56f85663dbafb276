"""Stand-in for the compiled module mhakern._C when the install did not build it (a plain
``pip install -e .``): importing it builds the module once into a per-user cache, or loads it
from there, and puts the compiled module in its place. A compiled ``_C*.so`` beside this file
(an install with ``--no-build-isolation``) takes precedence over it in Python's import system,
so this file only runs when there is none. See mhakern/_build.py."""
import sys

from ._build import load_built_module

sys.modules[__name__] = load_built_module()
