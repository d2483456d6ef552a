"""Images by URL: fetched by the worker from the hosts its operator allows, nowhere else.

A job that names an ``https://`` (or ``http://``) image makes the worker open a
connection, so the URL is untrusted input that could reach the worker's own network
(server-side request forgery). The rules (``worker --allow-image-host``):

- No host is allowed by default: such a job fails with a 400 naming the flag.
- A rule is a host name, a glob over names (``*.example.com``) or an IP address. The
  host's addresses are resolved once and the connection goes to the address checked
  (a name that resolves again to another address is not followed: DNS rebinding).
- Loopback, link-local (169.254.0.0/16: cloud metadata), private, multicast, reserved
  and unspecified addresses are refused unless a rule names that host exactly (not by a
  glob): ``--allow-image-host 127.0.0.1`` for a local image server.
- Redirects are followed up to :data:`MAX_REDIRECTS` times, each hop checked by the same
  rules; at most ``max_bytes`` are read, within :data:`TIMEOUT_S` per request.
"""

from __future__ import annotations

import fnmatch
import http.client
import ipaddress
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from schemas import InvalidRequestError

MAX_REDIRECTS = 3
TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ImageHosts:
    """The hosts a worker fetches images from (``--allow-image-host``)."""

    rules: tuple[str, ...] = ()

    def fetch(self, url: str, max_bytes: int, where: str) -> bytes:
        """The bytes at ``url``, if its host (and every redirect's) passes the rules."""
        if not self.rules:
            raise InvalidRequestError(
                f"{where}: this worker fetches no image URLs (its operator allows hosts "
                "with --allow-image-host); give the image as a data: URL"
            )
        for _ in range(MAX_REDIRECTS + 1):
            status, location, body = self._get(url, max_bytes, where)
            if status in (301, 302, 303, 307, 308) and location:
                url = urljoin(url, location)
                continue
            if status != 200:
                raise InvalidRequestError(f"{where}: {_show(url)} answered HTTP {status}")
            return body
        raise InvalidRequestError(f"{where}: more than {MAX_REDIRECTS} redirects")

    def address(self, host: str, where: str) -> str:
        """The address to connect to for ``host``, checked against the rules."""
        exact = host in self.rules
        if not exact and not any(fnmatch.fnmatchcase(host, r) for r in self.rules):
            raise InvalidRequestError(
                f"{where}: host {host!r} is not allowed (--allow-image-host: "
                f"{', '.join(self.rules)})"
            )
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as e:
            raise InvalidRequestError(f"{where}: host {host!r} does not resolve: {e}") from None
        addresses = sorted({str(info[4][0]) for info in infos})
        inner = [a for a in addresses if _internal(a)]
        if inner and not exact:
            raise InvalidRequestError(
                f"{where}: host {host!r} resolves to an internal address ({inner[0]}); "
                "only a host named exactly by --allow-image-host may"
            )
        return addresses[0]

    def _get(self, url: str, max_bytes: int, where: str) -> tuple[int, str | None, bytes]:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequestError(f"{where}: {_show(url)} is not an http(s) URL")
        host = parts.hostname
        ip = self.address(host, where)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        conn = _Pinned(parts.scheme, host, ip, port)
        path = parts.path or "/"
        try:
            conn.request("GET", path + (f"?{parts.query}" if parts.query else ""))
            reply = conn.getresponse()
            size = reply.getheader("Content-Length")
            if size is not None and size.isdigit() and int(size) > max_bytes:
                raise InvalidRequestError(
                    f"{where} is {int(size) / 2**20:.1f} MB; the limit is {max_bytes / 2**20:g} MB"
                )
            body = reply.read(max_bytes + 1)
            if len(body) > max_bytes:
                raise InvalidRequestError(f"{where} is over the {max_bytes / 2**20:g} MB limit")
            return reply.status, reply.getheader("Location"), body
        except (OSError, http.client.HTTPException) as e:
            raise InvalidRequestError(f"{where}: fetching {_show(url)} failed: {e}") from None
        finally:
            conn.close()


class _Pinned(http.client.HTTPSConnection):
    """An HTTP(S) connection to an address checked beforehand, naming the host in its
    request (and, for HTTPS, in SNI and the certificate check)."""

    def __init__(self, scheme: str, host: str, ip: str, port: int) -> None:
        self.tls = ssl.create_default_context()  # our own: certificates and host names checked
        super().__init__(host, port, timeout=TIMEOUT_S, context=self.tls)
        self.scheme, self.ip = scheme, ip

    def connect(self) -> None:
        self.sock = socket.create_connection((self.ip, self.port), self.timeout)
        if self.scheme == "https":
            self.sock = self.tls.wrap_socket(self.sock, server_hostname=self.host)


def _internal(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return (
        ip.is_loopback
        or ip.is_link_local
        or ip.is_private
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


def _show(url: str) -> str:
    """A URL as errors show it: its scheme and host (no path, query or credentials)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}"
