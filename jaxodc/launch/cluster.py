"""Emulated hosts on one Linux machine (root): a cluster for multi-host tests, benchmarks and tries.

Host i of a cluster is a network namespace with its own hostname (`host<i>`, a UTS namespace), its
own /dev/shm (a private tmpfs in its own mount namespace), an /etc/hosts naming every host, and one
interface `eth0` (10.77.0.<i+1>/24) on a veth link to a bridge. Nothing else is reachable from a
host: no default route, and the bridge has no address in the machine's own namespace. Each link
may be shaped to a rate (`tbf`, both directions); faults: a link down / up, a partition between
two sets of hosts, random loss of a host's incoming packets (iptables' `statistic` match), new
connections into a host refused. (Delay: `netem` may be missing from the kernel; the software
`Link` of ODC and the communicator adds it.)

    with Cluster(hosts=2, gbps=1.0) as c:
        p = c.popen(0, ["python", "-m", "jaxodc", "launch", ...])   # runs on host 0
        c.partition({0}, {1}); ...; c.heal()

Every name (namespaces `jxc<name>h<i>`, bridge `jxc<name>b`, veths `jxc<name>v<i>`, state under
/run/jaxodc-cluster/<name>) derives from the cluster's name, and a cluster records its owner
process. Closing removes everything it made, killing every process still running on its hosts;
starting a cluster first sweeps the remains of clusters whose owner died (a SIGKILLed test) and of
any earlier cluster of the same name. A cluster made by `jaxodc cluster up` has no owner: it lives
until `jaxodc cluster down`.

    python -m jaxodc cluster up demo --hosts 2 --gbps 1
    python -m jaxodc cluster exec demo 0 -- hostname            # any command, on host 0
    python -m jaxodc cluster link demo 1 down | up
    python -m jaxodc cluster partition demo 0 1                 # host sets as comma lists
    python -m jaxodc cluster loss demo 1 0.01 ; python -m jaxodc cluster heal demo
    python -m jaxodc cluster down demo
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

__all__ = ["Cluster", "Host", "ClusterUnavailable", "unavailable", "sweep", "main"]

STATE_ROOT = "/run/jaxodc-cluster"
PREFIX = "jxc"
SUBNET = "10.77.0"
TOOLS = ("ip", "tc", "iptables", "nsenter", "unshare", "mount")
_NAME_RE = re.compile(r"^[a-z0-9]{1,8}$")  # interface names: jxc + name + v/h + index <= 15 chars
_CHAIN = "JXC"          # partitions and refused connections (heal flushes it)
_LOSS_CHAIN = "JXCLOSS"  # random loss, apart so that healing a partition keeps it


class ClusterUnavailable(RuntimeError):
    """This machine cannot make emulated hosts (not root, a tool missing, no namespaces)."""


@dataclass
class Host:
    index: int
    name: str      # its hostname, also in every host's /etc/hosts
    address: str   # of its eth0
    netns: str
    holder: int    # pid of the process holding its UTS and mount namespaces


def unavailable() -> str | None:
    """Why emulated hosts cannot be made here, or None when they can (checked by making a
    throw-away network namespace and a UTS + mount namespace)."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, veth links, tc, iptables)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"emulated hosts need {', '.join(missing)} (Debian: apt-get install iproute2 iptables util-linux)"
    probe = f"{PREFIX}probe{os.getpid() % 100000}"
    try:
        _sh(["ip", "netns", "add", probe])
        try:
            _sh(["ip", "netns", "exec", probe, "unshare", "-u", "-m", "--propagation", "private", "--",
                 "sh", "-c", "hostname probe && mount -t tmpfs tmpfs /dev/shm"])
            _sh(["ip", "netns", "exec", probe, "iptables", "-w", "-L", "INPUT", "-n"])
        finally:
            _sh(["ip", "netns", "del", probe], check=False)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"namespaces cannot be made here: {_why(e)}"
    return None


def _why(e: BaseException) -> str:
    if isinstance(e, subprocess.CalledProcessError):
        return f"`{' '.join(e.cmd)}` failed: {(e.stderr or '').strip() or f'status {e.returncode}'}"
    return str(e)


def _sh(cmd: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=timeout)


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (tells a live owner from a reused pid), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(state: dict) -> bool:
    owner = state.get("owner")
    if owner is None:
        return True  # made by `jaxodc cluster up`: lives until `down`
    return _start_time(owner["pid"]) == owner["start"]


def _read_state(name: str) -> dict | None:
    try:
        with open(os.path.join(STATE_ROOT, name, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _names_in_use() -> set[str]:
    """Names of clusters with anything left on this machine: namespaces, links or state."""
    names = set()
    out = _sh(["ip", "netns", "list"], check=False).stdout
    names |= {m.group(1) for m in re.finditer(rf"^{PREFIX}([a-z0-9]+)h\d+\b", out, re.M)}
    out = _sh(["ip", "-o", "link", "show"], check=False).stdout
    names |= {m.group(1) for m in re.finditer(rf"^\d+: {PREFIX}([a-z0-9]+)[bv]\d*[@:]", out, re.M)}
    if os.path.isdir(STATE_ROOT):
        names |= {n for n in os.listdir(STATE_ROOT) if _NAME_RE.match(n)}
    return names - {"probe"}


def sweep(name: str | None = None) -> list[str]:
    """Removes the remains of clusters whose owner process is gone (and of cluster `name`,
    whoever owns it). Returns the names removed."""
    removed = []
    for n in sorted(_names_in_use()):
        state = _read_state(n)
        if state is None and _recent(os.path.join(STATE_ROOT, n)):
            continue  # being made right now: its state file comes next
        if n == name or state is None or not _owner_alive(state):
            _teardown(n)
            removed.append(n)
    return removed


def _recent(path: str, seconds: float = 30.0) -> bool:
    try:
        return time.time() - os.stat(path).st_mtime < seconds
    except OSError:
        return False


def _teardown(name: str) -> None:
    """Everything of cluster `name`: its hosts' processes (by pid), namespaces, links, state."""
    out = _sh(["ip", "netns", "list"], check=False).stdout
    netns = [m.group(0) for m in re.finditer(rf"^{PREFIX}{name}h\d+\b", out, re.M)]
    for ns in netns:
        # Every process on the host: the holder and whatever ran there (`ip netns pids`).
        for _ in range(3):
            pids = [int(p) for p in _sh(["ip", "netns", "pids", ns], check=False).stdout.split()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        _sh(["ip", "netns", "del", ns], check=False)
    out = _sh(["ip", "-o", "link", "show"], check=False).stdout
    for m in re.finditer(rf"^\d+: ({PREFIX}{name}[bv]\d*)[@:]", out, re.M):
        _sh(["ip", "link", "del", m.group(1)], check=False)
    shutil.rmtree(os.path.join(STATE_ROOT, name), ignore_errors=True)


class Cluster:
    """`hosts` emulated hosts joined by a bridge (see the module docstring).

    Args:
      hosts: how many (1..250).
      name: [a-z0-9]{1,8}, default a random one; every name the cluster makes derives from it.
      gbps: shape every link to this rate, both directions (None: unshaped).
      owned: tie the cluster to this process (swept once it is dead); False for `jaxodc cluster up`.
      shm_mb: size of each host's private /dev/shm.
    """

    def __init__(self, hosts: int = 2, *, name: str | None = None, gbps: float | None = None,
                 owned: bool = True, shm_mb: int = 4096):
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be in 1..250, got {hosts}")
        self.name = name or secrets.token_hex(4)
        if not _NAME_RE.match(self.name) or self.name == "probe":
            raise ValueError(f"cluster name {self.name!r} must match [a-z0-9]{{1,8}} (interface names are short)")
        self.n, self.gbps, self.owned, self.shm_mb = hosts, gbps, owned, shm_mb
        self.hosts: list[Host] = []
        self._holders: list[subprocess.Popen] = []
        self.state_dir = os.path.join(STATE_ROOT, self.name)

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> "Cluster":
        why = unavailable()
        if why:
            raise ClusterUnavailable(why)
        sweep(self.name)
        os.makedirs(self.state_dir, mode=0o700)
        self.hosts = [Host(i, f"host{i}", f"{SUBNET}.{i + 1}", f"{PREFIX}{self.name}h{i}", 0)
                      for i in range(self.n)]
        self._save()  # first: a crash from here on leaves a state the next sweep judges
        try:
            hosts_file = os.path.join(self.state_dir, "hosts")
            with open(hosts_file, "w") as f:
                f.write("127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts))
            os.chmod(hosts_file, 0o644)
            bridge = f"{PREFIX}{self.name}b"
            _sh(["ip", "link", "add", bridge, "type", "bridge"])
            _sh(["ip", "link", "set", bridge, "up"])
            for h in self.hosts:
                self._make_host(h, bridge, hosts_file)
            self._save()
            if self.gbps:
                self.set_rate(self.gbps)
        except BaseException:
            self.close()
            raise
        return self

    def _make_host(self, h: Host, bridge: str, hosts_file: str) -> None:
        ns, veth = h.netns, f"{PREFIX}{self.name}v{h.index}"
        _sh(["ip", "netns", "add", ns])
        _sh(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _sh(["ip", "link", "set", veth, "master", bridge, "up"])
        _sh(["ip", "-n", ns, "addr", "add", f"{h.address}/24", "dev", "eth0"])
        _sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        for chain in (_CHAIN, _LOSS_CHAIN):
            self._ipt(h.index, ["-N", chain])
            self._ipt(h.index, ["-A", "INPUT", "-j", chain])
        # The holder: a process in the host's netns that owns its hostname and mount namespace
        # (private /dev/shm, /etc/hosts); commands on the host join all three (nsenter).
        script = (f"hostname {h.name} && mount -t tmpfs -o size={self.shm_mb}m,mode=1777 tmpfs /dev/shm && "
                  f"mount --bind {hosts_file} /etc/hosts && exec sleep infinity")
        p = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "-u", "-m", "--propagation", "private", "--",
                              "sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, start_new_session=True, text=True)
        self._holders.append(p)
        deadline = time.monotonic() + 10.0
        while True:  # `ip netns exec`, unshare and sh each exec the next: the pid ends as sleep's
            if p.poll() is not None:
                raise ClusterUnavailable(f"host {h.index}: its namespaces could not be set up: {p.stderr.read().strip()}")
            try:
                with open(f"/proc/{p.pid}/comm") as f:
                    if f.read().strip() == "sleep":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"host {h.index}: its namespace holder did not start within 10 s")
            time.sleep(0.01)
        h.holder = p.pid

    def _save(self) -> None:
        owner = {"pid": os.getpid(), "start": _start_time(os.getpid())} if self.owned else None
        state = {"name": self.name, "hosts": [h.__dict__ for h in self.hosts], "gbps": self.gbps, "owner": owner}
        tmp = os.path.join(self.state_dir, "state.json.tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, os.path.join(self.state_dir, "state.json"))

    @classmethod
    def attach(cls, name: str) -> "Cluster":
        """The running cluster `name` (made by another process, e.g. `jaxodc cluster up`)."""
        state = _read_state(name)
        if state is None:
            raise ClusterUnavailable(f"no emulated cluster named {name!r} (start it with `jaxodc cluster up {name}`)")
        c = cls(len(state["hosts"]), name=name, gbps=state["gbps"], owned=state["owner"] is not None)
        c.hosts = [Host(**h) for h in state["hosts"]]
        return c

    def close(self) -> None:
        """Kills every process on the hosts and removes everything the cluster made."""
        _teardown(self.name)
        for p in self._holders:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if p.stderr:
                p.stderr.close()
        self._holders = []

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running things on a host --------------------------------------------------------------
    def command(self, i: int, argv: list[str], cwd: str | None = None) -> list[str]:
        """`argv` as a command line that runs it on host i (its network, hostname and mounts)."""
        h = self.hosts[i]
        return ["nsenter", "-t", str(h.holder), "-n", "-u", "-m", f"--wd={cwd or os.getcwd()}", "--", *argv]

    def popen(self, i: int, argv: list[str], cwd: str | None = None, **kwargs) -> subprocess.Popen:
        """Starts `argv` on host i (subprocess.Popen's keyword arguments apply)."""
        return subprocess.Popen(self.command(i, argv, cwd), **kwargs)

    def run(self, i: int, argv: list[str], cwd: str | None = None, timeout: float = 60.0,
            **kwargs) -> subprocess.CompletedProcess:
        """Runs `argv` on host i to its end (subprocess.run's keyword arguments apply)."""
        return subprocess.run(self.command(i, argv, cwd), timeout=timeout, **kwargs)

    # -- the network ---------------------------------------------------------------------------
    def _ipt(self, i: int, args: list[str]) -> None:
        _sh(["ip", "netns", "exec", self.hosts[i].netns, "iptables", "-w", *args])

    def set_rate(self, gbps: float | None, hosts=None) -> None:
        """Shapes the links of `hosts` (default all) to `gbps` in each direction (tbf; None: unshaped)."""
        for i in self._which(hosts):
            h = self.hosts[i]
            for dev in (["ip", "netns", "exec", h.netns, "tc"], ["tc"]):
                name = "eth0" if len(dev) > 1 else f"{PREFIX}{self.name}v{i}"
                _sh([*dev, "qdisc", "del", "dev", name, "root"], check=False)
                if gbps:
                    rate = gbps * 1e9 / 8  # bytes/s
                    burst = max(int(rate * 0.002), 64 << 10)  # 2 ms of traffic: smooth, yet no timer-bound stalls
                    _sh([*dev, "qdisc", "add", "dev", name, "root", "tbf", "rate", f"{int(gbps * 1e6)}kbit",
                         "burst", str(burst), "latency", "50ms"])
        self.gbps = gbps
        self._save()

    def link(self, i: int, up: bool) -> None:
        """Takes host i's link down (nothing in or out; its sockets stay open) or back up."""
        _sh(["ip", "link", "set", f"{PREFIX}{self.name}v{i}", "up" if up else "down"])

    def partition(self, a, b) -> None:
        """Hosts in `a` and hosts in `b` stop hearing each other (their packets dropped on arrival,
        silently, as a network that lost the route would); each side still reaches its own."""
        a, b = set(a), set(b)
        for side, other in ((a, b), (b, a)):
            for i in side:
                for j in other:
                    self._ipt(i, ["-A", _CHAIN, "-i", "eth0", "-s", self.hosts[j].address, "-j", "DROP"])

    def refuse_connections(self, i: int) -> None:
        """New TCP connections into host i from other hosts are dropped (the SYN vanishes: a
        connect times out); its own outgoing connections and open ones keep working."""
        self._ipt(i, ["-A", _CHAIN, "-i", "eth0", "-p", "tcp", "--syn", "-j", "DROP"])

    def loss(self, i: int, p: float) -> None:
        """Each packet arriving at host i from the network is dropped with probability p (0: none)."""
        if not 0 <= p < 1:
            raise ValueError(f"loss probability must be in [0, 1), got {p}")
        self._ipt(i, ["-F", _LOSS_CHAIN])
        if p:
            self._ipt(i, ["-A", _LOSS_CHAIN, "-i", "eth0", "-m", "statistic", "--mode", "random",
                          "--probability", f"{p:.6f}", "-j", "DROP"])

    def heal(self) -> None:
        """Undoes partitions and refused connections on every host (loss and links stay)."""
        for i in range(self.n):
            self._ipt(i, ["-F", _CHAIN])

    def _which(self, hosts) -> list[int]:
        return list(range(self.n)) if hosts is None else [int(i) for i in hosts]


# -- `jaxodc cluster` -------------------------------------------------------------------------------

def _hosts(text: str) -> set[int]:
    return {int(x) for x in text.split(",") if x.strip()}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxodc cluster", description="Emulated hosts on this machine (root).")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make a cluster that lives until `down`")
    up.add_argument("name")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--gbps", type=float, default=None, help="shape every link to this rate")
    ex = sub.add_parser("exec", help="run a command on host I: exec NAME I -- CMD ...")
    ex.add_argument("name")
    ex.add_argument("host", type=int)
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    sub.add_parser("down", help="remove the cluster and every process on its hosts").add_argument("name")
    sub.add_parser("list", help="clusters on this machine")
    lk = sub.add_parser("link", help="take host I's link down or up")
    lk.add_argument("name")
    lk.add_argument("host", type=int)
    lk.add_argument("state", choices=("up", "down"))
    pa = sub.add_parser("partition", help="hosts A and hosts B (comma lists) stop hearing each other")
    pa.add_argument("name")
    pa.add_argument("a", type=_hosts)
    pa.add_argument("b", type=_hosts)
    sub.add_parser("heal", help="undo partitions").add_argument("name")
    lo = sub.add_parser("loss", help="drop each packet arriving at host I with probability P")
    lo.add_argument("name")
    lo.add_argument("host", type=int)
    lo.add_argument("p", type=float)
    ra = sub.add_parser("rate", help="shape every link to GBPS (0: unshaped)")
    ra.add_argument("name")
    ra.add_argument("gbps", type=float)
    args = p.parse_args(argv)
    try:
        if args.cmd == "list":
            for n in sorted(_names_in_use()):
                s = _read_state(n)
                print(f"{n}: {len(s['hosts']) if s else '?'} hosts" + ("" if s and _owner_alive(s) else " (stale)"))
            return 0
        if args.cmd == "up":
            c = Cluster(args.hosts, name=args.name, gbps=args.gbps, owned=False).start()
            for h in c.hosts:
                print(f"{h.name} {h.address} (netns {h.netns})")
            return 0
        if args.cmd == "down":
            _teardown(args.name)
            return 0
        c = Cluster.attach(args.name)
        if args.cmd == "exec":
            cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not cmd:
                p.error("exec: give the command after --")
            if not 0 <= args.host < c.n:
                p.error(f"exec: host {args.host} is outside 0..{c.n - 1}")
            os.execvp("nsenter", c.command(args.host, cmd))
        elif args.cmd == "link":
            c.link(args.host, args.state == "up")
        elif args.cmd == "partition":
            c.partition(args.a, args.b)
        elif args.cmd == "heal":
            c.heal()
        elif args.cmd == "loss":
            c.loss(args.host, args.p)
        elif args.cmd == "rate":
            c.set_rate(args.gbps or None)
    except (ClusterUnavailable, ValueError, subprocess.CalledProcessError) as e:
        print(f"jaxodc cluster: {_why(e)}", file=sys.stderr)
        return 1
    return 0
