"""The documents' Python examples run as written: every ```python block of README.md and
docs/usage.md, in order, in one namespace, in a fresh interpreter per document (on the CUDA
device where there is one, else on the CPU: the examples pick their device). A block preceded by
``<!-- not-run: reason -->`` is a fragment, not an example, and is left out. A block that imports
an optional package that is not installed (transformers: the ``transformers`` extra, which the
``test`` extra includes) is left out too, and the test then skips naming it, after the other
blocks ran."""
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/usage.md")
FENCE = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not-run:(.*?)-->\s*\Z", re.S)

# Runs the blocks; each is compiled under the document's name with its own line numbers, so a
# traceback points at the document's line.
_RUNNER = """
import json, sys
doc, blocks = json.loads(sys.argv[1])
ns = {"__name__": "__main__"}
for line, code in blocks:
    exec(compile("\\n" * (line - 1) + code, doc, "exec"), ns)
"""


def python_blocks(doc: str):
    """[(first code line, code, reason not run or None)] of ``doc``'s ```python blocks."""
    text = (ROOT / doc).read_text()
    out = []
    for m in FENCE.finditer(text):
        marker = NOT_RUN.search(text[: m.start()])
        reason = marker.group(1).strip() if marker else None
        if marker is not None and not reason:
            raise AssertionError(f"{doc}: a not-run marker before the block at line "
                                 f"{text.count(chr(10), 0, m.start()) + 2} gives no reason")
        out.append((text.count("\n", 0, m.start()) + 2, m.group(1), reason))
    return out


def _missing_imports(code: str):
    """Top-level packages ``code`` imports that are not installed."""
    roots = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    return sorted(r for r in roots if importlib.util.find_spec(r) is None)


def test_not_run_markers_precede_blocks():
    # A marker with no block after it (a typo in the fence, a block moved away) would silently
    # exempt the next block instead: each marker must be followed directly by a python block.
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for m in re.finditer(r"<!--\s*not-run:.*?-->\s*", text, re.S):
            assert text.startswith("```python\n", m.end()), f"{doc}: a not-run marker not directly before a ```python block"


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_run(doc):
    blocks = python_blocks(doc)
    assert blocks, f"{doc}: no ```python block found (the pattern no longer matches the document?)"
    run, left_out = [], []
    for line, code, reason in blocks:
        if reason is not None:
            continue
        missing = _missing_imports(code)
        if missing:
            left_out.append(f"line {line} (needs {', '.join(missing)})")
        else:
            run.append((line, code))
    env = dict(os.environ)
    # As a reader runs them: not under the Triton interpreter that conftest.py switches on.
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps([doc, run])], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{doc}: an example failed:\n{r.stderr[-4000:]}"
    if left_out:
        pytest.skip(f"{doc}: {len(run)} blocks ran; not run, a package not installed: {'; '.join(left_out)} "
                    "(pip install -e '.[test]')")
