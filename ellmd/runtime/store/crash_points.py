"""Where crash tests make the store fail: a pause or a SIGKILL just before a write transaction commits.

Set only by tests/test_crash.py and scripts/crash_loop.py, through the environment of the daemon they
start (a SIGKILL must land inside a real transaction of a real process): ELLMD_TEST_TXN_SLEEP is the
seconds slept there, between two log lines that say where a kill landed; ELLMD_TEST_TXN_KILL names a
file whose presence makes the process SIGKILL itself there. Unset in normal use: nothing happens.
"""

import logging
import os
import signal
import time

log = logging.getLogger("ellmd.store")

TXN_SLEEP = float(os.environ.get("ELLMD_TEST_TXN_SLEEP", "0") or 0)
TXN_KILL = os.environ.get("ELLMD_TEST_TXN_KILL")


def before_commit(transaction: str) -> None:
    """Inside a write transaction, just before it commits: pause or die as the environment says."""
    if TXN_SLEEP:
        log.info("test: inside the %s transaction", transaction)
        time.sleep(TXN_SLEEP)
    if TXN_KILL and os.path.exists(TXN_KILL):
        os.kill(os.getpid(), signal.SIGKILL)
    if TXN_SLEEP:
        log.info("test: leaving the %s transaction", transaction)
