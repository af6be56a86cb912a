"""Collective trainer (comm="collective") across 2 processes over gloo vs the single-process
reference: parameters after 3 minibatches agree elementwise (adam + exact global-norm clipping)."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W, B, MAX_TOKENS, STEPS, MAX_NORM, LR = 2, 4, 64, 3, 0.05, 1e-3
# The summed gradients agree with the reference to fp32 rounding (~1e-7 of the largest element;
# psum_scatter sums in another order), but adam's g / (sqrt(v) + eps) amplifies rounding by up to
# ~lr/eps on elements whose gradient is near eps. lr=1e-3, eps=1e-6 keep that below atol=1e-6 while
# every parameter still moves by ~lr per step.
EPS = 1e-6
MB_SEED = 5
MIN_BUCKET = 32  # rows of 32 or 64 tokens (the reference packs everything to 64: padding is inert)


def _setup():
    import jax
    from jaxodc.models.lm import LM, LMConfig
    from jaxodc.data import Samples, minibatches, stdlib_corpus
    model = LM(LMConfig(d_model=32, n_layers=2, n_heads=2))
    params = model.init(jax.random.PRNGKey(0))
    # Long-tailed lengths fixed here (not a data preset) so the plans below stay what the asserts expect.
    lengths = np.clip(np.rint(np.random.default_rng(3).lognormal(np.log(16), 0.9, 64)), 4, MAX_TOKENS).astype(int)
    samples = Samples.from_corpus(stdlib_corpus(1 << 20), lengths, seed=3)
    mbs = [idx for _, idx in zip(range(STEPS), minibatches(len(samples), W * B, seed=MB_SEED))]
    return model, params, samples, mbs


BALANCE = ("lb_micro", "local_sort", "lb_mini")  # per step; lb_mini's unequal counts get padded


def _plan(samples, idx, step):
    from jaxodc.balance.plan import make_plan
    from jaxodc.balance.cost import CostModel
    return make_plan(BALANCE[step], samples.lengths[idx].tolist(), W, MAX_TOKENS, CostModel.for_transformer(32))


def _worker(rank: int, port: int, out: str) -> None:
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=W, process_id=rank,
                               initialization_timeout=60)
    import optax
    from jaxodc.train.collective import CollectiveTrainer
    from jaxodc.optim.clipping import clip_by_global_norm
    from jaxodc.train.core import microbatches_for, train_loop
    from jaxodc.data import Samples
    from jaxodc.balance.packing import pack
    model, params, samples, mbs = _setup()
    tr = CollectiveTrainer(model, optax.chain(clip_by_global_norm(MAX_NORM), optax.adam(LR, eps=EPS)), params)
    tr.warmup([32, 64])  # compiles; must leave parameters and optimizer state untouched (parity below)
    losses, counts = [], []
    for step, idx in enumerate(mbs):
        plan = _plan(samples, idx, step)
        sub = Samples([samples[i] for i in idx])
        counts.append(plan.counts())
        losses.append(tr.train_plan(plan, sub.tokens, min_bucket=MIN_BUCKET).loss)
    np.savez(os.path.join(out, f"rank{rank}.npz"), **tr.local_shards())
    # train_loop: plans, records with this rank's samples/tokens and estimated busy time.
    from jaxodc.balance.cost import CostModel
    recs = train_loop(tr, samples.tokens, mbs[:2], "lb_micro", MAX_TOKENS, CostModel(1e-9, 1e-7), estimate_busy=True)
    loop = [[r.step, r.samples, r.tokens, r.busy_s, r.loss, len(r.compute)] for r in recs]
    # Unequal microbatch counts must fail on every rank with a message naming them.
    err = shape_err = ""
    try:
        tr.train_minibatch([microbatches_for(plan, rank, sub.tokens)[0]] * (1 + rank), 10.0)
    except ValueError as e:
        err = str(e)
    try:  # same count, different row lengths
        tr.train_minibatch([pack([sub.tokens[0][:4]], 16 * (1 + rank)).as_dict()], 10.0)
    except ValueError as e:
        shape_err = str(e)
    # A model configured differently on one rank is caught before any training collective.
    from jaxodc.models.lm import LM, LMConfig
    other = LM(LMConfig(d_model=32, n_layers=2 + rank, n_heads=2))
    fp_err = ""
    try:
        CollectiveTrainer(other, optax.sgd(0.1), other.init(jax.random.PRNGKey(0)))
    except ValueError as e:
        fp_err = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"losses": losses, "counts": counts, "err": err, "shape_err": shape_err, "fp_err": fp_err, "fp": tr.layout.fingerprint(),
                   "loop": loop}, fh)
    jax.distributed.shutdown()


def _spawn(tmp_path):
    """Start W rank processes; returns a function that waits for them (the caller computes the
    reference meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "support")]),
               XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(W)]

    def wait():
        try:
            for r, p in enumerate(procs):
                o, _ = p.communicate(timeout=150)
                assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{o[-4000:]}"
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    return wait


def test_collective_matches_reference(tmp_path):
    import jax
    import optax
    from jaxodc.train.core import microbatches_for, plan_global_tokens
    from jaxodc.data import Samples
    from jaxodc.train.reference import ReferenceTrainer
    from jaxodc.modeling.units import make_layout, unshard_params

    wait = _spawn(tmp_path)
    try:
        model, params, samples, mbs = _setup()
        ref = ReferenceTrainer(model, optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adam(LR, eps=EPS)), params)
        ref_losses, norms, buckets = [], [], set()
        for step, idx in enumerate(mbs):
            plan = _plan(samples, idx, step)
            sub = Samples([samples[i] for i in idx])
            mb_all = [m for r in range(W) for m in microbatches_for(plan, r, sub.tokens)]
            loss, g = ref.grads(mb_all, plan_global_tokens(plan))
            norms.append(float(optax.tree.norm(g)))
            ref.apply(g)
            ref_losses.append(loss)
            for m in range(max(plan.counts())):  # lock-step buckets: one row length per step on all ranks
                rows = {microbatches_for(plan, r, sub.tokens, max(plan.counts()), MIN_BUCKET, True)[m]["tokens"].shape
                        for r in range(W)}
                assert len(rows) == 1
                buckets |= rows
    finally:
        wait()
    assert buckets == {(1, 32), (1, 64)}, buckets
    assert max(norms) > MAX_NORM, "clipping never triggered; the test would not exercise the global norm"

    info = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(W)]
    assert info[0]["fp"] == info[1]["fp"] == make_layout(params, W, sharding="per_leaf").fingerprint()
    assert any(len(set(c)) == 1 and max(c) > 1 for c in info[0]["counts"])
    assert any(len(set(c)) > 1 for c in info[0]["counts"]), info[0]["counts"]  # padding exercised
    for r in range(W):
        np.testing.assert_allclose(info[r]["losses"], ref_losses, rtol=1e-5)
        assert "microbatch count" in info[r]["err"] and "rank 0: 1" in info[r]["err"] and "rank 1: 2" in info[r]["err"]
        assert "ranks disagree on the parameter layout: layout fingerprint" in info[r]["fp_err"], info[r]["fp_err"]
        assert "ranks disagree on the minibatch" in info[r]["shape_err"] and "microbatch shapes (rank 0:" in info[r]["shape_err"], \
            info[r]["shape_err"]
    # train_loop records: steps continue after the 3 parity steps; every sample counted once.
    from jaxodc.balance.plan import lb_micro
    from jaxodc.balance.cost import CostModel as CM
    for s in range(2):
        plan = lb_micro(samples.lengths[mbs[s]].tolist(), W, MAX_TOKENS, CM(1e-9, 1e-7))
        rows = [info[r]["loop"][s] for r in range(W)]
        assert [row[0] for row in rows] == [STEPS + s] * W
        assert sum(row[1] for row in rows) == W * B and sum(row[2] for row in rows) == plan.total_tokens
        for r, row in enumerate(rows):
            assert row[5] == max(plan.counts())  # padded to equal counts
            want = sum(CM(1e-9, 1e-7).microbatch([plan.lengths[i] for i in mb]) for mb in plan.ranks[r])
            assert want < row[3] < want + 5.0  # + optimizer seconds
        assert rows[0][4] == rows[1][4] > 0

    layout = make_layout(params, W, order=model.unit_names, sharding="per_leaf")
    shards = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(W)]
    got = unshard_params(layout, shards)
    want = ref.numpy_params()
    init = params
    for (path, a), b, c in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want),
                               jax.tree_util.tree_leaves(init)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    moved = sum(float(np.abs(np.asarray(b) - np.asarray(c)).max()) for b, c in
                zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(init)))
    assert moved > 1e-2, "reference parameters did not move"
    # padding elements of every shard stay exactly zero
    for u in layout.units:
        full = np.concatenate([s[u.name] for s in shards])
        assert np.all(full[u.numel:] == 0)


# ---------------------------------------------------------------------------------------------
# The ODC driver (OdcTrainer) against a test-only, in-process runtime: two ranks as two threads on
# two host devices of one process, sharing Python dicts instead of the real ODC shard store. It
# checks the driver's protocol (my microbatches -> done -> wait_complete -> fetch_grad ->
# optimizer -> publish; global sums through allgather; stealing through claim) with
# different microbatch counts per rank, a rank with none, and LB-Steal. The real runtime is
# jaxodc.odc's; this double only stands in for it here.

class _Hub:
    def __init__(self, world, timeout=60.0):
        import threading
        from local_deques import LocalDeques
        self.world, self.timeout = world, timeout
        self.cv = threading.Condition()
        self.pub, self.acc, self.done, self.scal, self.calls = {}, {}, {}, {}, {}
        self.deques = LocalDeques()

    def wait(self, pred, what):
        with self.cv:
            if not self.cv.wait_for(pred, self.timeout):
                raise TimeoutError(f"in-process ODC runtime: timed out waiting for {what}")


def _thread_runtime(hub, rank):
    import jax
    import jax.numpy as jnp
    from jaxodc.train.odc import OdcRuntime

    class Rt(OdcRuntime):
        def __init__(self):
            self.rank, self.world, self._ops = rank, hub.world, {}

        def _op(self, spec):
            if spec.index in self._ops:
                return self._ops[spec.index]

            def read(v):
                v = int(v)
                keys = [(spec.index, o) for o in range(hub.world)]
                hub.wait(lambda: all(k in hub.pub and hub.pub[k][0] >= v for k in keys),
                         f"unit {spec.name} version {v} from every owner (rank {rank})")
                with hub.cv:
                    got = [hub.pub[k] for k in keys]
                bad = [o for o, (ver, _) in enumerate(got) if ver != v]
                assert not bad, f"unit {spec.name}: owners {bad} published past version {v}"
                return np.concatenate([x for _, x in got]).astype(np.float32)

            def push(v, ct):
                ct = np.asarray(ct, np.float32)
                with hub.cv:
                    for o in range(hub.world):
                        a, b = spec.shard_range(o)
                        hub.acc[(spec.index, o)] = hub.acc.get((spec.index, o), 0) + ct[a:b]
                return np.zeros(spec.shard, np.float32)

            @jax.custom_vjp
            def g(shard, version):
                return jax.pure_callback(read, jax.ShapeDtypeStruct((spec.padded,), jnp.float32), version)

            def fwd(shard, version):
                return g(shard, version), version

            def bwd(version, ct):
                z = jax.pure_callback(push, jax.ShapeDtypeStruct((spec.shard,), jnp.float32), version, ct)
                return z, None

            g.defvjp(fwd, bwd)
            self._ops[spec.index] = g
            return g

        def gather(self, shard, spec, version):
            return self._op(spec)(shard, version)

        def publish(self, unit, shard, version):
            with hub.cv:
                hub.pub[(unit, rank)] = (version, np.array(shard, np.float32))
                hub.cv.notify_all()

        def done(self, version):
            with hub.cv:
                hub.done.setdefault(version, set()).add(rank)
                hub.cv.notify_all()

        def wait_complete(self, version):
            hub.wait(lambda: len(hub.done.get(version, ())) == hub.world, f"done({version}) from all ranks")

        def fetch_grad(self, unit):
            with hub.cv:
                g = hub.acc.pop((unit, rank), None)
            return np.zeros_like(hub.pub[(unit, rank)][1]) if g is None else g

        def allgather_scalar(self, version, x):
            with hub.cv:
                k = hub.calls.get((rank, version), 0)
                hub.calls[(rank, version)] = k + 1
                hub.scal.setdefault((version, k), {})[rank] = float(x)
                hub.cv.notify_all()
            hub.wait(lambda: len(hub.scal[(version, k)]) == hub.world, f"allgather_scalar #{k} of version {version}")
            return np.array([hub.scal[(version, k)][r] for r in range(hub.world)])

        def allgather(self, version, values):
            rows = [self.allgather_scalar(version, x) for x in np.asarray(values, np.float64).reshape(-1)]
            return np.stack(rows, axis=1).reshape(hub.world, len(rows))

        def claim(self, version, owner, count, steal):
            return hub.deques.claim(version, owner, count, steal)

        def master_view(self, unit):
            return None  # no zero-copy owner path: the trainer publishes copies

        def grad_view(self, unit):
            return self.fetch_grad(unit)

        def clear_grad(self, unit):
            pass

    return Rt()


def _odc_plans(samples, mbs):
    """Plans for the minibatches in `mbs` order (the test passes them reversed: the last one gives
    LB-Mini unequal counts)."""
    from jaxodc.balance.plan import Plan, lb_mini, lb_steal
    from jaxodc.balance.cost import CostModel
    cost = CostModel.for_transformer(32)
    l0, l1, l2 = (samples.lengths[i].tolist() for i in mbs)
    p0 = lb_mini(l0, W, MAX_TOKENS, cost)
    one = lb_mini(l1, 1, MAX_TOKENS, cost)  # everything on rank 0, nothing on rank 1
    p1 = Plan("lb_mini", W, MAX_TOKENS, one.lengths, (one.ranks[0], ()))
    p2 = lb_steal(l2, W, MAX_TOKENS, cost)
    return [p0, p1, p2]


def _odc_worker(out: str) -> None:
    import threading
    import jax
    import optax
    from jaxodc.train.odc import OdcTrainer
    from jaxodc.optim.clipping import clip_by_global_norm
    from jaxodc.data import Samples
    assert len(jax.devices()) == W, jax.devices()
    model, params, samples, mbs = _setup()
    mbs = mbs[::-1]
    plans = _odc_plans(samples, mbs)
    hub, results, errors = _Hub(W), {}, []

    def run(rank):
        try:
            with jax.default_device(jax.devices()[rank]):
                rt = _thread_runtime(hub, rank)
                tr = OdcTrainer(model, optax.chain(clip_by_global_norm(MAX_NORM), optax.adam(LR, eps=EPS)), params,
                                rt, gather=rt.gather)
                losses = []
                for plan, idx in zip(plans, mbs):
                    res = tr.train_plan(plan, Samples([samples[i] for i in idx]).tokens, min_bucket=MIN_BUCKET)
                    losses.append((res.loss, len(res.microbatches)))
                results[rank] = (tr.local_shards(), losses)
        except BaseException as e:  # surface in the main thread
            errors.append(f"rank {rank}: {type(e).__name__}: {e}")
            with hub.cv:
                hub.timeout = 0.1
                hub.cv.notify_all()

    ts = [threading.Thread(target=run, args=(r,)) for r in range(W)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors and len(results) == W, errors
    for r in range(W):
        np.savez(os.path.join(out, f"odc{r}.npz"), **results[r][0])
    with open(os.path.join(out, "odc.json"), "w") as fh:
        json.dump({r: results[r][1] for r in range(W)}, fh)


def test_odc_driver_matches_reference(tmp_path):
    import jax
    import optax
    from jaxodc.data import Samples
    from jaxodc.balance.packing import pack
    from jaxodc.train.reference import ReferenceTrainer
    from jaxodc.train.core import plan_global_tokens
    from jaxodc.modeling.units import make_layout, unshard_params

    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "support")]),
               XLA_FLAGS="--xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=false "
                         "intra_op_parallelism_threads=1")
    p = subprocess.Popen([sys.executable, __file__, "odc", str(tmp_path)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:  # the reference runs while the ranks do
        model, params, samples, mbs = _setup()
        mbs = mbs[::-1]
        plans = _odc_plans(samples, mbs)
        assert len(set(plans[0].counts())) > 1 and plans[1].counts()[1] == 0 and plans[2].balance == "lb_steal"
        ref = ReferenceTrainer(model, optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adam(LR, eps=EPS)), params)
        ref_losses, norms = [], []
        for plan, idx in zip(plans, mbs):
            sub = Samples([samples[i] for i in idx])
            all_mbs = [mb for r in plan.ranks for mb in r]
            loss, g = ref.grads([pack([sub[i] for i in mb], MAX_TOKENS).as_dict() for mb in all_mbs],
                                plan_global_tokens(plan))
            norms.append(float(optax.tree.norm(g)))
            ref.apply(g)
            ref_losses.append(loss)
        assert max(norms) > MAX_NORM  # clipping (a global sum through allgather) is exercised
    finally:
        try:
            out, _ = p.communicate(timeout=150)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert p.returncode == 0, out[-6000:]
    info = json.load(open(tmp_path / "odc.json"))
    for r in range(W):
        np.testing.assert_allclose([l for l, _ in info[str(r)]], ref_losses, rtol=1e-5)
    ran = [[info[str(r)][s][1] for r in range(W)] for s in range(3)]
    assert ran[0] == plans[0].counts() and ran[1][1] == 0
    assert sum(ran[2]) == sum(plans[2].counts())  # stolen or not, every microbatch ran once
    layout = make_layout(params, W, order=model.unit_names)
    got = unshard_params(layout, [dict(np.load(tmp_path / f"odc{r}.npz")) for r in range(W)])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(ref.numpy_params())):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------------------------------------
# FSDP memory semantics of the compiled collective microbatch step: XLA's temporary memory must
# not grow with depth (only a couple of gathered units alive at a time, not all of them).

def _memory_worker(out: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxodc.models.lm import LM, LMConfig
    from jaxodc.train.collective import AXIS, collective_gather
    from jaxodc.modeling.staging import microbatch_grad
    from jaxodc.balance.packing import pack
    from jaxodc.modeling.units import make_layout
    mesh = Mesh(np.array(jax.devices()[:W]), (AXIS,))
    res = {}
    for layers in (2, 4):
        model = LM(LMConfig(d_model=128, n_layers=layers, n_heads=4))
        shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0)))
        layout = make_layout(shapes, W, order=model.unit_names, sharding="per_leaf")
        grad = microbatch_grad(model, layout, collective_gather(AXIS))
        spec = {n: P(AXIS) for n in layout.names}
        step = jax.jit(jax.shard_map(lambda s, b, n: grad(s, b, n, None), mesh=mesh,
                                     in_specs=(spec, P(AXIS), P()), out_specs=(P(), spec), check_vma=False))
        shards = {u.name: jax.ShapeDtypeStruct((u.padded,), jnp.float32) for u in layout.units}
        batch = {k: jax.ShapeDtypeStruct((W, 32), v.dtype) for k, v in pack([np.arange(5)], 32).as_dict().items()}
        mem = step.lower(shards, batch, jax.ShapeDtypeStruct((), jnp.float32)).compile().memory_analysis()
        res[layers] = {"temp": int(mem.temp_size_in_bytes), "unit": 4 * layout.largest,
                       "params": 4 * sum(u.padded for u in layout.units)}
    with open(os.path.join(out, "mem.json"), "w") as fh:
        json.dump(res, fh)


def test_collective_step_memory_does_not_grow_with_depth(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "support")]),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={W} --xla_cpu_multi_thread_eigen=false "
                         "intra_op_parallelism_threads=1")
    p = subprocess.run([sys.executable, __file__, "mem", str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    res = json.load(open(tmp_path / "mem.json"))
    two, four = res["2"], res["4"]
    unit = four["unit"]
    assert four["params"] > 2.5 * unit  # the model is several units big
    # Two more blocks add two units of parameters but (almost) no temporary memory: activations of
    # a 32-token microbatch are ~16 KiB per block, a gathered block is ~0.8 MiB.
    assert four["temp"] - two["temp"] < 0.1 * unit, res
    # Peak temporaries: a gathered unit, its full-size gradient and a copy -- a few units, not all.
    assert four["temp"] < 4 * unit, res


def _muon_temporaries(ctx):
    from jaxodc.bench.optim_memory import collective_temp_matrices
    return {f"{layout} {k}": collective_temp_matrices(k, layout == "one") for layout in ("one", "each") for k in (2, 8)}


def test_unit_optimizer_holds_one_gathered_matrix_at_a_time():
    """Muon's per-unit programs (train.unitwise under shard_map): each matrix is gathered (a psum
    inside the program), orthogonalised and cut back before the next is gathered (the placer's
    serial_gathers), and each update piece is an output of its own (update_cuts), so that eight
    matrices in one unit cost what two do, within one matrix. Before: 9 -> 15 matrices (every
    gather scheduled first, every cut last)."""
    from harness import run_ranks
    (t,) = run_ranks(_muon_temporaries, 1, timeout_s=300, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert t["one 8"] <= t["one 2"] + 1.0, t
    assert t["each 8"] <= t["each 2"] + 1.0, t


if __name__ == "__main__":
    if sys.argv[1] == "mem":
        _memory_worker(sys.argv[2])
    elif sys.argv[1] == "odc":
        _odc_worker(sys.argv[2])
    else:
        _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
