"""``python -m mhakern.memorize`` runs the command line (see :mod:`mhakern.memorize.cli`)."""
import sys

from .cli import main

sys.exit(main())
