"""Which address a rank's listeners bind and advertise to its peers.

A job's ranks meet at the coordinator (`--coordinator HOST0:PORT`, SLURM's first node). Every
listener a rank opens afterwards (ODC's tcp server, the lock-step collectives, the communicator's
ring and shared-state servers) binds and advertises the address of this host that routes to the
coordinator: the source address the kernel picks for a packet to it (a UDP socket "connected" to
the coordinator; nothing is sent). A coordinator on loopback gives loopback, so one-host jobs stay
on 127.0.0.1. Where the route to the coordinator is loopback but other ranks run on other hosts
(a hostname the local /etc/hosts maps to 127.0.1.1, as Debian does), the address that routes to
those ranks is used instead (`refine`).

On hosts with several networks the override wins: `jaxodc launch --local-addr ADDR`, which sets
$JAXODC_LOCAL_ADDR for the ranks ($JAXODC_ODC_HOST, its older name, is read too).
"""
from __future__ import annotations

import ipaddress
import os
import socket
from typing import Mapping

__all__ = ["ADDR_ENV", "LEGACY_ENV", "override", "route_address", "is_loopback_host", "listen_address",
           "default_listen_host", "set_process_address", "refine", "bind_address", "unreachable_hint"]

ADDR_ENV = "JAXODC_LOCAL_ADDR"
LEGACY_ENV = "JAXODC_ODC_HOST"
LOOPBACK = "127.0.0.1"

_process_address: str | None = None  # chosen once per process by init_from_env


def override(environ: Mapping[str, str] | None = None) -> str | None:
    """The address the user asked for ($JAXODC_LOCAL_ADDR, else $JAXODC_ODC_HOST), or None."""
    env = os.environ if environ is None else environ
    return env.get(ADDR_ENV) or env.get(LEGACY_ENV) or None


def is_loopback_host(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def route_address(host: str, port: int = 9) -> str:
    """This host's source address for packets to `host` (resolved here): the address that routes
    there. No packet is sent (connecting a UDP socket only picks the route). OSError when `host`
    does not resolve or no route leads to it."""
    infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
    if not infos:
        raise OSError(f"{host!r} does not resolve to an IPv4 address")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(infos[0][4])
        return s.getsockname()[0]


def listen_address(coordinator: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The override if given, else loopback for no / a loopback coordinator ("host:port" or a
    bare host), else the address that routes to the coordinator."""
    chosen = override(environ)
    if chosen:
        return chosen
    if not coordinator:
        return LOOPBACK
    host, sep, port = coordinator.rpartition(":")
    host = (host if sep and port.isdigit() else coordinator).strip("[]")
    if is_loopback_host(host):
        return LOOPBACK
    try:
        return route_address(host)
    except OSError as e:
        raise OSError(f"no route from this host to the coordinator {coordinator}: {e}; give this host's address "
                      f"with `jaxodc launch --local-addr ADDR` (or ${ADDR_ENV})") from None


def set_process_address(address: str | None) -> None:
    """Makes `address` every listener's default in this process (init_from_env calls it)."""
    global _process_address
    _process_address = address


def default_listen_host(coordinator: str | None = None) -> str:
    """What a listener binds when its caller gives no address: the override, else the address
    this process's job chose (init_from_env), else the one that routes to `coordinator` (or to
    $JAXODC_COORDINATOR), else loopback."""
    chosen = override()
    if chosen:
        return chosen
    if coordinator is None and _process_address:
        return _process_address
    return listen_address(coordinator or os.environ.get("JAXODC_COORDINATOR"))


def refine(mine: str, my_host: str, peers: list[dict]) -> str:
    """`mine` (the route to the coordinator) unless it is loopback while a rank on another host
    advertised a routable address: then the address that routes to that rank. `peers`: every
    rank's {"host": hostname, "addr": its address}."""
    if not is_loopback_host(mine):
        return mine
    for p in peers:
        if p.get("host") != my_host and p.get("addr") and not is_loopback_host(p["addr"]):
            try:
                return route_address(p["addr"])
            except OSError:
                continue
    return mine


def bind_address(host: str, environ: Mapping[str, str] | None = None) -> str:
    """The interface rank 0 serves the coordinator address `host` on: loopback stays loopback;
    the override if given; `host`'s address when it is one of this host's own (route to itself);
    else every interface (the name resolves here to another address than peers use, e.g. 127.0.1.1)."""
    if is_loopback_host(host):
        return LOOPBACK if host in ("localhost", "") else host.strip("[]")
    chosen = override(environ)
    if chosen:
        return chosen
    try:
        ip = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
        if not ipaddress.ip_address(ip).is_loopback and route_address(ip) == ip:
            return ip
    except (OSError, IndexError):
        pass
    return "0.0.0.0"


def unreachable_hint(rank: int, host: str, address: str) -> str:
    """What to tell a rank that could not connect to `rank` (on `host`) at `address`."""
    return (f"rank {rank} (host {host or '?'}) advertised {address}, the address of its host that routes to the "
            f"coordinator; if that is not reachable from this host (several networks, a firewall), start that "
            f"host's launcher with --local-addr ADDR (or set ${ADDR_ENV}) to an address this host can reach")
