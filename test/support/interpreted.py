"""The child pytest that runs a kernel test file's ``*kernel_interpreted*`` tests under Triton's CPU interpreter (a
child, so the interpreter flag does not leak into the parent's other tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_interpreted(test_file: str) -> None:
    """Re-run ``test_file``'s kernel tests with TRITON_INTERPRET=1; fails on any failure or skip."""
    path = Path(test_file).resolve()
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path), "-k", "kernel_interpreted"],
        cwd=path.parent.parent, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"interpreted kernel tests failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]
