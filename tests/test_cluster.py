"""Emulated hosts (jaxodc.launch.cluster) and the address every listener of a multi-host job takes
(jaxodc.launch.address): what each host sees, shaping and faults, cleanup after a SIGKILLed owner,
and jobs on two hosts with nothing but the launcher's flags."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from jaxodc.launch import address
from emulated_hosts import needs_hosts, require_hosts
from jaxodc.launch.cluster import Cluster, _names_in_use, sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(ROOT, "tests", "support", "listen_probe.py")


def _env():
    from jaxodc.launch.launcher import rank_env_defaults
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXODC_")}
    return {**env, **rank_env_defaults(env), "PYTHONPATH": ROOT}


def _py(c: Cluster, i: int, code: str, timeout: float = 20.0, **kw) -> str:
    """Runs Python `code` on host i; its stdout."""
    r = c.run(i, [sys.executable, "-c", textwrap.dedent(code)], timeout=timeout, capture_output=True, text=True,
              env=_env(), **kw)
    assert r.returncode == 0, f"host {i}: {r.stderr}"
    return r.stdout


def _leftovers(name: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return ([l for l in out.splitlines() if l.startswith(f"jxc{name}h")]
            + re.findall(rf"jxc{name}[bv]\d*", links) + [p for p in [f"/run/jaxodc-cluster/{name}"] if os.path.exists(p)])


@pytest.fixture(scope="module")
def cluster():
    require_hosts()
    with Cluster(2) as c:
        yield c
    assert _leftovers(c.name) == []


# -- the address choice, without hosts -------------------------------------------------------------

def test_address_loopback_and_override():
    assert address.listen_address(None, {}) == "127.0.0.1"
    assert address.listen_address("127.0.0.1:29500", {}) == "127.0.0.1"
    assert address.listen_address("localhost:29500", {}) == "127.0.0.1"
    assert address.listen_address("host0:29500", {"JAXODC_LOCAL_ADDR": "10.1.2.3"}) == "10.1.2.3"
    assert address.listen_address("host0:29500", {"JAXODC_ODC_HOST": "10.1.2.4"}) == "10.1.2.4"  # the old name
    assert address.bind_address("127.0.0.1", {}) == "127.0.0.1"
    assert address.bind_address("localhost", {}) == "127.0.0.1"


# -- one cluster: what a host sees -----------------------------------------------------------------

@needs_hosts
def test_hosts_have_their_own_name_shm_and_hosts_file(cluster):
    seg = f"/dev/shm/jaxodc_clustertest_{os.getpid()}"
    out = _py(cluster, 0, f"""
        import socket
        open({seg!r}, "w").write("x")
        print(socket.gethostname(), socket.gethostbyname("host1"), socket.gethostbyname("host0"))""")
    assert out.split() == ["host0", cluster.hosts[1].address, cluster.hosts[0].address]
    assert not os.path.exists(seg), "host 0's /dev/shm is the machine's"
    out = _py(cluster, 1, f"""
        import os, socket
        print(socket.gethostname(), os.path.exists({seg!r}))""")
    assert out.split() == ["host1", "False"]
    assert socket.gethostname() != "host0"


@needs_hosts
def test_route_address_per_host(cluster):
    """Each host's listeners take its own address (the route to host0's coordinator); host0 serves
    the coordinator on its own address, host1 (for whom host0 is another host) on every interface."""
    for i in (0, 1):
        out = _py(cluster, i, """
            from jaxodc.launch import address
            print(address.listen_address("host0:29500"), address.bind_address("host0"),
                  address.listen_address("127.0.0.1:29500"))""")
        assert out.split() == [cluster.hosts[i].address, "10.77.0.1" if i == 0 else "0.0.0.0", "127.0.0.1"]
    # A hostname the local /etc/hosts maps to loopback (Debian's 127.0.1.1): the route to the
    # coordinator is loopback, so the address routing to a rank of the other host is taken.
    out = _py(cluster, 0, """
        from jaxodc.launch import address
        print(address.refine("127.0.0.1", "host0", [{"host": "host0", "addr": "127.0.0.1"},
                                                    {"host": "host1", "addr": "10.77.0.2"}]))""")
    assert out.strip() == cluster.hosts[0].address


def _echo_server(c: Cluster, i: int, port: int) -> subprocess.Popen:
    code = f"""
        import socket
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", {port})); s.listen(8); print("ready", flush=True)
        while True:
            conn, _ = s.accept()
            while True:
                b = conn.recv(1 << 20)
                if not b:
                    break
            conn.sendall(b"done"); conn.close()"""
    p = c.popen(i, [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready", "echo server on host {i} did not start"
    return p


def _send(c: Cluster, i: int, to: str, port: int, nbytes: int, timeout: float = 20.0) -> float:
    """Seconds host i takes to push nbytes to to:port and hear back; -1.0 when connecting times out."""
    out = _py(c, i, f"""
        import socket, time
        t = time.perf_counter()
        try:
            s = socket.create_connection(({to!r}, {port}), timeout=2)
        except OSError:
            print(-1.0); raise SystemExit
        s.settimeout(15)
        s.sendall(b"x" * {nbytes}); s.shutdown(socket.SHUT_WR); s.recv(4)
        print(time.perf_counter() - t)""", timeout=timeout)
    return float(out)


@needs_hosts
def test_rate_partition_refuse_link_heal(cluster):
    srv = _echo_server(cluster, 1, 7000)
    try:
        assert _send(cluster, 0, "host1", 7000, 1 << 20) >= 0
        # Shaped to 40 Mbit/s: 4 MB take >= 0.8 s (5 MB/s); unshaped they take far less.
        cluster.set_rate(0.04)
        secs = _send(cluster, 0, "host1", 7000, 4 << 20)
        assert 0.7 <= secs <= 3.0, f"4 MB over a 40 Mbit/s link took {secs:.2f} s"
        cluster.set_rate(None)
        assert _send(cluster, 0, "host1", 7000, 4 << 20) < 0.7 * secs
        cluster.partition({0}, {1})
        assert _send(cluster, 0, "host1", 7000, 10) == -1.0
        cluster.heal()
        assert _send(cluster, 0, "host1", 7000, 10) >= 0
        cluster.refuse_connections(1)
        assert _send(cluster, 0, "host1", 7000, 10) == -1.0
        cluster.heal()
        cluster.link(1, up=False)
        assert _send(cluster, 0, "host1", 7000, 10) == -1.0
        cluster.link(1, up=True)
        assert _send(cluster, 0, "host1", 7000, 10) >= 0
    finally:
        srv.kill()
        srv.wait(10)


@needs_hosts
def test_random_loss(cluster):
    """Half of the datagrams arriving at host 1 vanish (binomial(600, 0.5) lies in 230..370 but
    for odds of 1e-8); none without loss."""
    code = """
        import socket, sys
        r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); r.bind(("0.0.0.0", 7001)); r.settimeout(1.0)
        print("ready", flush=True); n = 0
        try:
            while True:
                r.recv(64); n += 1
        except socket.timeout:
            print(n)"""
    for p, lo, hi in ((0.5, 230, 370), (0.0, 600, 600)):
        cluster.loss(1, p)
        rx = cluster.popen(1, [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
        try:
            assert rx.stdout.readline().strip() == "ready"
            _py(cluster, 0, """
                import socket, time
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                for _ in range(600):
                    s.sendto(b"x", ("host1", 7001)); time.sleep(0.0005)""")
            got = int(rx.communicate(timeout=15)[0].strip())
        finally:
            rx.kill()
            rx.wait(10)
        assert lo <= got <= hi, f"loss {p}: {got} of 600 datagrams arrived"
    cluster.loss(1, 0.0)


# -- cleanup ------------------------------------------------------------------------------------

@needs_hosts
def test_sigkilled_owner_is_swept_with_its_processes():
    """A process that made a cluster and started something on a host dies by SIGKILL: the next
    cluster started sweeps its namespaces, links, state and the process left on the host."""
    code = textwrap.dedent("""
        import subprocess, sys, time
        from jaxodc.launch.cluster import Cluster
        c = Cluster(2, name=sys.argv[1]).start()
        p = c.popen(1, ["sleep", "300"])
        print(p.pid, flush=True)
        time.sleep(300)""")
    name = f"t{os.getpid() % 10**6}"
    owner = subprocess.Popen([sys.executable, "-c", code, name], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        line = owner.stdout.readline()
        assert line.strip().isdigit(), f"the owner did not start its cluster: {line!r}"
        left_pid = int(line)
    finally:
        owner.kill()
        owner.wait(10)
    # nsenter exec'd sleep: the pid printed is the process on host 1
    assert os.path.exists(f"/proc/{left_pid}") and _leftovers(name), "nothing was left to sweep"
    assert name in sweep()
    assert _leftovers(name) == []
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{left_pid}") and open(f"/proc/{left_pid}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, f"pid {left_pid} on the swept host still runs"
        time.sleep(0.05)
    assert name not in _names_in_use()


# -- jobs on two hosts: the launcher's flags only ----------------------------------------------------

def _launch(c: Cluster, i: int, nnodes: int, extra: list[str], cwd: str, timeout: int) -> subprocess.Popen:
    return c.popen(i, [sys.executable, "-m", "jaxodc", "launch", "-n", "2", "--nnodes", str(nnodes),
                       "--node-rank", str(i), "--coordinator", "host0:29500", "--secret-file", "job.secret",
                       "--timeout", str(timeout), *extra], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                   stderr=subprocess.STDOUT, text=True)


def _probe_rows(outs: list[str]) -> dict[int, dict]:
    rows = {}
    for out in outs:
        for line in out.splitlines():
            m = re.match(r"\[rank \d\] (\{.*\})$", line)
            if m:
                row = json.loads(m.group(1))
                rows[row["rank"]] = row
    assert sorted(rows) == [0, 1, 2, 3], outs
    return rows


def _run_probe(c: Cluster, tmp_path, *args: str) -> dict[int, dict]:
    (tmp_path / "job.secret").write_bytes(os.urandom(32))
    procs = [_launch(c, i, 2, [PROBE, "20", *args], str(tmp_path), 120) for i in (0, 1)]
    outs = [p.communicate(timeout=150)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return _probe_rows(outs)


@needs_hosts
def test_two_hosts_listen_where_peers_reach_them(cluster, tmp_path):
    """2 hosts x 2 ranks, no environment variable: each rank advertises its host's address, ranks
    of one host use shm, of two hosts tcp (ODC and the lock-step collectives), and data moves.
    The host gather cache (on by default) fetches each remote piece once per host and version:
    a host's ranks together receive exactly its remote shards' bytes per version (2 versions),
    though each rank gathered every unit 3 times per version."""
    rows = _run_probe(cluster, tmp_path)
    for r, row in rows.items():
        h = r // 2
        assert row["host"] == f"host{h}" and row["addr"] == cluster.hosts[h].address
        want = ["self" if p == r else "shm" if p // 2 == h else "tcp" for p in range(4)]
        assert row["odc"] == want and row["lockstep"] == want
        assert row["gather_ok"] and row["allgather"] == [0, 0, 1, 1, 2, 2, 3, 3]
        assert row["host_cache"] and row["host_cache_bytes"] >= row["remote_shard_bytes"] > 0
    for h in (0, 1):
        ranks = [rows[2 * h], rows[2 * h + 1]]
        assert sum(r["wire_bytes"] for r in ranks) == 2 * ranks[0]["remote_shard_bytes"]
        assert sum(r["cache_hits"] for r in ranks) > 0


@needs_hosts
def test_without_host_cache_every_gather_crosses(cluster, tmp_path):
    """The same probe with the cache off: each of a host's 2 ranks fetches every remote piece at
    each of its 3 gathers per version: 12 times the host's remote shard bytes over 2 versions."""
    rows = _run_probe(cluster, tmp_path, "nocache")
    for h in (0, 1):
        ranks = [rows[2 * h], rows[2 * h + 1]]
        assert all(r["gather_ok"] and not r["host_cache"] and r["host_cache_bytes"] == 0 for r in ranks)
        assert sum(r["wire_bytes"] for r in ranks) == 12 * ranks[0]["remote_shard_bytes"]
        assert sum(r["cache_hits"] for r in ranks) == 0


@needs_hosts
def test_unreachable_peer_names_its_address_and_the_flag(cluster, tmp_path):
    """Host 1 drops new connections from host 0 (its ranks still reach host 0): host 0's ranks
    cannot connect to ranks 2 and 3 and say which address they tried and which flag sets it."""
    (tmp_path / "job.secret").write_bytes(os.urandom(32))
    cluster.refuse_connections(1)
    try:
        procs = [_launch(cluster, i, 2, [PROBE, "3"], str(tmp_path), 90) for i in (0, 1)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        cluster.heal()
    for d in set(re.findall(r"(/tmp/jaxodc_\w+_logs_\w+)/", "".join(outs))):
        shutil.rmtree(d, ignore_errors=True)  # a failed job's logs, kept by each launcher
    assert procs[0].returncode not in (0, 124), outs[0]
    line = [l for l in outs[0].splitlines() if l.startswith("jaxodc launch: rank")]
    assert line, outs[0]
    assert re.search(r"could not connect to rank [23].*10\.77\.0\.2:\d+.*--local-addr ADDR.*JAXODC_LOCAL_ADDR",
                     outs[0]), outs[0]
    assert procs[1].returncode != 0
