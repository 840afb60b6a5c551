"""A `rollout-engine serve` subprocess on a free localhost port, for the
server tests (tests/test_server.py, tests/test_server_lifecycle.py)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

START_TIMEOUT = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "rollout_engine.cli", "serve", "--model", model, "--port", str(self.port),
               "--max-total-tokens", "8192", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited: {''.join(self.output)[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.proc.kill()
        raise AssertionError("the server did not come up")

    def post(self, path: str, body=None, **kw):
        return httpx.post(self.url + path, json=body, timeout=120, **kw)

    def stop(self, timeout: float = 10) -> tuple[int, float]:
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = None
        return code, time.monotonic() - start


PROMPTS = ["The capital of France is", "Two plus two equals", "A short poem about the sea:"]


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return kids
