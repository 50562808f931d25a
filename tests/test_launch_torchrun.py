"""The torchrun this project starts: the grace its workers get after a stop signal."""

import os
import sys

from colocated_grpo.launch import processes


def test_a_users_larger_shutdown_timeout_is_kept_and_a_smaller_one_raised_to_the_grace(tmp_path):
    show = [sys.executable, "-c", f"import os; print(os.environ['{processes.SHUTDOWN_TIMEOUT_ENV}'])"]
    for held, grace_s, given in (("200", 45, "200"), ("30", 44.5, "45"), ("", 60, "60"), ("soon", 60, "60")):
        log = tmp_path / f"log_{held}"
        assert processes.run(show, log, {**os.environ, processes.SHUTDOWN_TIMEOUT_ENV: held}, grace_s=grace_s) == 0
        assert log.read_text().split() == [given], (held, grace_s)
    assert processes.shutdown_timeout({processes.SHUTDOWN_TIMEOUT_ENV: "200"}) == 200
    assert processes.shutdown_timeout({}) is None
