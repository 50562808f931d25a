"""A pytest plugin that records each test's wall time and CPU time, its own and its finished children's (the runs it
started), one JSON line per test in $CPU_PER_TEST_OUT (default: cpu_per_test.jsonl). Where the suite's time goes on a
CPU-bound machine, unlike --durations, which counts time spent waiting for a core:

    PYTHONPATH=tests/scripts pytest -p cpu_per_test
"""

import json
import os
import resource
import time

import pytest


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, cpu = time.monotonic(), _cpu_s()
    yield
    record = {"test": item.nodeid, "wall_s": time.monotonic() - wall, "cpu_s": _cpu_s() - cpu}
    with open(os.environ.get("CPU_PER_TEST_OUT", "cpu_per_test.jsonl"), "a") as out:
        out.write(json.dumps({**record, "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")
