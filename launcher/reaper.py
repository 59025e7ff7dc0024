"""Stop what an embedded Ray leaves behind when its driver dies without shutting it down.

    python -m launcher.reaper DRIVER_PID

The Ray launcher starts this beside an embedded Ray (one it started itself). While the driver
lives, the reaper records the driver's descendants every half second (Ray's GCS, raylet, agents
and workers); once the driver is gone it kills every recorded process that is still the same
process (same start time, so a reused pid is left alone). Without it, Ray's dashboard and
runtime-env agents outlive a SIGKILLed driver by a minute or more. A driver that shuts Ray down
normally stops the reaper first.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil

_POLL_S = 0.5


def reap_after(driver_pid: int) -> None:
    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return
    seen: dict[int, float] = {}  # pid -> create time
    while True:
        try:
            if driver.status() == psutil.STATUS_ZOMBIE:
                break
            for child in driver.children(recursive=True):
                seen.setdefault(child.pid, child.create_time())
        except psutil.NoSuchProcess:
            break
        time.sleep(_POLL_S)
    for pid, created in seen.items():
        if pid == os.getpid():
            continue
        try:
            process = psutil.Process(pid)
            if process.create_time() == created:
                process.send_signal(signal.SIGKILL)
        except psutil.Error:
            continue


if __name__ == "__main__":
    reap_after(int(sys.argv[1]))
