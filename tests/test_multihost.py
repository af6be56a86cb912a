"""Training across 2 emulated hosts x 2 ranks with the launcher's documented multi-host form and no
environment variable (jaxodc.launch.cluster): the README's commands end rc 0 on both hosts, pairs
on one host use shm and across hosts tcp, and with the reproducible sum every mode ends with the
bits of the same job on one host; DiLoCo with one site per host (docs/sites.md's commands) equals
the single-process simulation."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from emulated_hosts import needs_hosts
from jaxodc.launch.cluster import Cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slow, needs_hosts]


def _env() -> dict:
    from jaxodc.launch.launcher import rank_env_defaults
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXODC_")}
    # `python` in the README's commands: this interpreter
    path = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return {**env, **rank_env_defaults(env), "PYTHONPATH": ROOT, "PATH": path}


def readme_commands() -> list[str]:
    """The command lines of README.md's "Several hosts" block."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Several hosts"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [l.strip() for l in block.splitlines() if l.strip()]


def _host_runs(lines: list[str]) -> dict[int, list[str]]:
    """{host: argv} of the block's `python -m jaxodc cluster exec demo I -- ...` lines."""
    runs = {}
    for line in lines:
        argv = shlex.split(line.rstrip("&").strip())
        if argv[:5] == ["python", "-m", "jaxodc", "cluster", "exec"]:
            assert argv[5] == "demo" and argv[7] == "--", line
            runs[int(argv[6])] = argv[8:]
    return runs


def _on_hosts(c: Cluster | str, runs: dict[int, list[str]], cwd: str, timeout: float) -> dict[int, tuple[int, str]]:
    """Runs argv on host i for each {i: argv} at once: through the Cluster, or, given a cluster's
    name, as the README does (`python -m jaxodc cluster exec NAME I -- argv`)."""
    def start(i, argv):
        cmd = ([sys.executable, "-m", "jaxodc", "cluster", "exec", c, str(i), "--", *argv] if isinstance(c, str)
               else c.command(i, argv, cwd))
        return subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs = {i: start(i, argv) for i, argv in runs.items()}
    out = {}
    for i, p in procs.items():
        try:
            text = p.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            text = p.communicate()[0]
            raise AssertionError(f"host {i}: `{' '.join(runs[i])}` still ran after {timeout:.0f} s:\n{text[-3000:]}")
        out[i] = (p.returncode, text)
    return out


def _transports(text: str) -> dict[str, dict[int, list[str]]]:
    """{run: {rank: transports}} from `jaxodc train`'s transports lines."""
    found = {}
    for m in re.finditer(r"^(?:\[rank 0\] )?\s*(\S+) \+ (\S+)\s+transports \(rank: to rank 0\.\.\d+\): (.*)$", text, re.M):
        found[f"{m.group(1)} + {m.group(2)}"] = {int(k): v.split() for k, v in
                                               (part.split(": ") for part in m.group(3).split("; "))}
    return found


def _final_losses(text: str) -> dict[str, str]:
    """{mode: final loss as printed} from `jaxodc train`'s summary table."""
    return {m.group(1): m.group(2) for m in
            re.finditer(r"^(?:\[rank 0\] )?(\w+ \+ [\w-]+)\s+(\d+\.\d{4})\s+\d", text, re.M)}


def test_readme_commands_on_two_hosts(tmp_path):
    """The README's block, line by line: `cluster up` and `down` as written, each `cluster exec`
    line on its host through `cluster exec` (the `&` one alongside), the secret as the block makes
    it. Both hosts end rc 0, rank 0 reports all 6 minibatches and the summary; ranks 0,1 | 2,3 use
    shm inside a host and tcp across. (The equality with one host: test_same_bits_as_one_host.)"""
    lines = readme_commands()
    up = shlex.split(lines[0])
    assert up[:6] == ["python", "-m", "jaxodc", "cluster", "up", "demo"], lines[0]
    assert lines[1] == "head -c 32 /dev/urandom > job.secret" and lines[-1] == "python -m jaxodc cluster down demo"
    (tmp_path / "job.secret").write_bytes(os.urandom(32))
    runs = _host_runs(lines)
    assert sorted(runs) == [0, 1]
    name = f"r{os.getpid() % 10**6}"  # the block's cluster, named apart from anyone's `demo`
    subprocess.run([sys.executable, *up[1:5], name, *up[6:]], check=True, env=_env(), timeout=60,
                   capture_output=True)
    try:
        got = _on_hosts(name, runs, str(tmp_path), timeout=280)
    finally:
        down = shlex.split(lines[-1])
        subprocess.run([sys.executable, *down[1:5], name], env=_env(), timeout=60)
    assert [got[i][0] for i in (0, 1)] == [0, 0], f"host 0:\n{got[0][1][-3000:]}\nhost 1:\n{got[1][1][-3000:]}"
    links = _transports(got[0][1])["odc + lb_mini"]
    assert links == {r: ["self" if p == r else "shm" if p // 2 == r // 2 else "tcp" for p in range(4)]
                     for r in range(4)}
    assert re.search(r"minibatch 5: loss \d", got[0][1]) and _final_losses(got[0][1])
    assert _leftovers_of(name) == []


def _leftovers_of(name: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if l.startswith(f"jxc{name}h")] + (
        [name] if os.path.exists(f"/run/jaxodc-cluster/{name}") else [])


TRAIN = ["-m", "jaxodc.cli.train", "--steps", "2", "--d-model", "32", "--layers", "1", "--reproducible"]
BASE = ["python", "-m", "jaxodc", "launch", "-n", "2", "--nnodes", "2", "--coordinator", "host0:29500",
        "--secret-file", "job.secret", "--timeout", "380"]


def _two_hosts(c: Cluster, tmp_path, args: list[str], json_name: str) -> dict:
    got = _on_hosts(c, {i: BASE + ["--node-rank", str(i)] + TRAIN + args + ["--json", json_name] for i in (0, 1)},
                    str(tmp_path), timeout=400)
    assert [got[i][0] for i in (0, 1)] == [0, 0], f"host 0:\n{got[0][1][-3000:]}\nhost 1:\n{got[1][1][-3000:]}"
    return json.loads((tmp_path / json_name).read_text())


@pytest.mark.timeout(900)
def test_same_bits_as_one_host(tmp_path):
    """odc + LB-Mini, odc + LB-Steal (host gather cache on, the default) and the collective (gloo)
    in one job across 2 hosts, with the reproducible sum: each run's params_sha256 and losses equal
    those of the same job on one host (4 ranks of one launcher, every pair on shared memory)."""
    (tmp_path / "job.secret").write_bytes(os.urandom(32))
    runs = ["--comm", "odc,odc,collective", "--balance", "lb_mini,lb_steal,lb_micro"]
    with Cluster(2, gbps=1.0) as c:
        multi = _two_hosts(c, tmp_path, runs, "hosts.json")
    one = subprocess.run([sys.executable, "-m", "jaxodc", "launch", "-n", "4", "--timeout", "380", *TRAIN, *runs,
                          "--json", "one.json"], cwd=str(tmp_path), env=_env(), capture_output=True, text=True,
                         timeout=400)
    assert one.returncode == 0, one.stderr[-3000:]
    single = json.loads((tmp_path / "one.json").read_text())
    assert sorted(multi) == sorted(single) == ["collective + lb_micro", "odc + lb_mini", "odc + lb_steal"]
    for run in multi:
        digests = {r["params_sha256"] for r in multi[run]}
        assert len(digests) == 1 and digests == {r["params_sha256"] for r in single[run]}, run
        assert [r["loss"] for r in multi[run] if r["rank"] == 0] == [r["loss"] for r in single[run] if r["rank"] == 0]
        cross = "gloo" if run.startswith("collective") else "tcp"
        for r in multi[run]:
            want = ["self" if p == r["rank"] else "shm" if p // 2 == r["rank"] // 2 and cross == "tcp" else cross
                    for p in range(4)]
            assert r["transports"] == want, (run, r["rank"], r["transports"])
    assert all(t in ("self", "shm") for r in single["odc + lb_mini"] for t in r["transports"])


@pytest.mark.timeout(900)
def test_host_cache_same_bits_fewer_bytes(tmp_path):
    """odc + LB-Mini across 2 hosts with the host gather cache and without: bit-identical parameters
    (reproducible sum), and with the cache a host's ranks receive fewer gathered bytes than
    without (exactly once per version: tests/test_cluster.py)."""
    (tmp_path / "job.secret").write_bytes(os.urandom(32))
    runs = ["--comm", "odc", "--balance", "lb_mini"]
    with Cluster(2, gbps=1.0) as c:
        cached = _two_hosts(c, tmp_path, runs + ["--host-cache"], "cache.json")["odc + lb_mini"]
        plain = _two_hosts(c, tmp_path, runs + ["--no-host-cache"], "nocache.json")["odc + lb_mini"]
    assert len({r["params_sha256"] for r in cached + plain}) == 1
    for h in (0, 1):
        with_cache = sum(r["gather_wire_bytes"] for r in cached if r["rank"] // 2 == h)
        without = sum(r["gather_wire_bytes"] for r in plain if r["rank"] // 2 == h)
        assert 0 < with_cache < without, (h, with_cache, without)


@pytest.mark.timeout(900)
def test_diloco_sites_one_per_host(tmp_path):
    """DiLoCo (H = 2) across 2 sites, one per host (2 ranks each), with docs/sites.md's "Across
    real hosts" commands: `jaxodc master` on host 0, each site's `jaxodc launch ... --coord
    host0:P --site S`. Both hosts end rc 0, every site ends with the same bits, and every element
    of the trained shards equals the single-process simulation (as tests/test_sites.py checks the
    same job on one host)."""
    import sites_reference as R
    (tmp_path / "job.secret").write_bytes(os.urandom(32))
    port = 48148
    master = ["python", "-m", "jaxodc", "master", "--host", "0.0.0.0", "--port", str(port),
              "--secret-file", "job.secret"]
    train = ["--groups", "2", "--diloco", "2", "--steps", "6", *R.SMALL]
    site = ["python", "-m", "jaxodc", "launch", "-n", "2", "--timeout", "380", "-m", "jaxodc.cli.train", *train,
            "--coord", f"host0:{port}", "--secret-file", "job.secret", "--json", "run"]
    with Cluster(2, gbps=1.0) as c:
        svc = subprocess.Popen(c.command(0, master, str(tmp_path)), cwd=str(tmp_path), env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            first = svc.stdout.readline()
            assert "listening on" in first, first + (svc.stdout.read() if svc.poll() is not None else "")
            got = _on_hosts(c, {i: site + ["--site", str(i)] for i in (0, 1)}, str(tmp_path), timeout=400)
        finally:
            svc.terminate()
            svc.communicate(timeout=30)
    assert [got[i][0] for i in (0, 1)] == [0, 0], f"host 0:\n{got[0][1][-3000:]}\nhost 1:\n{got[1][1][-3000:]}"
    sites = [json.loads((tmp_path / f"run.site{s}.json").read_text()) for s in (0, 1)]
    R.same_on_every_site(sites)
    args = R.cli_args(train)
    R.check_shards(sites, args, R.diloco(args, False), atol=5e-5)
    recs = [r for s in sites for r in s["records"]]
    assert sorted({r["outer_step"] for r in recs}) == [0, 1, 2] and all(r["sites"] == 2 for r in recs)
