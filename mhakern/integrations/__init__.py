"""Integrations of mhakern with other libraries, each an optional extra imported on its own.

* :mod:`mhakern.integrations.transformers` -- an ``"mhakern"`` attention implementation for
  Hugging Face transformers models (``pip install mhakern[transformers]``).

Importing this package imports none of those libraries.
"""
