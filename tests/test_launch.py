"""`jaxodc launch`, the process context (launcher env, SLURM, world of one), jax.distributed over
gloo across processes, and the run_ranks harness itself."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from harness import RankFailure, RankTimeout, run_ranks
from jaxodc.launch import context as dist
from jaxodc.launch.context import expand_nodelist, free_port, parse_tasks_per_node, settings_from_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(REPO, "tests", "support", "launch_probe.py")


@pytest.fixture(autouse=True)
def _logs_in_tmp_path(tmp_path, monkeypatch):
    """The launcher keeps a failed job's logs under $TMPDIR: keep them out of the real /tmp."""
    logs = tmp_path / "launcher_tmp"
    logs.mkdir()
    monkeypatch.setenv("TMPDIR", str(logs))


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def launch(*argv, timeout=60, env=None):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "jaxodc", "launch", *argv], cwd=REPO,
                       env=env or _env(), capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def _alive(pid: int) -> bool:
    """True unless the process is gone or a zombie (a zombie holds no resources but its entry)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _pids(piddir, world):
    out = []
    for r in range(world):
        with open(os.path.join(piddir, f"{r}.pid")) as f:
            out += [int(x) for x in f.read().split()]
    return out


def _assert_all_gone(pids):
    deadline = time.monotonic() + 5  # SIGKILLed grandchildren may take a moment to vanish
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [p for p in pids if _alive(p)]
    for p in survivors:  # don't leak them even when the assertion fails
        os.kill(p, signal.SIGKILL)
    assert not survivors, f"processes survived the teardown: {survivors}"


def _parse_rank_json(stdout, world):
    found = {}
    for line in stdout.splitlines():
        m = re.match(r"^\[rank (\d+)\] (\{.*\})$", line)
        if m:
            found[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(found) == list(range(world)), stdout
    return found


# -- launcher ------------------------------------------------------------------------------------

def test_three_ranks_see_their_environment(tmp_path):
    p, _ = launch("-n", "3", "--timeout", "40", PROBE, "env", str(tmp_path), "--flag", "x y")
    assert p.returncode == 0, p.stderr
    got = _parse_rank_json(p.stdout, 3)
    coord = got[0]["env"]["JAXODC_COORDINATOR"]
    job = got[0]["env"]["JAXODC_JOB_ID"]
    assert re.fullmatch(r"[A-Za-z0-9_]+", job)
    host, port = coord.rsplit(":", 1)
    for r in range(3):
        e = got[r]["env"]
        assert e["JAXODC_RANK"] == e["RANK"] == str(r)
        assert e["JAXODC_LOCAL_RANK"] == e["LOCAL_RANK"] == str(r)
        assert e["JAXODC_WORLD_SIZE"] == e["WORLD_SIZE"] == e["JAXODC_LOCAL_WORLD_SIZE"] == "3"
        assert e["JAXODC_COORDINATOR"] == coord and e["JAXODC_JOB_ID"] == job
        assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == (host, port)
        assert e["JAXODC_JAX_COORDINATOR"] != coord
        assert got[r]["argv"] == ["--flag", "x y"]
        # init_from_env inside the rank: rank 0 hosts the server, everyone reached it.
        assert got[r]["ctx"] == [r, 3, r, 3, job, coord, r == 0]
        assert got[r]["gathered"] == [0, 1, 2]
    _assert_all_gone(_pids(tmp_path, 3))


def test_failing_rank_tears_down_with_its_status(tmp_path):
    p, elapsed = launch("-n", "3", "--grace", "2", PROBE, "fail", str(tmp_path))
    assert p.returncode == 3, p.stderr
    assert elapsed < 15  # the others sleep 120 s: they were stopped, not waited for
    assert "[rank 1] last words of rank 1" in p.stderr  # forwarded live
    # then one line naming the rank, its last words and the log holding all its output
    m = re.search(r"rank 1 \(pid \d+\) exited with status 3: last words of rank 1 -- its full "
                  r"output is in (\S+); the other ranks were stopped\n$", p.stderr)
    assert m, p.stderr
    with open(m.group(1)) as f:
        assert sorted(f.read().splitlines()) == ["last words of rank 1", "rank 1 started"]  # both streams
    _assert_all_gone(_pids(tmp_path, 3))


def test_sigkilled_rank_gives_137(tmp_path):
    p, elapsed = launch("-n", "3", "--grace", "2", PROBE, "sigkill", str(tmp_path))
    assert p.returncode == 128 + 9, p.stderr
    assert elapsed < 15
    assert "rank 1" in p.stderr and "SIGKILL" in p.stderr
    assert "rank 1 about to die" in p.stderr
    _assert_all_gone(_pids(tmp_path, 3))


def test_timeout_kills_everything(tmp_path):
    p, elapsed = launch("-n", "2", "--timeout", "2", "--grace", "1", PROBE, "sleep", str(tmp_path))
    assert p.returncode == 124, p.stderr
    assert "timeout after 2 s" in p.stderr and "[0, 1]" in p.stderr
    assert elapsed < 12
    _assert_all_gone(_pids(tmp_path, 2))


def test_crash_leaves_no_shared_memory(tmp_path):
    other = "/dev/shm/jaxodc_someotherjob_unit0"  # another job's segment must survive
    with open(other, "wb") as f:
        f.write(b"keep")
    try:
        p, _ = launch("-n", "2", "--grace", "1", PROBE, "shm", str(tmp_path))
        assert p.returncode == 3, p.stderr
        m = re.search(r"removed 1 leftover shared-memory segment\(s\) of job (\w+)", p.stderr)
        assert m, p.stderr
        assert not os.path.exists(f"/dev/shm/jaxodc_{m.group(1)}_unit0")
        assert os.path.exists(other)
    finally:
        os.unlink(other)
    _assert_all_gone(_pids(tmp_path, 2))


def test_sigterm_to_launcher_is_forwarded(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "jaxodc", "launch", "-n", "2", "--grace", "2",
                             PROBE, "sleep", str(tmp_path)], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while len([n for n in os.listdir(tmp_path) if n.endswith(".pid")]) < 2:
            assert time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert time.monotonic() - t0 < 10
    assert "received SIGTERM" in err
    _assert_all_gone(_pids(tmp_path, 2))


def test_module_target_and_local_hosts(tmp_path):
    (tmp_path / "probe_mod.py").write_text(
        "import os, sys\nprint('mod', os.environ['RANK'], sys.argv[1:])\n")
    env = _env(PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    p, _ = launch("-n", "2", "--hosts", "localhost,127.0.0.1", "-m", "probe_mod", "a", "--b",
                  env=env)
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.splitlines()) == ["[rank 0] mod 0 ['a', '--b']",
                                             "[rank 1] mod 1 ['a', '--b']"]
    p, _ = launch("-n", "1", "--no-tag-output", "-m", "probe_mod", env=env)
    assert p.stdout == "mod 0 []\n"


def test_remote_hosts_are_refused_with_instructions():
    p, _ = launch("-n", "2", "--hosts", "localhost,node-that-is-not-here.invalid", PROBE)
    assert p.returncode == 2
    assert "node-that-is-not-here.invalid" in p.stderr
    assert "--node-rank" in p.stderr and "--nnodes" in p.stderr and "--coordinator" in p.stderr


def test_two_launchers_form_one_job(tmp_path):
    """Multi-host launch emulated on one machine: one launcher per 'node'."""
    coord = f"127.0.0.1:{free_port()}"
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32).hex().encode() + b"\n")
    common = ["-n", "1", "--nnodes", "2", "--coordinator", coord, "--timeout", "40",
              "--secret-file", str(secret)]
    procs = [subprocess.Popen([sys.executable, "-m", "jaxodc", "launch", *common, "--node-rank",
                               str(n), PROBE, "env", str(tmp_path)], cwd=REPO, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (1, 0)]  # node 1 first: its rank must wait for rank 0's server
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    got = {}
    for out, _ in outs:
        got.update(_parse_rank_json(out, 1) if "[rank 0]" in out else
                   {int(out.split("]")[0][6:]): json.loads(out.split("] ", 1)[1])})
    assert sorted(got) == [0, 1]
    for r in (0, 1):
        e = got[r]["env"]
        assert (e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"]) == (str(r), "2", "0")
        assert got[r]["ctx"][:4] == [r, 2, 0, 1] and got[r]["gathered"] == [0, 1]
    assert got[0]["ctx"][4] == got[1]["ctx"][4]  # same job id on both nodes
    assert got[0]["env"]["JAXODC_SECRET_FILE"] == str(secret) == got[1]["env"]["JAXODC_SECRET_FILE"]
    assert not got[0]["env"]["JAXODC_JOB_SECRET"]


def test_launchers_across_hosts_need_a_secret(tmp_path):
    p, _ = launch("-n", "1", "--nnodes", "2", "--node-rank", "0", "--coordinator",
                  "10.1.2.3:29500", PROBE, "env", str(tmp_path))
    assert p.returncode == 2
    assert "every host needs the same job secret" in p.stderr and "--secret-file" in p.stderr
    (tmp_path / "empty").write_bytes(b"  \n")
    p, _ = launch("-n", "1", "--secret-file", str(tmp_path / "empty"), PROBE, "env", str(tmp_path))
    assert p.returncode == 2 and "is empty" in p.stderr, p.stderr
    assert not list(tmp_path.glob("*.pid"))  # refused before any rank started


def test_each_job_gets_its_own_secret_through_the_environment(tmp_path):
    secrets = []
    for i in range(2):
        d = tmp_path / str(i)
        d.mkdir()
        p, _ = launch("-n", "2", PROBE, "env", str(d), timeout=90)
        assert p.returncode == 0, p.stderr
        got = _parse_rank_json(p.stdout, 2)
        secret = got[0]["env"]["JAXODC_JOB_SECRET"]
        assert re.fullmatch(r"[0-9a-f]{64}", secret) and got[1]["env"]["JAXODC_JOB_SECRET"] == secret
        assert all(secret not in a for a in got[0]["argv"])
        secrets.append(secret)
    assert secrets[0] != secrets[1]


def _job_processes(job_id: str) -> list[int]:
    """Live processes that carry the job in their environment (ranks and their children) or are
    its watchdog."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if (f"JAXODC_JOB_ID={job_id}\0".encode() in env or f"watchdog\0{job_id}".encode() in cmd) \
                and _alive(int(d)):
            found.append(int(d))
    return found


def _listening(port: int) -> bool:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                return True
    return False


def _assert_job_gone(job_id: str, port: int | None = None) -> None:
    deadline = time.monotonic() + 10
    while _job_processes(job_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _job_processes(job_id)
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"processes of job {job_id} survived: {left}"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"jaxodc_{job_id}_")]
    if port is not None:
        assert not _listening(port), f"port {port} still listening"


def _launcher(job_id, *argv, n=2):
    return subprocess.Popen([sys.executable, "-m", "jaxodc", "launch", "-n", str(n), "--grace", "2",
                             "--job-id", job_id, *argv], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _children(pid: int) -> set[int]:
    out = set()
    for t in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{t}/children") as f:
            out.update(int(x) for x in f.read().split())
    return out


def test_sigint_while_spawning_stops_at_once(tmp_path):
    job = "jsigint" + str(os.getpid())
    n = 24
    proc = _launcher(job, PROBE, "sleep", str(tmp_path), n=n)
    try:
        deadline = time.monotonic() + 30
        while len(_children(proc.pid)) < 2:  # the watchdog and a first rank
            assert time.monotonic() < deadline and proc.poll() is None, "no rank started"
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert time.monotonic() - t0 < 8
    m = re.search(r"received SIGINT; stopping the job \((\d+) running rank\(s\); their output is in "
                  r"(\S+)\)\n", err)
    assert m, err
    assert int(m.group(1)) < n, err  # it did not wait for the other spawns
    assert len(os.listdir(m.group(2))) < n  # one log per rank started
    assert err.count("\n") == 1, err  # one line: no rank's KeyboardInterrupt traceback
    assert "Traceback" not in out
    _assert_job_gone(job)


def test_sigkilled_launcher_takes_its_ranks_segments_and_ports_along(tmp_path):
    job = "jsigkill" + str(os.getpid())
    port = free_port()
    proc = _launcher(job, "--coordinator", f"127.0.0.1:{port}", PROBE, "hold", str(tmp_path), n=3)
    try:
        ready, deadline = 0, time.monotonic() + 60
        while ready < 3:
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, proc.stderr.read()
            ready += line.endswith("ready\n")
        assert _listening(port)
        assert len([n for n in os.listdir("/dev/shm") if n.startswith(f"jaxodc_{job}_")]) == 3
        assert len(_job_processes(job)) == 3 * 2 + 1  # ranks, their children, the watchdog
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _assert_job_gone(job, port)


PARENT = """
import os, subprocess, sys, time
from jaxodc.launch import launcher
child = subprocess.Popen(launcher._with_parent_death_signal([sys.executable, "-c", "import time; time.sleep(120)"],
                                                           os.getpid()), start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_rank_dies_with_its_parent_by_the_parent_death_signal():
    """The parent-death signal alone (no watchdog): the child of a SIGKILLed parent dies."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait()
        _assert_all_gone([child])
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


LAUNCH_AFTER_JAX = """
import jax.numpy as jnp
jnp.zeros(4).block_until_ready()  # jax's threads run in the launcher
from jaxodc.launch.launcher import launch_ranks
launch_ranks(2, "platform", [], timeout_s=60)
"""


def test_launching_after_jax_started_does_not_fork_it():
    """Ranks start without fork() in a process running jax's threads (no preexec_fn: subprocess
    runs no at-fork handlers), so jax's "os.fork() was called" warning never shows."""
    p = subprocess.run([sys.executable, "-c", LAUNCH_AFTER_JAX], env=_env(), cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("[rank ") == 2, p.stdout  # both ranks ran their command
    out = p.stdout + p.stderr
    assert "os.fork()" not in out and "RuntimeWarning" not in out, out


def test_absurd_rank_counts_are_refused_with_the_reason(tmp_path, monkeypatch):
    p, elapsed = launch("-n", "100000", PROBE, "sleep", str(tmp_path))
    assert p.returncode == 2
    cores = len(os.sched_getaffinity(0))
    assert f"-n 100000: more ranks than this machine can run: {cores} core(s)" in p.stderr
    assert not list(tmp_path.glob("*.pid")) and not os.listdir(tmp_path / "launcher_tmp")  # nothing started
    from jaxodc.launch import launcher
    monkeypatch.setattr(launcher, "_mem_available", lambda: 1 << 30)
    assert launcher.capacity_error(1) is None
    assert launcher.capacity_error(5) == ("-n 5: the ranks need at least 1.2 GiB (256 MiB each) but only 1.0 GiB of "
                                          "memory is available; at most 4 ranks fit. Use fewer ranks or more hosts")


def test_progress_updates_are_forwarded_before_the_newline(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "jaxodc", "launch", "-n", "1", PROBE, "progress",
                             str(tmp_path)], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        got, t_first = b"", None
        while not got.endswith(b"finished\n"):
            c = proc.stdout.read1(4096)
            if not c:
                break
            if t_first is None and b"step 0" in got + c:
                t_first = time.monotonic()
            got += c
        t_end = time.monotonic()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert got == b"[rank 0] plain line\n\r[rank 0] step 0\r[rank 0] step 1\r[rank 0] step 2\n[rank 0] finished\n"
    assert t_end - t_first > 1.5  # the first update arrived while the rank still ran, not at its newline


# -- environment parsing and SLURM ----------------------------------------------------------------

def test_nodelist_and_tasks_per_node_parsing():
    assert expand_nodelist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert expand_nodelist("a1,gpu[8-10]x,b") == ["a1", "gpu8x", "gpu9x", "gpu10x", "b"]
    assert expand_nodelist("r[1-2]n[3,5]") == ["r1n3", "r1n5", "r2n3", "r2n5"]
    assert expand_nodelist("solo") == ["solo"]
    with pytest.raises(ValueError, match="unbalanced"):
        expand_nodelist("node[01-03")
    assert parse_tasks_per_node("4(x2),3") == [4, 4, 3]
    assert parse_tasks_per_node("2") == [2]


def test_settings_from_slurm_and_launcher_env():
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
             "SLURM_JOB_ID": "777", "SLURM_STEP_ID": "2", "SLURM_STEP_NODELIST": "gpu[03-06]",
             "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
    s = settings_from_env(slurm)
    assert (s.rank, s.world, s.local_rank, s.local_world, s.source) == (5, 8, 1, 4, "slurm")
    assert s.coordinator == f"gpu03:{dist.DEFAULT_PORT}"
    assert s.jax_coordinator == f"gpu03:{dist.DEFAULT_PORT + 1}"
    assert s.job_id == "slurm_777_2"
    assert settings_from_env({**slurm, "JAXODC_PORT": "4000"}).coordinator == "gpu03:4000"
    # The launcher's variables win over SLURM's.
    s = settings_from_env({**slurm, "JAXODC_RANK": "1", "JAXODC_WORLD_SIZE": "2",
                           "JAXODC_COORDINATOR": "h:1", "JAXODC_JOB_ID": "abc"})
    assert (s.rank, s.world, s.coordinator, s.job_id, s.source) == (1, 2, "h:1", "abc", "jaxodc")
    with pytest.raises(ValueError, match="rank 8 is outside world size 8"):
        settings_from_env({**slurm, "SLURM_PROCID": "8"})
    with pytest.raises(ValueError, match="SLURM_NTASKS='x' is not an integer"):
        settings_from_env({**slurm, "SLURM_NTASKS": "x"})
    with pytest.raises(ValueError, match="missing JAXODC_COORDINATOR"):
        settings_from_env({"JAXODC_RANK": "0", "JAXODC_WORLD_SIZE": "1", "JAXODC_JOB_ID": "a"})
    assert settings_from_env({}).source == "single"


def test_slurm_job_secret_from_its_environment(tmp_path, monkeypatch):
    """Under SLURM the job's environment carries the secret (a file every node reads); without
    one rank 0 refuses to open the rendezvous to the network, saying what to do."""
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "9",
             "SLURM_STEP_NODELIST": "node-x[1-2]", "JAXODC_PORT": str(free_port())}
    secret = tmp_path / "job.secret"
    secret.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    assert settings_from_env({**slurm, "JAXODC_SECRET_FILE": str(secret)}).secret == b"0123456789abcdef" * 2
    for k in list(os.environ):
        if k.startswith(("JAXODC_", "SLURM_")):
            monkeypatch.delenv(k)
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RuntimeError, match=r"rank 0 could not start the rendezvous server at node-x1:\d+: "
                                           r"rendezvous server: refusing to listen on 0.0.0.0 without a secret"):
        dist.init_from_env(timeout_s=2)


_SLURM_RANK = """
import json
from jaxodc.launch.context import init_from_env, shutdown
ctx = init_from_env(timeout_s=20)
got = ctx.rendezvous.allgather("x", str(ctx.rank).encode(), ctx.world)
print(json.dumps([ctx.rank, ctx.world, ctx.local_rank, ctx.job_id, ctx.coordinator,
                  [int(g) for g in got]]))
shutdown(ctx)
"""


def test_slurm_processes_rendezvous():
    port = free_port()
    base = {k: v for k, v in _env().items() if not k.startswith("JAXODC_")}
    procs = []
    for r in range(2):
        env = {**base, "SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
               "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost",
               "SLURM_STEP_TASKS_PER_NODE": "2", "JAXODC_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", _SLURM_RANK], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=40)
        assert p.returncode == 0, err
        assert json.loads(out) == [r, 2, r, "slurm_4242_0", f"localhost:{port}", [0, 1]]


def test_world_of_one_without_environment(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("JAXODC_", "SLURM_")):
            monkeypatch.delenv(k)
    ctx = dist.init_from_env(timeout_s=5)
    try:
        assert (ctx.rank, ctx.world, ctx.server is not None) == (0, 1, True)
        assert ctx.allgather("solo", b"me") == [b"me"]
    finally:
        dist.shutdown(ctx)


# -- harness and jax.distributed ------------------------------------------------------------------

def _psum_body(ctx, n):
    dist.init_jax_distributed(ctx)
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    assert jax.process_count() == ctx.world and jax.process_index() == ctx.rank
    mesh = Mesh(np.array(jax.devices()), ("x",))
    local = np.random.default_rng(ctx.rank).standard_normal(n).astype(np.float32)
    arr = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
    f = jax.jit(jax.shard_map(
        lambda a: (jax.lax.psum(a, "x"), jax.lax.all_gather(a, "x", tiled=True)),
        mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x"))))
    summed, gathered = f(arr)
    (s,) = [np.asarray(x.data) for x in summed.addressable_shards]
    (g,) = [np.asarray(x.data) for x in gathered.addressable_shards]
    binds = _listen_addresses(int(ctx.jax_coordinator.rsplit(":", 1)[1])) if ctx.rank == 0 else None
    return local, s, g, binds


def _listen_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* shows them) listening on `port`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    out.add(local.rsplit(":", 1)[0])
    return out


def test_jax_distributed_gloo_psum_two_processes():
    n = 37
    res = run_ranks(_psum_body, 2, args=(n,), timeout_s=90)
    locals_ = [r[0] for r in res]
    # jax's coordinator listens on loopback only (127.0.0.1), not on every interface
    assert res[0][3] and res[0][3] <= {"0100007F", "0000000000000000FFFF00000100007F"}, res[0][3]  # or ::ffff:
    for rank, (local, s, g, _) in enumerate(res):
        assert np.array_equal(local, np.random.default_rng(rank).standard_normal(n)
                              .astype(np.float32))
        np.testing.assert_allclose(s, locals_[0] + locals_[1], rtol=1e-6, atol=1e-6)
        assert np.array_equal(g, np.concatenate(locals_))


def _raise_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError(f"boom on rank {ctx.rank}")
    ctx.barrier("never-complete", timeout_s=60)  # stuck until the harness kills it


def _hang_on_rank_2(ctx):
    if ctx.rank == 2:
        time.sleep(120)
    return ctx.rank


def _make_shm(ctx):
    path = f"/dev/shm/{dist.shm_prefix(ctx.job_id)}seg{ctx.rank}"
    with open(path, "wb") as f:
        f.write(b"z")
    return path


def test_harness_reports_the_raising_rank():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as ei:
        run_ranks(_raise_on_rank_1, 3, timeout_s=60)
    assert time.monotonic() - t0 < 20
    msg = str(ei.value)
    assert "ranks [1] of 3 failed" in msg
    assert "ValueError: boom on rank 1" in msg and "_raise_on_rank_1" in msg


def test_harness_timeout_names_unfinished_ranks():
    t0 = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[2\] of 3 did not finish within 3 s"):
        run_ranks(_hang_on_rank_2, 3, timeout_s=3)
    assert time.monotonic() - t0 < 10


def test_harness_removes_job_shared_memory():
    paths = run_ranks(_make_shm, 2, timeout_s=30)
    assert len(set(paths)) == 2
    assert not any(os.path.exists(p) for p in paths)


def test_rank_env_keeps_the_callers_xla_flags():
    """The ranks' XLA_FLAGS are the launcher's plus the caller's; a flag both set is the caller's."""
    from jaxodc.launch.launcher import RANK_ENV, rank_env_defaults
    assert rank_env_defaults({})["XLA_FLAGS"] == RANK_ENV["XLA_FLAGS"]
    env = rank_env_defaults({"XLA_FLAGS": "--xla_cpu_use_onednn=true --xla_cpu_multi_thread_eigen=true"})
    assert env["XLA_FLAGS"].split() == ["--xla_cpu_use_onednn=true", "--xla_cpu_multi_thread_eigen=true"]
    env = rank_env_defaults({"XLA_FLAGS": "--xla_dump_to=/tmp/x"})
    assert env["XLA_FLAGS"].split() == RANK_ENV["XLA_FLAGS"].split() + ["--xla_dump_to=/tmp/x"]
    assert env["JAX_PLATFORMS"] == "cpu" and env["OMP_NUM_THREADS"] == "1"
