"""`jaxodc demo`: trains the small decoder LM on long-tailed byte-level text (Python's own library
sources) on 2 local ranks, first with the collective baseline + LB-Micro (over jaxodc's own
lock-step collective, the transport ODC uses, so the comparison measures ODC's scheduling), then
with ODC + LB-Mini, in the same processes, and prints loss, throughput and bubble rate of both plus a timeline PNG
and the per-minibatch records in --out. It is `jaxodc train` (jaxodc.cli.train) with both runs and
one warm-up minibatch each.

    jaxodc demo [--steps 6] [--minibatch 4] [--max-tokens 256] [--out DIR]

`jaxodc demo --sites` instead trains one job across 3 sites of 2 ODC ranks each, joined by
DiLoCo over emulated 100 Mbit/s, 20 ms links (jaxodc.optim.sites): it kills a rank of site 1 (the
site ends), starts a new site that joins the running job, and prints the loss per outer step and
every membership change; training never stops.

    jaxodc demo --sites [--outer-steps 30] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import re
import sys


def _args(argv):
    p = argparse.ArgumentParser(prog="jaxodc demo")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed minibatches per mode (after one warm-up)")
    p.add_argument("--minibatch", type=int, default=4, help="samples per rank per minibatch")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per packed microbatch")
    p.add_argument("--preset", default="longalign", help="sample-length preset (long-tailed)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", default="jaxodc_demo", help="directory for demo_timeline.png and demo.json")
    p.add_argument("--sites", action="store_true", help="one job across 3 sites with a site killed and one joining")
    p.add_argument("--outer-steps", type=int, default=30, help="--sites: outer steps of the job")
    p.add_argument("--inner-steps", type=int, default=8, help="--sites: inner minibatches per outer step (H)")
    return p.parse_args(argv)


def train_argv(args) -> list[str]:
    """The `jaxodc train` invocation the demo runs."""
    return ["--ranks", str(args.ranks), "--comm", "collective,odc", "--balance", "lb_micro,lb_mini",
            "--collective-transport", "jaxodc",
            "--steps", str(args.steps + 1), "--warmup", "1", "--minibatch", str(2 * args.minibatch),
            "--max-tokens", str(args.max_tokens), "--preset", args.preset, "--d-model", str(args.d_model),
            "--layers", str(args.layers), "--lr", "3e-3", "--clip", "1.0", "--timeline", os.path.join(args.out, "demo_timeline.png"),
            "--json", os.path.join(args.out, "demo.json")]


def sites_train_argv(args) -> list[str]:
    """The `jaxodc train` options of every site in the --sites demo."""
    return ["--groups", "3", "--ranks", "2", "--diloco", str(args.inner_steps), "--wan-mbps", "100",
            "--wan-ms", "20", "--steps", str(args.outer_steps * args.inner_steps), "--minibatch", str(2 * args.minibatch),
            "--max-tokens", str(args.max_tokens), "--preset", args.preset, "--d-model", str(args.d_model), "--layers",
            str(args.layers), "--lr", "3e-3", "--json", os.path.join(os.path.abspath(args.out), "sites")]


def sites_demo(args) -> int:
    """3 founding sites; a site 3 started after the first outer step (it joins when ready) and a
    rank of site 1 killed at a quarter of the run; every site's lines echoed; a summary at the end."""
    from jaxodc.cli import sites
    from jaxodc.cli.train import parser, worker_argv
    os.makedirs(args.out, exist_ok=True)
    targs = parser().parse_args(sites_train_argv(args))
    sites.remove_records(targs.json, 4)
    job = sites.LocalJob(targs, worker_argv(targs))
    T = args.outer_steps
    try:
        for s in range(3):
            job.start(s)
        job.wait_outer(1, timeout_s=600)
        job.start(3, join=True)  # starting up takes a while: it joins at the outer step after it is ready
        print(f"demo: started site 3 after outer step {job.outer_done - 1}; it joins the running job when ready",
              flush=True)
        job.wait_outer(max(2, T // 4), timeout_s=600)
        pid = job.kill_rank(1)
        print(f"demo: killed rank 1 of site 1 (pid {pid}) after outer step {job.outer_done - 1}", flush=True)
        status = job.wait(timeout_s=900)
    finally:
        job.close()
    survivors = [s for s in (0, 2, 3) if status.get(s) == 0]
    print(f"\ndemo: site 1 ended with status {status.get(1)} (killed); sites {survivors} finished the job")
    sites.report(targs.json, 4)
    changes = [line.split("] ", 1)[-1] for _, line in job.lines if re.search(r"site \d+: (sites|joined)", line)]
    print("demo: membership changes, in order: " + "; ".join(changes))
    hashes = sites.final_hashes(targs.json, survivors)
    same = all(len(set(h)) == 1 for h in hashes.values())
    print(f"demo: final shared-state hash per ring {hashes}: {'identical on every site' if same else 'DIFFER'}")
    return 0 if same and len(survivors) == 3 else 1


def main(argv: list[str]) -> int:
    args = _args(argv)
    if args.sites:
        return sites_demo(args)
    from jaxodc.cli.train import main as train
    return train(train_argv(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
