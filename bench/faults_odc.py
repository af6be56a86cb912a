"""Network faults under ODC across hosts (`jaxodc train` over 2 emulated hosts x 2 ranks, the
README's multi-host launch): the issue's scenario 4 (the link of host 1 down for 5 s mid-run) and
the ODC half of scenario 3 (1% random loss on a 100 Mbit/s link, the whole run).

Each scenario runs the same job twice on one cluster, with the reproducible sum: without the
fault, then with it; `params_equal` compares every rank's params_sha256 across the two runs, and
the records carry both runs' wall time. ODC waits for a peer up to its timeout (60 s): a 5 s
outage is retransmitted by TCP underneath a blocked gather or push, which simply finishes late.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.faults import leftovers_of_cluster, leftovers_on_hosts  # noqa: E402

SCENARIOS = ("odc-link", "odc-loss")
TRAIN = ["-m", "jaxodc.cli.train", "--d-model", "32", "--layers", "1", "--reproducible", "--comm", "odc",
         "--balance", "lb_mini"]


class OdcRun:
    def __init__(self, scenario: str, steps: int = 24, down_s: float = 5.0, loss: float = 0.01,
                 workdir: str | None = None):
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}; choose from {SCENARIOS}")
        self.scenario, self.steps, self.down_s, self.loss = scenario, steps, down_s, loss
        self.gbps = 0.1 if scenario == "odc-loss" else 1.0
        self.dir = workdir or tempfile.mkdtemp(prefix=f"jaxodc-{scenario}-")

    def _launch(self, c, name: str, fault) -> tuple[dict, float, float | None, str]:
        """One run of the job on both hosts; `fault(c)` runs once rank 0 reports minibatch 2."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAXODC_")}
        from jaxodc.launch.launcher import rank_env_defaults
        env.update(rank_env_defaults(env))
        env.update(PYTHONPATH=ROOT)
        base = [sys.executable, "-m", "jaxodc", "launch", "-n", "2", "--nnodes", "2", "--coordinator", "host0:29500",
                "--secret-file", "job.secret", "--timeout", "500"]
        outs, procs = {}, {}
        t0 = time.monotonic()
        for i in (0, 1):
            outs[i] = os.path.join(self.dir, f"{name}.host{i}.out")
            with open(outs[i], "w") as f:
                procs[i] = c.popen(i, base + ["--node-rank", str(i)] + TRAIN + ["--steps", str(self.steps),
                                   "--json", f"{name}.json"], cwd=self.dir, env=env, stdout=f,
                                   stderr=subprocess.STDOUT)
        t_fault = None
        if fault is not None:
            deadline = time.monotonic() + 400
            while not re.search(r"minibatch 2: loss", open(outs[0]).read()):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                    raise RuntimeError(f"{name}: no minibatch 2: {open(outs[0]).read()[-2000:]}")
                time.sleep(0.02)
            t_fault = time.monotonic()
            fault(c)
        rcs = {}
        for i, p in procs.items():
            try:
                rcs[i] = p.wait(timeout=500)
            except subprocess.TimeoutExpired:
                p.kill()
                rcs[i] = p.wait()
        wall = time.monotonic() - t0
        text = "\n".join(open(outs[i]).read()[-1500:] for i in (0, 1))
        if any(rcs.values()):
            return {}, wall, t_fault, f"rc {rcs}: {text}"
        with open(os.path.join(self.dir, f"{name}.json")) as f:
            return json.load(f), wall, t_fault, ""

    def fault(self, c) -> None:
        if self.scenario == "odc-link":
            c.link(1, False)
            time.sleep(self.down_s)
            c.link(1, True)
        else:
            for i in (0, 1):
                c.loss(i, self.loss)

    def run(self) -> dict:
        from jaxodc.launch.cluster import Cluster
        with open(os.path.join(self.dir, "job.secret"), "w") as f:
            f.write(os.urandom(32).hex())
        rec = {"scenario": self.scenario, "hosts": 2, "ranks": 4, "steps": self.steps, "link_gbps": self.gbps,
               "down_s": self.down_s if self.scenario == "odc-link" else None,
               "loss": self.loss if self.scenario == "odc-loss" else None}
        t_start = time.monotonic()
        c = Cluster(2, gbps=self.gbps).start()
        try:
            clean, wall0, _, err0 = self._launch(c, "clean", None)
            faulted, wall1, _, err1 = self._launch(c, "faulted", self.fault)
            for i in (0, 1):
                c.loss(i, 0.0)
            rec["leftovers"], rec["closing_sockets"] = leftovers_on_hosts(c)
        finally:
            c.close()
        rec["leftovers"] += leftovers_of_cluster(c.name)
        digests = lambda run: {r["rank"]: r["params_sha256"] for recs in run.values() for r in recs}
        a, b = digests(clean), digests(faulted)
        rec.update(rc=int(bool(err0 or err1)), detected_s=None, recovered=not (err0 or err1),
                   params_equal=bool(a) and a == b and len(set(a.values())) == 1, lost_steps=0,
                   seconds_clean=round(wall0, 1), seconds_faulted=round(wall1, 1),
                   failures=[e[-2000:] for e in (err0, err1) if e], seconds=round(time.monotonic() - t_start, 1))
        return rec
