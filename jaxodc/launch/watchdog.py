"""Kills a job's ranks when its launcher dies without tearing them down (SIGKILL, out of memory).

`jaxodc launch` starts this process in a session of its own and writes to its stdin the process
group of every rank it starts, then ``done`` once it has torn the job down itself. End of input
without ``done`` means the launcher is gone: every listed group (the ranks and their children) is
SIGKILLed and the job's shared-memory segments are removed. The ranks also carry a parent-death
signal; this covers their children and the segments.

    python -m jaxodc.launch.watchdog JOB_ID
"""
from __future__ import annotations

import os
import signal
import sys

from jaxodc.launch.context import cleanup_shm

DONE = "done"


def main(argv: list[str]) -> int:
    job_id = argv[0]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is for the launcher to handle
    groups: list[int] = []
    for line in sys.stdin:
        line = line.strip()
        if line == DONE:
            return 0
        if line.isdigit():
            groups.append(int(line))
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    removed = cleanup_shm(job_id)
    sys.stderr.write(f"jaxodc launch: the launcher of job {job_id} died; killed {len(groups)} rank "
                     f"group(s), removed {len(removed)} shared-memory segment(s)\n")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
