"""Dev routes refuse cross-site use (a browser page driving /sleep or /update_weights).

With no admin key on the default loopback set-up, a page on any site could POST text/plain to
/sleep?level=2, and a DNS-rebound name reached every route. A browser request always says where it
comes from, so three checks close both doors:
- Host (when no admin key is set): a name this server answers to: loopback names, the bound address,
  an IP literal when bound to every interface, and --allowed-hosts. A rebound name is refused (403).
- Origin: when present (browsers send it on every cross-origin POST), its host must pass the same
  test; "null" (sandboxed pages, file://) never does (403).
- Content-Type on POST: application/json, which no page can send cross-site without a CORS
  preflight this server never grants (415 otherwise). A POST with no Content-Type and no Origin is
  a plain client (curl -X POST, requests.post(url, params=...)), not a browser, and passes.
"""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from fastapi import Request

from server.api.errors import APIError
from server.api.settings import ServerSettings

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def _name(hostport: str) -> str:
    """'Example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    hostport = hostport.strip().lower()
    if hostport.startswith("["):
        return hostport[1:].partition("]")[0]
    if hostport.count(":") > 1:  # a bare IPv6 address
        return hostport
    return hostport.partition(":")[0].rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    name = _name(host) if host not in WILDCARDS else host
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_allowed(hostport: str, settings: ServerSettings) -> bool:
    name = _name(hostport)
    if not name:
        return False
    allowed = {_name(h) for h in settings.allowed_hosts}
    if "*" in allowed or name in allowed or name in LOOPBACK_NAMES or name == _name(settings.host):
        return True
    return settings.host in WILDCARDS and _is_ip(name)


async def check_dev_request(request: Request) -> None:
    settings: ServerSettings = request.app.state.settings
    host = request.headers.get("host", "")
    # With an admin key the key is the guard (a browser never attaches a Bearer key by itself), so
    # container names and proxies need no --allowed-hosts; Origin and Content-Type are still checked.
    if not settings.effective_admin_key and not host_allowed(host, settings):
        raise APIError(403, f"the Host header {host[:100]!r} is not a name this server answers to; "
                            "dev routes accept loopback names and the bound address (add names with "
                            "--allowed-hosts)", None, "host_not_allowed")
    origin = request.headers.get("origin")
    if origin is not None:
        try:
            netloc = urlsplit(origin).netloc if origin != "null" else ""
        except ValueError:
            netloc = ""
        if not host_allowed(netloc.rpartition("@")[2], settings):
            raise APIError(403, f"cross-site request from origin {origin[:100]!r} refused; dev routes accept "
                                "requests from this server's own address (add names with --allowed-hosts)",
                           None, "origin_not_allowed")
    if request.method == "POST":
        ctype = request.headers.get("content-type")
        media = (ctype or "").partition(";")[0].strip().lower()
        if (ctype is not None or origin is not None) and media != "application/json":
            raise APIError(415, f"dev routes take Content-Type: application/json (got {(ctype or 'none')[:60]!r}); "
                                "send that header, or no body and no Content-Type", None, "unsupported_media_type")
