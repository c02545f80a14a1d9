"""A real mooncake_master for the L3 Mooncake tests: the binary that ships in the
mooncake-transfer-engine-non-cuda wheel, started on free loopback ports (RPC and its HTTP
metrics server), killed with SIGKILL, and restarted on the same port. `mooncake_master` is the
fixture; tests skip, saying how to install, where the package or the binary is missing."""
from __future__ import annotations

import importlib.util
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_DEADLINE_S = 15.0
SKIP_REASON = ("the Mooncake store client is not installed: `bash scripts/setup.sh --test` installs it "
               "(pip install --no-deps mooncake-transfer-engine-non-cuda; apt-get install libibverbs1)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary() -> Path | None:
    """The mooncake_master executable inside the installed package (found without importing it)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "mooncake_master"
        if path.is_file():
            return path
    return None


def client_importable() -> bool:
    """Whether mooncake.store loads (the package is there and so is libibverbs.so.1)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    return True


class MooncakeMaster:
    """One mooncake_master process at a time on `port`; its log under `workdir`."""

    def __init__(self, workdir: Path, binary: Path, port: int | None = None) -> None:
        self.workdir, self.binary = workdir, binary
        self.port = port or free_port()
        self.metrics_port = free_port()  # the master's HTTP server: on loopback too, never the default 9003
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, **query: int | str) -> str:
        tail = "&".join(f"{k}={v}" for k, v in query.items())
        return f"mooncake://127.0.0.1:{self.port}" + (f"?{tail}" if tail else "")

    def start(self) -> None:
        assert self.proc is None, "already running"
        argv = [str(self.binary), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
                "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
                "--enable_metric_reporting=false", "--logtostderr"]
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        self._wait_until_it_listens()

    def kill(self) -> None:
        """SIGKILL: no goodbye to the clients, no unmounting."""
        assert self.proc is not None, "not running"
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=START_DEADLINE_S)
        self.proc = None

    @property
    def log_path(self) -> Path:
        return self.workdir / f"mooncake-master-{self.port}.log"

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else "(no log)"

    def _wait_until_it_listens(self) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not listen within {START_DEADLINE_S} s: {self.log_tail()}")
            time.sleep(0.02)  # a poll interval, not a wait for something to have happened


def require_mooncake() -> Path:
    """The master binary, or a skip saying how to install the package."""
    binary = master_binary()
    if binary is None or not client_importable():
        pytest.skip(SKIP_REASON)
    return binary


@pytest.fixture
def mooncake_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    master = MooncakeMaster(tmp_path, require_mooncake())
    master.start()
    try:
        yield master
    finally:
        if master.proc is not None:
            master.kill()
