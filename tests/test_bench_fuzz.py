"""`jaxodc bench fuzz` on the native listeners (a bounded number of cases): every case against the
ODC tcp server, the lock-step tcp links and the ring endpoints of a running 2-rank job is rejected,
no listener dies, and the disturbed job's results are bit-identical to an undisturbed run's."""
import json

from jaxodc import auth
from jaxodc.bench import fuzz


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
                    admitted.append(auth.server_handshake(c, fuzz.SECRET, "coord", "jz", 2, timeout_s=2))
                except (auth.AuthError, OSError):
                    pass

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    t = fuzz.Target("coord", "127.0.0.1", port, "jz", 2, fuzz.SECRET)
    stale = []
    for i, kind in enumerate(fuzz.KINDS * 3):
        t.count(kind, bool(fuzz.run_case(t, kind, random.Random(i), stale)))
    srv.close()
    assert t.cases == 3 * len(fuzz.KINDS) and t.rejected == t.cases and not admitted, t.admitted
