"""Child processes whose output goes to a file instead of a pipe.

Why: a test that waits on one child (``communicate``) while a sibling's output fills its pipe (64 KiB on Linux)
blocks the sibling at its next write; two ranks of one job then wait on each other forever, and the test ends
only at its timeout. More output than usual (a new warning a step, oneDNN's verbose mode) was enough for the
FSDP fixture to hang so. A file never fills.
"""

from __future__ import annotations

import subprocess
import tempfile
from typing import Any


class LoggedProcess:
    """``subprocess.Popen(args, ...)`` with stdout and stderr together in an unnamed temporary file."""

    def __init__(self, args: list[str], **popen_kwargs: Any) -> None:
        self._log = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        self.process = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, text=True, **popen_kwargs
        )

    def finish(self, timeout: float) -> tuple[int, str]:
        """Wait for the process (killed after ``timeout`` seconds); its exit status and all it printed."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.seek(0)
        output = self._log.read()
        self._log.close()
        return self.process.returncode, output
