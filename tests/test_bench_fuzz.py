"""`jaxodc bench fuzz` on the native listeners (a bounded number of cases): every case against the
ODC tcp server, the lock-step tcp links and the ring endpoints of a running 2-rank job is rejected,
no listener dies, and the disturbed job's results are bit-identical to an undisturbed run's; the
generic cases against a Python listener, the coord dialect against a coordination service, and the
rule that tells a listener's crash from its rank's shutdown; the default run covers every listener
(the test of the native job passes --jobs native: the train jobs take minutes)."""
import json

from jaxodc import auth
from jaxodc.bench import fuzz, fuzz_cases


def test_native_listeners_reject_every_case_and_the_job_is_undisturbed(tmp_path, capsys):
    out = tmp_path / "fuzz.json"
    assert fuzz.main(["--jobs", "native", "--cases", "240", "--steps", "6", "--json", str(out)]) == 0
    recs = {r["listener"]: r for r in json.loads(out.read_text())}
    assert set(recs) == {"odc_tcp", "lockstep_tcp", "ring"}
    for name, r in recs.items():
        assert r["cases"] == 240, r  # 120 against each rank's listener
        assert r["rejected"] == r["cases"] and r["admitted"] == [], r
        assert r["crashes"] == 0, r
        assert r["same_params"] is True, r
    assert "rejected" in capsys.readouterr().out


def test_the_default_run_covers_every_listener():
    """Without --jobs both kinds of job run: the train jobs hold the Python listeners and coord."""
    from jaxodc import auth
    from jaxodc.bench import fuzz
    assert fuzz._args([]).jobs == "native,train"
    covered = {"odc_tcp", "lockstep_tcp", "ring"} | set().union(*(job[1] for job in fuzz.TRAIN_JOBS.values()))
    assert covered >= set(auth.LISTENERS) | {"coord"}, set(auth.LISTENERS) - covered


def test_every_case_kind_is_refused_by_a_python_listener_too():
    """The generic cases against jaxodc.auth's own server handshake (what the Python listeners run)."""
    import random
    import socket
    import threading

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    admitted = []

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                try:
                    admitted.append(auth.server_handshake(c, fuzz_cases.SECRET, "coord", "jz", 2, timeout_s=2))
                except (auth.AuthError, OSError):
                    pass

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    t = fuzz_cases.Target("coord", "127.0.0.1", port, "jz", 2, fuzz_cases.SECRET)
    stale = []
    for i, kind in enumerate(fuzz_cases.KINDS * 3):
        t.count(kind, bool(fuzz_cases.run_case(t, kind, random.Random(i), stale)))
    srv.close()
    assert t.cases == 3 * len(fuzz_cases.KINDS) and t.rejected == t.cases and not admitted, t.admitted


def test_every_coord_case_kind_is_refused_by_the_coordination_service():
    """The coord dialect's cases against a running service: none is welcomed or registered, each is
    counted as an authentication failure, and an honest peer still joins afterwards."""
    import random
    import socket
    import time

    from jaxodc.coord import protocol as P
    from jaxodc.coord.service import CoordinatorService

    svc = CoordinatorService("127.0.0.1", 0, fuzz_cases.SECRET, auth_timeout_s=2.0).start()
    try:
        host, port = P.parse_address(svc.address)
        assert fuzz._dialect(port) == "coord"
        assert fuzz._coord_secret(port, [b"not the secret", fuzz_cases.SECRET]) == fuzz_cases.SECRET
        t = fuzz_cases.Target("coord", host, port, "", 2, fuzz_cases.SECRET, dialect="coord")
        stale = []
        for i, kind in enumerate(fuzz_cases.COORD_KINDS * 3):
            t.count(kind, bool(fuzz_cases.run_coord_case(t, kind, random.Random(i), stale)))
        assert t.cases == 3 * len(fuzz_cases.COORD_KINDS) and t.rejected == t.cases and not t.admitted, t.admitted
        # every case, the dialect probe and the two secret probes failed authentication, none joined
        # (an idle case's end reaches the service after the case returns: wait for it)
        deadline = time.monotonic() + 10
        while svc.snapshot()["counters"]["auth_failures"] < t.cases + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        snap = svc.snapshot()
        assert snap["counters"]["joined"] == 0 and not snap["groups"], snap
        assert snap["counters"]["auth_failures"] == t.cases + 3, snap["counters"]
        assert t.alive()
        with socket.create_connection((host, port), timeout=5) as s:
            s.settimeout(5)
            w = P.client_handshake(s, fuzz_cases.SECRET, {"group": 0, "ring_addr": "127.0.0.1:1", "ss_addr": "127.0.0.1:2"})
            assert w["t"] == P.Msg.WELCOME and isinstance(w["peer_id"], int)
    finally:
        svc.stop()
    assert fuzz_cases.run_coord_case(t, "random", random.Random(0), []) is None  # nothing listens: not a case


def test_a_listener_counts_as_crashed_only_when_its_process_outlives_its_silence():
    """The crash rule of train jobs: a listener closed by its process's shutdown (the process ends
    within SHUTDOWN_S) is not a crash; one that stops answering while its process runs on is."""
    import subprocess
    import sys
    import time

    # A process that listens, answers the v2 challenge, then closes its listener and lives on
    # for `hold` s (hold 0: exits right after closing it, as a rank's shutdown does).
    code = ("import socket, sys, time, os\n"
            "from jaxodc import auth\n"
            "srv = socket.create_server(('127.0.0.1', 0)); srv.settimeout(0.1)\n"
            "print(srv.getsockname()[1], flush=True)\n"
            "end = time.monotonic() + 2.5\n"
            "while time.monotonic() < end:\n"
            "    try:\n"
            "        c, _ = srv.accept()\n"
            "    except OSError:\n"
            "        continue\n"
            "    c.sendall(auth.MAGIC + os.urandom(32)); c.close()\n"
            "srv.close(); time.sleep(float(sys.argv[1]))\n")
    verdicts = {}
    for hold in (0.0, fuzz.SHUTDOWN_S + 2):
        proc = subprocess.Popen([sys.executable, "-c", code, str(hold)], stdout=subprocess.PIPE, text=True)
        try:
            port = int(proc.stdout.readline())
            t = fuzz_cases.Target("odc_tcp", "127.0.0.1", port, "jz", 2, fuzz_cases.SECRET, pid=proc.pid)
            watch = fuzz.Watch([t], period=0.2)
            assert t.alive()
            if hold:  # no need to wait out the hold: the verdict is due once the silence is that old
                deadline = time.monotonic() + 20
                while t.silent_at is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                watch.close(t.silent_at + fuzz.SHUTDOWN_S + 1)
                assert proc.poll() is None  # still running when it was judged
            else:
                proc.wait(20)
                time.sleep(0.5)
                watch.close(time.monotonic())
            assert t.silent_at is not None, hold
            verdicts[hold] = fuzz.Watch.crashed(t)
        finally:
            proc.kill()
            proc.wait()
    assert verdicts == {0.0: False, fuzz.SHUTDOWN_S + 2: True}, verdicts
