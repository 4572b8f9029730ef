"""Session-wide rules of the suite: GPU tests cannot pass silently (gpu_harness.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_harness  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    # Under EPCOMM_GPU_TESTS=1 a session that ran no GPU test fails, whatever else passed.
    if gpu_harness.required() and not gpu_harness.RAN and exitstatus == 0:
        sys.stderr.write("\nEPCOMM_GPU_TESTS=1 but no GPU test ran: failing the session\n")
        session.exitstatus = 1
