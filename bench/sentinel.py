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


def make_certs(root: Path) -> Path:
    """A CA and a certificate for 127.0.0.1 signed by it (openssl), in ``root``."""
    root.mkdir(parents=True, exist_ok=True)

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=root, check=True, capture_output=True)

    ssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=mlxq-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    )
    ssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "node.key",
        "-out",
        "node.csr",
    )
    (root / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl(
        "x509",
        "-req",
        "-in",
        "node.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "node.crt",
    )
    return root


def tls_args(certs: Path) -> list[str]:
    return [
        "--tls-cert-file", str(certs / "node.crt"),
        "--tls-key-file", str(certs / "node.key"),
        "--tls-ca-cert-file", str(certs / "ca.crt"),
        "--tls-auth-clients", "no",
        "--tls-replication", "yes",
    ]  # fmt: skip


class SentinelGroup:
    """``tls=True``: the data nodes replicate and serve over TLS (each keeps a plain
    port for the test's own look), the Sentinels speak TLS only, to clients and to the
    nodes; the CA is ``ca`` (see :func:`make_certs`)."""

    def __init__(
        self, root: Path, replicas: int = 2, sentinels: int = 3, tls: bool = False
    ) -> None:
        self.root = root
        self.certs = make_certs(root / "certs") if tls else None
        self.tls_ports: dict[int, int] = {}  # plain port -> TLS port

        def node(name: str, *args: str) -> LocalRedis:
            extra = list(args)
            if self.certs is not None:
                tls_port = free_port()
                extra = ["--tls-port", str(tls_port), *tls_args(self.certs), *extra]
            r = LocalRedis(data_dir=root / name, extra_args=tuple(extra)).start()
            if self.certs is not None:
                self.tls_ports[r.port] = tls_port
            return r

        self.primary = node("primary")
        announced = self.tls_ports.get(self.primary.port, self.primary.port)
        self.replicas = [
            node(f"replica{i}", "--replicaof", "127.0.0.1", str(announced)) for i in range(replicas)
        ]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinels: list[subprocess.Popen[bytes]] = []
        server = shutil.which("redis-server") or "redis-server"
        for i, port in enumerate(self.sentinel_ports):
            conf = root / f"sentinel{i}.conf"
            listen = f"port {port}\n"
            if self.certs is not None:
                flags = tls_args(self.certs)
                pairs = zip(flags[::2], flags[1::2], strict=True)
                listen = f"port 0\ntls-port {port}\n" + "".join(f"{k[2:]} {v}\n" for k, v in pairs)
            conf.write_text(
                f"{listen}bind 127.0.0.1\ndir {root}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {announced} 2\n"
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
        if self.certs is None:
            return f"redis+sentinel://{hosts}/{MASTER}/0"
        ca = self.certs / "ca.crt"
        return f"rediss+sentinel://{hosts}/{MASTER}/0?sentinel_tls=true&ssl_ca_certs={ca}"

    def _sentinel(self, port: int) -> Redis:
        if self.certs is None:
            return Redis(port=port)
        return Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(self.certs / "ca.crt"))

    def _wait_ready(self, timeout: float = 20.0) -> None:
        """Until every Sentinel knows the primary, its replicas and the other Sentinels."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                ok = all(
                    len(s.sentinel_slaves(MASTER)) == len(self.replicas)
                    and len(s.sentinel_sentinels(MASTER)) == len(self.sentinel_ports) - 1
                    for s in (self._sentinel(p) for p in self.sentinel_ports)
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
        """The primary's (plain) port, as the Sentinels name it now."""
        _, port = self._sentinel(self.sentinel_ports[0]).sentinel_get_master_addr_by_name(MASTER)
        plain = {t: p for p, t in self.tls_ports.items()}
        return plain.get(int(port), int(port))

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
