"""Network faults under real DiLoCo sites (`jaxodc train --groups`), one site per emulated host:
the issue's scenarios 1 and 2 (bench/faults.py runs the others, and these two under the
communicator's own loop).

Host 0 runs `jaxodc master`; hosts 1..G run one site each with docs/sites.md's "Across real hosts"
commands (`jaxodc launch -n W -m jaxodc.cli.train --groups G --diloco H --coord host0:P --site S`),
plus `--heartbeat-timeout` (the master's) and `--rejoin` (a site that lost the service registers
again). When the last site announces an outer exchange, the fault starts:

  sites-partition  that site's link goes down for `down` s
  sites-master     that site cannot reach the master for `down` s; it still reaches the other sites

and `sites-loss` (scenario 3's DiLoCo half) runs the same job twice on 100 Mbit/s links, without
and with 1% random loss on every host's link for the whole run: `params_equal` compares the
sites' final shards across the two runs (`SitesRun.loss_record`).

Checked from the sites' records (--json): every site ends rc 0 with the same final shards; the
survivors' outer steps are 0, 1, ..., total-1, each once (none lost, none applied twice), with the
same shared-state hash at each step on every site that took part; the faulted site was voted in
again and fetched the shared state. Detection: the master's log line that removed the site, after
the fault began.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.faults import PORT, finish, leftovers_on_hosts, tear_down  # noqa: E402

SCENARIOS = ("sites-partition", "sites-master", "sites-loss")
# a small job (docs/sites.md's flags; tests/support/sites_reference.py's model)
TRAIN = ["--minibatch", "2", "--max-tokens", "96", "--d-model", "32", "--layers", "1", "--heads", "2",
         "--clip", "0", "--lr", "3e-3", "--outer-lr", "1", "--outer-momentum", "0"]
LOST = "lost the coordination service"
STALE = "rejoins at the next outer step"  # the site's record of an outer step the others took without it
PARAM_BYTES = 110_000  # TRAIN's model in fp32 is 115.7 kB: what a site sends per outer step in a ring of 2
TBF_BURST = 64 << 10   # jaxodc.launch.cluster's tbf burst at these rates


class SitesRun:
    def __init__(self, scenario: str, sites: int = 3, ranks: int = 1, inner: int = 2, steps: int | None = None,
                 hb_timeout: float = 3.0, down_s: float = 8.0, gbps: float | None = 1.0, slow_mbps: float = 0.5,
                 workdir: str | None = None, loss: float = 0.0):
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}; choose from {SCENARIOS}")
        if sites < 3:
            raise ValueError("the survivors of a fault need a ring of 2 sites or more: sites >= 3")
        self.scenario, self.g, self.w, self.h = scenario, sites, ranks, inner
        self.hb, self.down_s, self.gbps, self.slow_mbps, self.loss = hb_timeout, down_s, gbps, slow_mbps, loss
        self.dir = workdir or tempfile.mkdtemp(prefix=f"jaxodc-{scenario}-")
        self.faulty = sites  # host index of the faulted site (sites on hosts 1..G, site ids 0..G-1)
        self.master_log: list[tuple[float, str]] = []
        if steps is None and scenario == "sites-loss":
            steps = inner * 6
        if steps is None:
            # The job must outlast the fault and the rejoin (the site gives the master up after
            # hb, retries its connection every hb at most, +6 s), yet not run long after it. So
            # until the site is back the survivors' links run at slow_mbps: an outer step then
            # sends at least PARAM_BYTES per site (ring all-reduce), beyond tbf's burst, at that
            # rate; 4 outer steps remain after the rejoin.
            floor_s = (PARAM_BYTES - TBF_BURST) * 8 / (slow_mbps * 1e6)
            steps = inner * (2 + int((down_s + 2 * hb_timeout + 6) / floor_s) + 4)
        self.steps = steps
        self.dir = workdir or tempfile.mkdtemp(prefix=f"jaxodc-{scenario}-")
        self.faulty = sites  # host index of the faulted site (sites on hosts 1..G, site ids 0..G-1)
        self.master_log: list[tuple[float, str]] = []

    def _site_argv(self, s: int, secret: str) -> list[str]:
        return [sys.executable, "-m", "jaxodc", "launch", "-n", str(self.w), "--timeout", "900",
                "-m", "jaxodc.cli.train", "--groups", str(self.g), "--ranks", str(self.w), "--diloco", str(self.h),
                "--steps", str(self.steps), *TRAIN, "--coord", f"host0:{PORT}", "--site", str(s),
                "--secret-file", secret, "--json", os.path.join(self.dir, "run"), "--trace-sites",
                "--heartbeat-timeout", str(self.hb), "--rejoin", "600"]

    def _tail(self, stream) -> None:
        for line in stream:
            self.master_log.append((time.time(), line.rstrip()))

    def run(self) -> dict:
        from jaxodc.launch.cluster import Cluster
        secret = os.path.join(self.dir, "job.secret")
        with open(secret, "w") as f:
            f.write(os.urandom(32).hex())
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAXODC_")}
        env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
                   JAX_COMPILATION_CACHE_DIR=os.path.join(self.dir, "jax-cache"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        rec = {"scenario": self.scenario, "sites": self.g, "ranks": self.w, "H": self.h, "slow_mbps": self.slow_mbps,
               "heartbeat_timeout_s": self.hb, "down_s": self.down_s, "link_gbps": self.gbps}
        t_start = time.monotonic()
        c = Cluster(self.g + 1, gbps=self.gbps).start()
        procs: dict[int, subprocess.Popen] = {}
        master = None
        try:
            for h in range(self.g + 1) if self.loss else ():
                c.loss(h, self.loss)
            master = c.popen(0, [sys.executable, "-m", "jaxodc", "master", "--host", "0.0.0.0", "--port", str(PORT),
                                 "--secret-file", secret, "--heartbeat-timeout", str(self.hb)],
                             cwd=self.dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            first = master.stdout.readline()
            if "listening" not in first:
                raise RuntimeError(f"jaxodc master did not start: {first}")
            threading.Thread(target=self._tail, args=(master.stdout,), daemon=True).start()
            outs = {}
            for s in range(self.g):
                outs[s] = os.path.join(self.dir, f"site{s}.out")
                with open(outs[s], "w") as f:
                    procs[s] = c.popen(s + 1, self._site_argv(s, secret), cwd=self.dir, env=env, stdout=f,
                                       stderr=subprocess.STDOUT)
            fs = self.g - 1
            t_fault = self._fault(c, fs, outs, procs) if self.scenario != "sites-loss" else time.time()
            rec["rc"] = finish(procs, master, time.monotonic() + 600)
            rec["leftovers"], rec["closing_sockets"] = leftovers_on_hosts(c)
            rec.update(self.analyse(t_fault, outs))
        finally:
            tear_down(c, [*procs.values(), master], rec, t_start)
        return rec

    def _fault(self, c, fs: int, outs: dict, procs: dict) -> float:
        """Starts the fault as the faulted site begins an outer exchange (after 2 outer steps),
        ends it after `down_s`, and keeps the survivors slow until the site is back (bounded).
        Returns when the fault began."""
        pat = re.compile(rf"site {fs} outer step (\d+): exchange")
        deadline = time.monotonic() + 600
        while True:
            m = [int(x) for x in pat.findall(open(outs[fs]).read())]
            if m and max(m) >= 2:
                break
            bad = {s: p.returncode for s, p in procs.items() if p.poll() is not None}
            if bad or time.monotonic() > deadline:
                raise RuntimeError(f"sites ended ({bad}) or no exchange within 600 s: "
                                   f"{open(outs[fs]).read()[-2000:]}")
            time.sleep(0.02)
        t_fault = time.time()
        survivors = list(range(1, self.faulty))
        if self.scenario == "sites-partition":
            c.link(self.faulty, False)
        else:
            c.partition({0}, {self.faulty})
        c.set_rate(self.slow_mbps / 1e3, hosts=survivors)
        time.sleep(self.down_s)
        if self.scenario == "sites-partition":
            c.link(self.faulty, True)
        else:
            c.heal()
        # the survivors stay slow until the site is back (bounded), so the job outlasts it
        mark, deadline = len(open(outs[fs]).read()), time.monotonic() + 4 * self.hb + 60
        while "joined:" not in open(outs[fs]).read()[mark:] and time.monotonic() < deadline:
            time.sleep(0.05)
        c.set_rate(self.gbps, hosts=survivors)
        return t_fault

    def analyse(self, t_fault: float, outs: dict) -> dict:
        from jaxodc.cli.sites import read_records
        failures = []
        fs = self.g - 1
        run = os.path.join(self.dir, "run")
        finals = {}
        for s in range(self.g):
            try:
                with open(run + f".site{s}.json") as f:
                    finals[s] = json.load(f)["shards"]
            except (OSError, ValueError) as e:
                failures.append(f"site {s}: no final record ({e}): {open(outs[s]).read()[-1500:]}")
        recs = {s: [r for r in read_records(run, s) if r["rank"] == 0] for s in range(self.g)}
        total = -(-self.steps // self.h)
        lost = 0
        for s, rs in recs.items():
            ks = [r["outer_step"] for r in rs]
            if len(set(ks)) != len(ks) or ks != sorted(ks):
                failures.append(f"site {s}: outer steps {ks} repeat or go back")
            if s != fs:
                lost += len(set(range(total)) - set(ks))
        hashes: dict[int, dict[int, int]] = {}
        for s, rs in recs.items():
            for r in rs:
                if not any(STALE in e for e in r["events"]):
                    hashes.setdefault(r["outer_step"], {})[s] = r["state_hash"]
        for k, by_site in sorted(hashes.items()):
            if len(set(by_site.values())) > 1:
                failures.append(f"outer step {k}: shared-state hashes differ across sites {by_site}")
        events = [e for r in recs[fs] for e in r["events"]]
        rejoined = any(e.startswith("joined") for e in events) and any(LOST in e for e in events)
        fetched = any("state fetched" in e for e in events)
        equal = len(finals) == self.g and all(finals[s] == finals[0] for s in finals)
        removed = [t for t, line in self.master_log if "removed peer" in line and t >= t_fault]
        worlds = [r["sites"] for s, rs in recs.items() if s != fs for r in rs]
        return {
            "final_shards": finals.get(0),
            "detected_s": round(min(removed) - t_fault, 2) if removed and self.scenario != "sites-loss" else None,
            # under loss nothing is cut off: every site ends with its record
            "recovered": (rejoined and fetched or self.scenario == "sites-loss") and len(finals) == self.g,
            "params_equal": equal and not failures,
            "lost_steps": lost,
            "outer_steps": total,
            "min_sites": min(worlds) if worlds else 0,
            "faulty_events": events[:8],
            "failures": failures[:20],
        }


def loss_record(hb_timeout: float, loss: float = 0.01, gbps: float = 0.1, workdir: str | None = None) -> dict:
    """Scenario 3's DiLoCo half: the same job (same seed) without and with `loss` on every host's
    link at `gbps`; the lossy run's record, with `params_equal` comparing the final shards of the
    two runs and both runs' wall times."""
    with tempfile.TemporaryDirectory(prefix="jaxodc-sites-loss-", dir=workdir) as tmp:
        for sub in ("clean", "lossy"):
            os.makedirs(os.path.join(tmp, sub))
        clean = SitesRun("sites-loss", hb_timeout=hb_timeout, gbps=gbps, loss=0.0,
                         workdir=os.path.join(tmp, "clean")).run()
        lossy = SitesRun("sites-loss", hb_timeout=hb_timeout, gbps=gbps, loss=loss,
                         workdir=os.path.join(tmp, "lossy")).run()
    same = clean.get("final_shards") is not None and lossy.get("final_shards") == clean["final_shards"]
    rec = {k: v for k, v in lossy.items() if k != "final_shards"}
    rec.update(loss=loss, params_equal=bool(lossy.get("params_equal")) and same, recovered=lossy.get("recovered")
               and clean.get("recovered"), seconds_clean=clean.get("seconds"), seconds_faulted=lossy.get("seconds"),
               rc=max(clean.get("rc", 1), lossy.get("rc", 1)),
               leftovers=clean.get("leftovers", []) + lossy.get("leftovers", []))
    return rec
