"""``python -m mhakern.build [--force]``: build the extension module mhakern._C now, into the
per-user cache that its first use would otherwise fill (see mhakern/_build.py)."""
import sys

from ._build import main

if __name__ == "__main__":
    sys.exit(main())
