"""``vllm serve`` instances and the ``ucm pd-proxy`` as processes on loopback, for tests.

:class:`Service` starts a command, waits for its ``/health`` to answer and stops it;
:func:`vllm_server` builds the ``ucm serve`` command of a small CPU instance, pinned to
one core. :func:`prometheus_values` reads a ``/metrics`` page.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ucm.testing.engine import ENGINE_ENV
from ucm.testing.servers import free_port

_METRIC = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


class Service:
    """A server process on loopback with an HTTP ``/health`` endpoint."""

    def __init__(self, name: str, command: list[str], port: int, log_dir: Path, **env: str):
        """Start the process (it is not ready yet: see :meth:`wait_ready`).

        Args:
            name: A short name, for the log file and messages.
            command: The command line.
            port: The port it listens on.
            log_dir: Where ``<name>.log`` is written.
            env: Extra environment variables.
        """
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log_dir / f"{name}.log"
        with self.log.open("w") as out:
            self._process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 300) -> None:
        """Wait until ``/health`` answers 200.

        Raises:
            RuntimeError: The process exited or did not become ready in time.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        tail = self.log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{self.name} did not become ready:\n{tail}")

    def stop(self) -> None:
        """Stop the process group (SIGTERM, then SIGKILL after 20 s)."""
        if self._process.poll() is not None:
            return
        os.killpg(self._process.pid, signal.SIGTERM)
        try:
            self._process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()

    def get(self, path: str) -> str:
        """Return the body of ``GET path``."""
        with urllib.request.urlopen(self.url + path, timeout=30) as reply:
            return str(reply.read().decode())


def vllm_server(
    name: str,
    model: str,
    log_dir: Path,
    kv_transfer_config: dict[str, Any] | None,
    core: int,
    block_size: int = 32,
) -> Service:
    """Start ``ucm serve`` on a small CPU instance bound to one core.

    Args:
        name: A short name for the log.
        model: The local model directory.
        log_dir: Where the log goes.
        kv_transfer_config: vLLM's ``--kv-transfer-config``; None for no connector.
        core: The CPU core vLLM's threads are bound to.
        block_size: vLLM's KV block size.
    """
    port = free_port()
    command = [
        sys.executable, "-m", "ucm", "serve", model,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--seed", "0",
        "--block-size", str(block_size), "--max-model-len", "2048",
        "--kv-cache-memory-bytes", "64M", "--max-num-seqs", "8",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if kv_transfer_config is not None:
        command += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    # vLLM's default process layout (scheduler and workers in separate processes).
    env = {key: value for key, value in ENGINE_ENV.items() if "MULTIPROCESSING" not in key}
    return Service(name, command, port, log_dir, VLLM_CPU_OMP_THREADS_BIND=str(core), **env)


def pd_proxy(prefill: list[Service], decode: list[Service], log_dir: Path) -> Service:
    """Start ``ucm pd-proxy`` in front of prefill and decode instances."""
    port = free_port()
    command = [sys.executable, "-m", "ucm", "pd-proxy", "--port", str(port), "--prefill"]
    command += [service.url for service in prefill] + ["--decode"]
    command += [service.url for service in decode]
    return Service("proxy", command, port, log_dir)


def prometheus_values(page: str, name: str) -> dict[str, float]:
    """Return the samples of one metric on a Prometheus text page, by label set.

    Args:
        page: The ``/metrics`` body.
        name: The metric's name (e.g. ``vllm:prompt_tokens_by_source_total``).

    Returns:
        Label set (``'{source="local_compute",...}'``, or ``''``) to value.
    """
    values = {}
    for line in page.splitlines():
        match = _METRIC.match(line)
        if match and match.group(1) == name:
            values[match.group(2) or ""] = float(match.group(3))
    return values
