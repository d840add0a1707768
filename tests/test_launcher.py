"""The launcher's ``stop``: a child that ignores SIGINT is killed, and so is every process below it (a
vLLM worker's engine core would otherwise outlive it, reparented, holding its memory)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tokentrail import launcher

# A parent that ignores SIGINT and starts a child that starts a grandchild, as a vLLM worker starts its
# engine core and the engine core its model runner; each writes its pid, then all sleep.
_TREE = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
out, depth = sys.argv[1], int(sys.argv[2])
if depth < 2:
    subprocess.Popen([sys.executable, "-c", sys.argv[3], out, str(depth + 1), sys.argv[3]])
with open(os.path.join(out, f"pid{depth}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_stop_kills_a_child_that_ignores_sigint_and_every_process_below_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "_STOP_TIMEOUT_S", 1)
    proc = launcher.spawn([str(tmp_path), "0", _TREE], program=[sys.executable, "-c", _TREE])
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"pid{d}").exists() for d in range(3)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the pid files are written before each one's sleep
        pids = [int((tmp_path / f"pid{d}").read_text()) for d in range(3)]
        assert pids[0] == proc.pid
        assert launcher.descendants(proc.pid) == pids[1:]
        launcher.stop(proc, "tree")
        assert proc.returncode is not None and proc.returncode < 0  # killed: it ignored SIGINT
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids[1:]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids[1:]), "a process below the stopped child outlived it"
    finally:
        for d in range(3):
            pid_file = tmp_path / f"pid{d}"
            if pid_file.exists():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
