"""The helpers that read a test's child process line by line keep every line it printed."""

from __future__ import annotations

import subprocess
import sys

from tests.integration_runs import read_to_end, readline


def test_the_rest_of_the_output_includes_what_readline_left_buffered():
    """One write of three lines: `readline` returns the first and its stream buffers the other
    two, which reading the pipe's descriptor (`communicate(timeout=...)`) would have lost."""
    proc = subprocess.Popen([sys.executable, "-c", "import os; os.write(1, b'a\\nb\\nc\\n')"],
                            stdout=subprocess.PIPE, text=True)
    assert readline(proc, 60) == "a\n"
    proc.wait(60)  # all three lines were written before anything below reads
    assert read_to_end(proc, 60) == "b\nc\n"
    assert proc.returncode == 0
