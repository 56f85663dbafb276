"""The check-or-write step shared by the generators (tools/generate_caps.py,
tools/generate_modes.py): their outputs are committed, ``--check`` says which are missing or
stale and how to refresh them, and a plain run rewrites only what changed (so build systems and
editors see no spurious edits)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List


def differences(root: Path, outputs: Dict[Path, str]) -> List[str]:
    """``missing: REL`` / ``differs: REL`` for each output (paths relative to ``root``) whose file
    is not the text it should hold; empty when all are current."""
    out = []
    for rel, text in outputs.items():
        path = root / rel
        if not path.is_file():
            out.append(f"missing: {rel}")
        elif path.read_text() != text:
            out.append(f"differs: {rel}")
    return out


def check_or_write(root: Path, outputs: Dict[Path, str], check: bool, script: str) -> int:
    """``--check``: print the differences and exit 1 if any, naming ``script`` to run. Otherwise
    write the outputs that differ. The exit status of the generator's ``main``."""
    if check:
        diffs = differences(root, outputs)
        for d in diffs:
            print(d)
        if diffs:
            print(f"run `python {script}`", file=sys.stderr)
        return 1 if diffs else 0
    for rel, text in outputs.items():
        path = root / rel
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {rel}")
    return 0
