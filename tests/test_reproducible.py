"""Same seed, same data, same world -> bit-identical parameters and losses: two runs of every mode
(ODC over shm and tcp, ODC + LB-Steal with the straggler on another rank each time, so that other
ranks run the microbatches, ODC + TAGC compression, the collective) through `jaxodc train`'s own
run code, compared by the records' params_sha256 and losses. Bit-identical ODC runs are the
opt-in `--reproducible` (the owners' exact sum); the default fp32 sum depends on arrival order."""
import pytest

from harness import run_ranks

BASE = ["--steps", "3", "--warmup", "0", "--minibatch", "2", "--max-tokens", "32", "--d-model", "16",
        "--layers", "1", "--heads", "2", "--seed", "3", "--reproducible"]
SLOW = "factor=5,rank={},window=0:100"  # that rank's microbatches take 5x as long: the other steals
# Per group, the runs to compare (argv each); one rank job per group.
GROUPS = {
    "odc shm, tcp": [["--transport", "shm"]] * 2 + [["--transport", "tcp"]] * 2,
    "odc lb_steal": [["--balance", "lb_steal", "--minibatch", "4", "--straggle", SLOW.format(r)] for r in (0, 1)],
    "odc compress": [["--compress", "fraction=0.3,ratio=2,min_elems=64"]] * 2,
    "collective": [["--comm", "collective"]] * 2,
}


def runs_body(ctx, group):
    """The group's runs on this rank; per run: (rank, step, loss, microbatches run) per record and
    the params_sha256."""
    from jaxodc.cli import train as cli
    from jaxodc.launch.context import init_jax_distributed
    if group == "collective":
        init_jax_distributed(ctx)  # before jax's backends
    out = []
    for argv in GROUPS[group]:
        args = cli.parser().parse_args(BASE + argv)
        cli.check_args(args)
        (run,) = cli.runs_of(args)
        recs = cli._train_run(args, ctx, cli.load_samples(args, ctx.world), run, 1)
        assert len({r.params_sha256 for r in recs}) == 1
        out.append((sorted((r.rank, r.step, r.loss, len(r.compute)) for r in recs), recs[0].params_sha256))
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("group", [g if g == "odc lb_steal" else pytest.param(g, marks=pytest.mark.slow)
                                   for g in GROUPS])
def test_runs_are_bit_identical(group):
    got = run_ranks(runs_body, 2, args=(group,), timeout_s=800)
    assert got[0] == got[1]  # every rank reports the same records and hash
    first = got[0][0]
    assert len(first[0]) == 2 * 3  # 3 minibatches' records from each rank
    for i, run in enumerate(got[0][1:], 1):  # over shm and tcp alike: exact sums make the transport irrelevant
        assert run[1] == first[1], f"{group}: params_sha256 of run {i} differs from run 0's"
        assert [r[:3] for r in run[0]] == [r[:3] for r in first[0]], f"{group}: losses of run {i} differ"
    if group == "odc lb_steal":  # the second time other ranks ran the microbatches, with the same bits
        assert [r[3] for r in got[0][0][0]] != [r[3] for r in got[0][1][0]]
