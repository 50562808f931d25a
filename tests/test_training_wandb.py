"""W&B asked to log online where it cannot: refused in one line without an API key, taken offline within
logger.init_timeout_s when its server does not answer. W&B only ever sees loopback addresses here: a closed port, or
a socket of this test that accepts and never answers."""

import json
import socket
import threading
import time
from contextlib import nullcontext
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from colocated_grpo.compat import wandb as wandb_log
from colocated_grpo.launch.processes import free_port

REFUSAL = "`wandb login` or WANDB_API_KEY; or use WANDB_MODE=offline, then `wandb sync`"  # the end of the one line


def online(tmp_path, base_url: str, api_key: str = "") -> dict:
    """W&B online against `base_url`, with `api_key` as its only credential (no .netrc, no settings files)."""
    return {
        "WANDB_MODE": "online",
        "WANDB_BASE_URL": base_url,
        "WANDB_API_KEY": api_key,
        "WANDB_IDENTITY_TOKEN_FILE": "",
        "NETRC": str(tmp_path / "no-netrc"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_ERROR_REPORTING": "false",
    }


class SilentServer:
    """A W&B server that hangs: accepts connections on a loopback port and never answers, for at most `limit_s`."""

    def __init__(self, limit_s: float = 300):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self.until = time.monotonic() + limit_s
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self):
        while time.monotonic() < self.until:
            try:
                self.accepted.append(self.sock.accept()[0])
            except TimeoutError:
                continue

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.until = 0
        self.thread.join()
        for conn in self.accepted:
            conn.close()
        self.sock.close()


class RejectingServer(ThreadingHTTPServer):
    """A W&B server on a loopback port that answers every request 401, as W&B's answers a key it does not know."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = b'{"errors": [{"message": "user is not logged in"}]}'
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST

        def log_message(self, *args):
            self.server.requests += 1

    def __init__(self):
        super().__init__(("127.0.0.1", 0), self.Handler)
        self.url, self.requests = f"http://127.0.0.1:{self.server_address[1]}", 0

    def __enter__(self):
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


def test_wandb_online_without_an_api_key_is_refused_in_one_line_before_anything_loads(train, tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"
    run = train("placement=none", env=online(tmp_path, closed), check=False)
    assert run.proc.returncode == 1, run.output[-3000:]
    lines = [line for line in run.output.splitlines() if "W&B" in line]
    assert lines == [f"WandbError: W&B online needs an API key (none found for {closed}): {REFUSAL}"], run.output
    assert "Traceback" not in run.output and "UsageError" not in run.output
    assert "measuring prompts" not in run.output, "refused with the config checks, before the data and the model"
    record = json.loads((run.dir / "run.json").read_text())
    assert record["status"] == "failed" and record["error"] == lines[0]
    assert not (run.dir / "wandb").exists(), "W&B never started"


@pytest.mark.parametrize("server", ["never answers", "closed port"])
def test_wandb_online_with_an_unreachable_server_falls_back_to_offline_and_trains(train, tmp_path, server):
    timeout_s = 3
    with SilentServer() if server == "never answers" else nullcontext() as silent:
        url = silent.url if silent else f"http://127.0.0.1:{free_port()}"
        run = train(
            "placement=none",
            "trainer.max_steps=2",
            f"logger.init_timeout_s={timeout_s}",
            env=online(tmp_path, url, api_key="k" * 40),
        )
        assert silent is None or silent.accepted, "W&B tried the (loopback) server first"
    record = json.loads((run.dir / "run.json").read_text())
    wandb = record["wandb"]
    assert wandb["asked"] == "online" and wandb["mode"] == "offline" and url in wandb["reason"]
    assert timeout_s <= wandb["waited_s"] <= timeout_s + 5, "a bounded wait: logger.init_timeout_s, not W&B's 90 s"
    assert record["status"] == "finished" and [m["train/global_step"] for m in run.metrics()] == [1, 2]
    (segment,) = run.dir.glob(f"wandb/offline-run-*-{record['wandb_id']}")
    steps = [r["train/global_step"] for r in wandb_log.history(segment / f"run-{record['wandb_id']}.wandb")]
    assert {1, 2} <= set(steps), "the steps are in the offline W&B run"
    warnings = [line for line in run.output.splitlines() if "logging offline instead" in line]
    assert len(warnings) == 1 and warnings[0].endswith(f"upload later with: wandb sync {segment}"), run.output
    assert "CommError" not in run.output and "Traceback" not in run.output


def test_wandb_online_with_a_key_the_server_rejects_is_refused_in_one_line(train, tmp_path):
    with RejectingServer() as server:
        run = train("placement=none", env=online(tmp_path, server.url, api_key="k" * 40), check=False)
        assert server.requests, "W&B asked the (loopback) server"
    assert run.proc.returncode == 1, run.output[-3000:]
    lines = [line for line in run.output.splitlines() if "W&B online" in line]
    assert lines == [
        f"WandbError: W&B online: {server.url} refused the run (user is not logged in); check WANDB_API_KEY or "
        "`wandb login`, or use WANDB_MODE=offline, then `wandb sync`"
    ], run.output
    assert "Traceback" not in run.output and "Loading weights" not in run.output, "refused before the model loads"
    record = json.loads((run.dir / "run.json").read_text())
    assert record["status"] == "failed" and record["error"] == lines[0]


@pytest.mark.parametrize("training", ["finishes", "fails"])
def test_a_failure_while_the_run_ends_is_recorded_and_never_hides_the_error_that_ended_training(train, training):
    failing_reward = ["reward=length", "+reward.modules=[failing_wandb_finish,faulty_rewards]"]
    failing_reward.append("+reward.weights.fails_on_odd_answer=1.0")
    modules = failing_reward if training == "fails" else ["+reward.modules=[failing_wandb_finish]"]
    run = train("placement=none", "trainer.max_steps=2", "logger=wandb", *modules, check=False)
    assert run.proc.returncode == 1, run.output[-3000:]
    finish = "RuntimeError: W&B's finish failed (tests/plugins/failing_wandb_finish.py)"
    assert f"W&B's finish failed while the run ended: {finish}" in run.output, run.output[-3000:]
    record = json.loads((run.dir / "run.json").read_text())
    assert record["status"] == "failed" and record["attempts"][-1]["status"] == "failed"
    if training == "finishes":  # the run trained every step; its ending failed, and says so as the run's error
        assert [m["train/global_step"] for m in run.metrics()] == [1, 2]
        assert record["error"] == finish and run.output.count(finish) == 2, "logged as it happened, then reported"
    else:  # the reward's error ended training: it stays the error reported and recorded
        assert record["error"].startswith("RewardError: reward 'fails_on_odd_answer'")
        reported = [line for line in run.output.splitlines() if line.startswith(("RewardError", "RuntimeError"))]
        assert reported[-1].startswith("RewardError: reward 'fails_on_odd_answer'"), reported
