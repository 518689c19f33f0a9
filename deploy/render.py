"""Render the shipped load-balancer configurations for a list of retrywatch proxies.

The files under ``deploy/nginx`` and ``deploy/haproxy`` are usable as they are (two proxies on
loopback ports 8101 and 8102, the balancer on 127.0.0.1:8080). This script writes copies for any
list of proxies and another listen address, changing nothing else: the shipped files stay the one
source of every setting (the server options are read from them).

    python deploy/render.py nginx --listen 127.0.0.1:8080 \\
        --replica 10.0.0.11:8100 --replica 10.0.0.12:8100 --out /etc/retrywatch-lb
    nginx -p /etc/retrywatch-lb -c /etc/retrywatch-lb/nginx.conf

    python deploy/render.py haproxy --listen 127.0.0.1:8080 --replica 10.0.0.11:8100 --out DIR
    haproxy -db -f DIR/retrywatch.cfg

Standard library only, so it runs with any Python 3.11 and from the tests. Addresses are
``HOST:PORT`` (a name, an IPv4 address or a bracketed IPv6 address); anything else is refused
before a line is written, so nothing can be smuggled into a configuration.
"""

from __future__ import annotations

import argparse
import re
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path

DEPLOY_DIR = Path(__file__).resolve().parent
NGINX_DIR = DEPLOY_DIR / "nginx"
HAPROXY_CONFIG = DEPLOY_DIR / "haproxy" / "retrywatch.cfg"
NGINX_FILES = ("nginx.conf", "retrywatch.conf")  # copied as they are, but for the listen line
NGINX_REPLICAS = "replicas.conf"  # written: one server line per proxy

_ADDRESS = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}[A-Za-z0-9])?):(\d{1,5})")
_NGINX_LISTEN = re.compile(r"^(\s*listen\s+)[^;\s]+;", re.MULTILINE)
_NGINX_SERVER = re.compile(r"^server\s+\S+\s*(?P<options>[^;]*);", re.MULTILINE)
_HAPROXY_BIND = re.compile(r"^(\s*bind\s+)\S+", re.MULTILINE)
_HAPROXY_REPLICAS = re.compile(
    r"^(?P<indent>[ \t]*)# BEGIN replicas.*?\n(?P<body>.*?)^[ \t]*# END replicas", re.MULTILINE | re.DOTALL
)


class RenderError(ValueError):
    """An address or a shipped file the renderer cannot use; the message says which."""


def check_address(address: str) -> str:
    """``address`` if it is ``HOST:PORT`` with a port in 1..65535; else RenderError."""
    match = _ADDRESS.fullmatch(address)
    if match is None or not 1 <= int(match[1]) <= 65535:
        raise RenderError(f"not a HOST:PORT address: {address!r}")
    return address


def _replicas(replicas: Sequence[str]) -> list[str]:
    if not replicas:
        raise RenderError("at least one replica (a retrywatch proxy's HOST:PORT) is needed")
    checked = [check_address(r) for r in replicas]
    if len(set(checked)) != len(checked):
        raise RenderError(f"a replica is listed twice: {checked}")
    return checked


def _replace_one(pattern: re.Pattern[str], text: str, replacement: str, what: str) -> str:
    new, count = pattern.subn(replacement, text)
    if count != 1:
        raise RenderError(f"expected exactly one {what}, found {count}")
    return new


def render_nginx(replicas: Sequence[str], listen: str, out_dir: Path) -> Path:
    """Write nginx.conf, retrywatch.conf and replicas.conf into ``out_dir``; the nginx.conf path.

    Run it with ``nginx -p OUT_DIR -c OUT_DIR/nginx.conf`` (its temporary files go to OUT_DIR).
    """
    servers = _replicas(replicas)
    listen = check_address(listen)
    shipped = (NGINX_DIR / NGINX_REPLICAS).read_text(encoding="utf-8")
    first = _NGINX_SERVER.search(shipped)
    if first is None:
        raise RenderError(f"{NGINX_DIR / NGINX_REPLICAS} has no server line to take the options from")
    options = f" {first['options'].strip()}" if first["options"].strip() else ""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in NGINX_FILES:
        text = (NGINX_DIR / name).read_text(encoding="utf-8")
        if name == "retrywatch.conf":
            text = _replace_one(_NGINX_LISTEN, text, rf"\g<1>{listen};", "listen directive")
        (out_dir / name).write_text(text, encoding="utf-8")
    header = "".join(line + "\n" for line in shipped.splitlines() if line.startswith("#"))
    lines = "".join(f"server {address}{options};\n" for address in servers)
    (out_dir / NGINX_REPLICAS).write_text(header + lines, encoding="utf-8")
    return out_dir / "nginx.conf"


def haproxy_server_id(address: str) -> int:
    """A server's id, from its address alone.

    HAProxy places a server on its consistent-hash ring by the server's id, and the default id is
    the server's position in the list: removing one server would renumber those after it and move
    their calls too. An id derived from the address moves nothing but the removed server's calls.
    """
    return zlib.crc32(check_address(address).encode()) % 2_147_483_646 + 1


def render_haproxy(replicas: Sequence[str], listen: str, out_dir: Path) -> Path:
    """Write retrywatch.cfg into ``out_dir``; its path. Run it with ``haproxy -db -f PATH``."""
    servers = _replicas(replicas)
    listen = check_address(listen)
    ids = [haproxy_server_id(address) for address in servers]
    if len(set(ids)) != len(ids):
        raise RenderError(
            f"two replicas get the same HAProxy server id: {dict(zip(servers, ids, strict=True))}"
        )
    text = HAPROXY_CONFIG.read_text(encoding="utf-8")
    text = _replace_one(_HAPROXY_BIND, text, rf"\g<1>{listen}", "bind line")
    block = _HAPROXY_REPLICAS.search(text)
    if block is None:
        raise RenderError(f"{HAPROXY_CONFIG} has no '# BEGIN replicas' ... '# END replicas' block")
    indent = block["indent"]
    lines = "".join(
        f"{indent}server proxy{i} {address} id {sid}\n"
        for i, (address, sid) in enumerate(zip(servers, ids, strict=True), start=1)
    )
    text = text[: block.start("body")] + lines + text[block.end("body") :]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / HAPROXY_CONFIG.name
    path.write_text(text, encoding="utf-8")
    return path


RENDERERS = {"nginx": render_nginx, "haproxy": render_haproxy}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("balancer", choices=sorted(RENDERERS))
    parser.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT the balancer listens on")
    parser.add_argument(
        "--replica", action="append", default=[], required=True, help="a proxy's HOST:PORT (repeat)"
    )
    parser.add_argument("--out", type=Path, required=True, help="directory to write the files into")
    args = parser.parse_args(argv)
    try:
        path = RENDERERS[args.balancer](args.replica, args.listen, args.out)
    except RenderError as exc:
        parser.error(str(exc))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
