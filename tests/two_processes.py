"""A test file's `worker` run in 2 processes by jaxpar.launch: start it, compute the reference meanwhile, finish."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def start(script: str, out: str) -> subprocess.Popen:
    """`python -m jaxpar.launch --nproc-per-node 2 SCRIPT worker OUT` on CPU, output captured."""
    cmd = [sys.executable, "-m", "jaxpar.launch", "--nproc-per-node", "2", "--term-timeout", "3", script, "worker",
           out]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: int = 600) -> str:
    """Both processes' output once they exited with 0; the test fails (with that output) otherwise."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        pytest.fail(f"the two processes did not finish in {timeout} s; their output:\n{out}")
    assert proc.returncode == 0, out
    return out
