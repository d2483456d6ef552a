"""A primary, its replicas and three Sentinels on 127.0.0.1, for failover tests."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

from redis import Redis

from producer.localredis import LocalRedis, free_port

MASTER = "mlxq-primary"


class SentinelGroup:
    def __init__(self, root: Path, replicas: int = 2, sentinels: int = 3) -> None:
        self.root = root
        self.primary = LocalRedis(data_dir=root / "primary").start()
        self.replicas = [
            LocalRedis(
                data_dir=root / f"replica{i}",
                extra_args=("--replicaof", "127.0.0.1", str(self.primary.port)),
            ).start()
            for i in range(replicas)
        ]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinels: list[subprocess.Popen[bytes]] = []
        server = shutil.which("redis-server") or "redis-server"
        for i, port in enumerate(self.sentinel_ports):
            conf = root / f"sentinel{i}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {root}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER} 600\n"
                f"sentinel failover-timeout {MASTER} 3000\n"
                f"sentinel parallel-syncs {MASTER} 2\n"
            )
            self.sentinels.append(
                subprocess.Popen(
                    [server, str(conf), "--sentinel"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        self._wait_ready()

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{MASTER}/0"

    def _wait_ready(self, timeout: float = 20.0) -> None:
        """Until every Sentinel knows the primary, its replicas and the other Sentinels."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                ok = all(
                    len(s.sentinel_slaves(MASTER)) == len(self.replicas)
                    and len(s.sentinel_sentinels(MASTER)) == len(self.sentinel_ports) - 1
                    for s in (Redis(port=p) for p in self.sentinel_ports)
                )
                synced = all(
                    Redis(port=r.port).info("replication").get("master_link_status") == "up"
                    for r in self.replicas
                )
                if ok and synced:
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the Sentinel group did not come up")
            time.sleep(0.1)

    def primary_port(self) -> int:
        _, port = Redis(port=self.sentinel_ports[0]).sentinel_get_master_addr_by_name(MASTER)
        return int(port)

    def kill_primary(self) -> None:
        assert self.primary.proc is not None
        self.primary.proc.send_signal(signal.SIGKILL)
        self.primary.proc.wait(10)
        self.primary.proc = None

    def freeze_primary(self) -> None:
        assert self.primary.proc is not None
        self.primary.proc.send_signal(signal.SIGSTOP)

    def thaw_primary(self) -> None:
        assert self.primary.proc is not None
        self.primary.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for p in self.sentinels:
            p.terminate()
        for p in self.sentinels:
            p.wait(10)
        for r in [self.primary, *self.replicas]:
            r.stop()
