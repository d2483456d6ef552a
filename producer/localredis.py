"""A private ``redis-server`` on a free port, for the demo, tests and benchmarks."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from redis import Redis
from redis.exceptions import AuthenticationError, NoPermissionError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """Start ``redis-server`` on 127.0.0.1 (no persistence unless ``appendonly``); stop on exit."""

    def __init__(
        self,
        port: int | None = None,
        data_dir: Path | None = None,
        appendonly: bool = False,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.extra_args = extra_args
        self.port = port or free_port()
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="mlxq-redis-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> LocalRedis:
        server = shutil.which("redis-server")
        if server is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        args = [
            server,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--dir",
            str(self.data_dir),
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        conn = Redis(port=self.port)
        deadline = time.monotonic() + timeout
        while True:
            try:
                conn.ping()
                return self
            except (AuthenticationError, NoPermissionError):  # up, with ACL users (--aclfile)
                return self
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
