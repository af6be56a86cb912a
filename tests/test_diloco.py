"""DiLoCo / async DiLoCo over the real communicator (peers as threads or processes on 127.0.0.1)
against single-process references (tests/support/diloco_util.py): every element of θ_global and of the
outer momentum equal, shared-state hashes equal on every peer, newcomers and dead peers handled."""
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

import diloco_util as U
from comm_util import SECRET, close_all, make_group, run_threads
from jaxodc.comm.communicator import Communicator
from jaxodc.coord.service import CoordinatorService
from jaxodc.optim.diloco import DiLoCo, PseudoGradientReducer, diloco_outer, pseudo_gradient

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LR, MOM = 0.7, 0.9


@pytest.fixture
def svc():
    s = CoordinatorService("127.0.0.1", 0, SECRET, heartbeat_timeout_s=3.0).start()
    yield s
    s.stop()


def _outer():
    return optax.sgd(LR, momentum=MOM, nesterov=True)


def _train(dl, rank, T, H, t0=0, after_outer=None):
    hashes = []
    for t in range(t0, t0 + T):
        for i in range(H):
            dl.step(U.batch(rank, t * H + i))
        hashes.append(dl.state_hash())
        if after_outer is not None:
            after_outer(t)
    return hashes


def _assert_same_on_all(dls, hashes):
    assert all(h == hashes[0] for h in hashes), hashes         # every outer step, every peer
    for dl in dls[1:]:
        assert U.flat(dl.global_params).tobytes() == U.flat(dls[0].global_params).tobytes()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_diloco_equals_reference_bit_exact(svc, asynchronous):
    """(a) DiLoCo / (b) async DiLoCo, 3 peers, adam inner, Nesterov outer: θ_global after every
    element equal to the reference (async: applied one outer step late), bit-identical peers."""
    n, H, T = 3, 3, 4
    comms = make_group(svc.address, n)
    try:
        dls = [DiLoCo(c, U.ADAM, _outer(), H, loss_fn=U.loss_fn, asynchronous=asynchronous)
               .init(U.init_params()) for c in comms]
        hashes = run_threads([lambda dl=dl, c=c: _train(dl, c.rank, T, H) for dl, c in zip(dls, comms)])
        _assert_same_on_all(dls, hashes)
        theta, outer, pending = U.reference(U.init_params(), U.ADAM, LR, MOM, H, T, [[0, 1, 2]] * T,
                                            delayed=asynchronous)
        got = U.flat(dls[0].global_params)
        assert np.array_equal(got, theta), np.abs(got - theta).max()
        assert np.array_equal(U.flat(dls[0].outer_state[0].trace), outer.trace)
        assert all(dl.reducer.worlds == [n] * (T - asynchronous) for dl in dls)  # async: last one in flight
        assert not np.array_equal(theta, U.flat(U.init_params()))
        if asynchronous:
            # one update behind: T-1 averages applied, the T-th still pending; flush applies it
            run_threads([dl.flush for dl in dls])
            final = outer.apply(theta, pending)
            for dl in dls:
                assert np.array_equal(U.flat(dl.global_params), final) and dl.reducer.worlds == [n] * T
            # syncs: only the first (founding) one, which moved no bytes
            assert all(dl.revision == 0 for dl in dls)
        else:
            # a sync every outer iteration; all no-ops after the founding one
            assert all(dl.revision == T - 1 and dl.last_sync.bytes_received == 0 for dl in dls)
    finally:
        close_all(comms)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_flush_runs_the_partial_last_round(svc, asynchronous):
    """7 inner steps at H=3: flush runs the last round's outer step on the pseudo-gradient of its
    one inner step (async: then applies the average in flight), so θ_global equals the reference
    whose last outer step has 1 inner step, bit for bit, on every peer."""
    n, H, steps = 2, 3, 7
    comms = make_group(svc.address, n)
    try:
        dls = [DiLoCo(c, U.ADAM, _outer(), H, loss_fn=U.loss_fn, asynchronous=asynchronous)
               .init(U.init_params()) for c in comms]

        def train(dl, rank):
            for k in range(steps):
                dl.step(U.batch(rank, k))
            dl.flush()
        run_threads([lambda dl=dl, c=c: train(dl, c.rank) for dl, c in zip(dls, comms)])
        T = -(-steps // H)
        theta, outer, pending = U.reference(U.init_params(), U.ADAM, LR, MOM, H, T, [[0, 1]] * T,
                                            delayed=asynchronous, last=steps % H)
        if asynchronous:
            theta = outer.apply(theta, pending)
        for dl in dls:
            got = U.flat(dl.global_params)
            assert np.array_equal(got, theta), np.abs(got - theta).max()
            assert np.array_equal(U.flat(dl.params), got) and dl.reducer.worlds == [n] * T
            assert np.array_equal(U.flat(dl.outer_state[0].trace), outer.trace)
        dls[0].flush()  # nothing left: a second flush changes nothing and communicates nothing
        assert np.array_equal(U.flat(dls[0].global_params), theta) and dls[0].reducer.worlds == [n] * T
    finally:
        close_all(comms)


def test_h1_sgd1_equals_data_parallel_sgd(svc):
    """(c) H=1, outer SGD(lr=1): each outer step is one data-parallel SGD step on averaged
    gradients (up to the rounding of θ − (θ − lr·g))."""
    n, T, lr = 2, 6, 0.05
    comms = make_group(svc.address, n)
    try:
        dls = [DiLoCo(c, optax.sgd(lr), optax.sgd(1.0), 1, loss_fn=U.loss_fn).init(U.init_params()) for c in comms]
        run_threads([lambda dl=dl, c=c: _train(dl, c.rank, T, 1) for dl, c in zip(dls, comms)])
        grad = jax.jit(jax.grad(U.loss_fn))
        theta = U.flat(U.init_params()).astype(np.float64)
        for t in range(T):
            p = U.unflat(theta.astype(np.float32), U.init_params())
            g = np.mean([U.flat(grad(p, U.batch(r, t))).astype(np.float64) for r in range(n)], axis=0)
            theta = theta - lr * g
        got = U.flat(dls[0].global_params)
        np.testing.assert_allclose(got, theta, rtol=2e-5, atol=2e-6)
        assert np.abs(got - U.flat(U.init_params())).max() > 1e-2  # it really moved
        assert U.flat(dls[1].global_params).tobytes() == got.tobytes()
    finally:
        close_all(comms)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_newcomer_joins_mid_run(svc, asynchronous):
    """A third peer joins after J outer steps: it receives θ_global, the outer state and (async)
    the average it missed in one sync, then every peer stays bit-identical and equal to the
    reference with contributors {0,1} before the join and {0,1,2} after."""
    H, J, T = 2, 2, 3
    comms = make_group(svc.address, 2)
    newcomer = Communicator(svc.address, secret=SECRET, timeout_s=30, heartbeat_s=0.2)
    mk = lambda c, seed: DiLoCo(c, U.ADAM, _outer(), H, loss_fn=U.loss_fn,  # noqa: E731
                                asynchronous=asynchronous).init(U.init_params(seed))
    try:
        dls = [mk(c, 0) for c in comms]
        run_threads([lambda dl=dl, c=c: _train(dl, c.rank, J, H) for dl, c in zip(dls, comms)])

        def established(dl, rank):
            end = time.monotonic() + 20   # start once the newcomer is parked, so it joins now
            while not svc.snapshot()["groups"][0]["waiting"]:
                assert time.monotonic() < end, "newcomer never asked to join"
                time.sleep(0.02)
            return _train(dl, rank, T, H, t0=J)

        def join():
            newcomer.connect()
            dl = mk(newcomer, 99)       # wrong parameters: the sync must replace them
            dls.append(dl)
            return _train(dl, 2, T, H, t0=J)

        hashes = run_threads([lambda dl=dl, c=c: established(dl, c.rank) for dl, c in zip(dls[:2], comms)] + [join])
        assert newcomer.rank == 2 and newcomer.world_size == 3
        _assert_same_on_all(dls, hashes)
        info = dls[2].last_sync if asynchronous else None
        if asynchronous:   # the newcomer's only sync: θ_global, outer trace and the missed average
            assert "has_pending" in info.keys_fetched
            assert any(k.startswith("pending") for k in info.keys_fetched)
            assert any(k.startswith("global") for k in info.keys_fetched)
        theta, outer, _ = U.reference(U.init_params(), U.ADAM, LR, MOM, H, J + T,
                                      [[0, 1]] * J + [[0, 1, 2]] * T, delayed=asynchronous)
        assert np.array_equal(U.flat(dls[2].global_params), theta)
        assert np.array_equal(U.flat(dls[2].outer_state[0].trace), outer.trace)
    finally:
        close_all(comms + [newcomer])


def test_outer_transformation_in_optax_loops(svc):
    """diloco_outer in hand-written loops: synchronous (it averages with the reducer) and async
    (the loop starts each average and hands the previous one to diloco_outer without a reducer)."""
    comms = make_group(svc.address, 2)
    try:
        def loop(c, delayed):
            red = PseudoGradientReducer(c, tag=77)
            tx = diloco_outer(_outer(), None if delayed else red)
            assert isinstance(tx, optax.GradientTransformation)
            theta = jax.tree.map(np.asarray, U.init_params())
            state = tx.init(theta)
            inner = U.make_inner(U.SGD)
            s_in = U.SGD.init(theta)
            pending = None
            for t in range(3):
                p, s_in = inner(theta, s_in, U.batch(c.rank, t))
                delta = pseudo_gradient(theta, p)
                if delayed:
                    average = None if pending is None else pending.result()
                    pending = red.start(delta)
                    if average is None:
                        continue
                    delta = average
                upd, state = tx.update(delta, state, theta)
                theta = optax.apply_updates(theta, upd)
            if delayed:  # the last average is still to apply; result() is memoised
                assert pending.result() is pending.result() and red.worlds == [2] * 3
            return U.flat(theta)

        for delayed in (False, True):
            outs = run_threads([lambda c=c: loop(c, delayed) for c in comms])
            ref, _, _ = U.reference(U.init_params(), U.SGD, LR, MOM, 1, 3, [[0, 1]] * 3, delayed=delayed)
            assert outs[0].tobytes() == outs[1].tobytes()
            assert np.array_equal(outs[0], ref)
        # reduce=None is the single-peer transformation: the outer optimizer itself
        tx = diloco_outer(_outer())
        g = {"w": np.ones(3, np.float32)}
        u, _ = tx.update(g, tx.init(g), g)
        np.testing.assert_array_equal(np.asarray(u["w"]), U.NesterovRef(LR, MOM).apply(np.zeros(3, np.float32), g["w"]))
    finally:
        close_all(comms)


def test_outer_update_is_a_function_of_its_inputs(svc):
    """diloco_outer keeps nothing between calls: the same (pseudo-gradient, state, params) twice
    gives the same updates and state, bit for bit, and leaves its inputs untouched; with a reducer
    the two calls are two identical all-reduces."""
    comms = make_group(svc.address, 2)
    try:
        def twice(c):
            tx = diloco_outer(_outer(), PseudoGradientReducer(c))
            theta = jax.tree.map(np.asarray, U.init_params())
            delta = jax.tree.map(lambda x: np.float32(0.01 * (1 + c.rank)) * x, theta)
            _, state = tx.update(delta, tx.init(theta), theta)   # a non-zero momentum to start from
            inputs = [delta, state, theta]
            before = [U.flat(x).tobytes() for x in inputs]
            first, second = tx.update(*inputs), tx.update(*inputs)
            assert [U.flat(x).tobytes() for x in inputs] == before   # inputs untouched
            assert [U.flat(x).tobytes() for x in first] == [U.flat(x).tobytes() for x in second]
            return U.flat(first[0])

        outs = run_threads([lambda c=c: twice(c) for c in comms])
        assert outs[0].tobytes() == outs[1].tobytes() and np.abs(outs[0]).max() > 0
    finally:
        close_all(comms)


def test_quantized_transfer_and_periodic_async_sync(svc):
    """uint16 pseudo-gradients with async DiLoCo syncing every outer step (each sync first
    completes the in-flight all-reduce): peers stay bit-identical, every sync moves 0 bytes, and
    θ_global stays within the quantisation error of the exact reference."""
    n, H, T = 3, 2, 3
    comms = make_group(svc.address, n)
    try:
        dls = [DiLoCo(c, U.ADAM, _outer(), H, loss_fn=U.loss_fn, asynchronous=True, sync_every=1,
                      quantize="uint16").init(U.init_params()) for c in comms]
        hashes = run_threads([lambda dl=dl, c=c: _train(dl, c.rank, T, H) for dl, c in zip(dls, comms)])
        _assert_same_on_all(dls, hashes)
        assert all(dl.revision == T - 1 and dl.last_sync.bytes_received == 0 for dl in dls)
        theta, _, _ = U.reference(U.init_params(), U.ADAM, LR, MOM, H, T, [[0, 1, 2]] * T, delayed=True)
        got = U.flat(dls[0].global_params)
        moved = np.abs(theta - U.flat(U.init_params())).max()
        assert np.abs(got - theta).max() < 1e-3 * moved and not np.array_equal(got, theta)
    finally:
        close_all(comms)


def test_first_peer_founds_group_through_driver(svc):
    """A peer that is not accepted yet and finds itself alone founds the group (its state is
    kept; a receive_only sync would have no source) and trains as a world of one."""
    c = Communicator(svc.address, secret=SECRET, timeout_s=30, heartbeat_s=0.2).connect()
    try:
        dl = DiLoCo(c, U.ADAM, _outer(), 2, loss_fn=U.loss_fn).init(U.init_params())
        _train(dl, 0, 2, 2)
        assert c.world_size == 1 and dl.revision == 1 and dl.reducer.worlds == [1, 1]
        theta, _, _ = U.reference(U.init_params(), U.ADAM, LR, MOM, 2, 2, [[0]] * 2)
        assert np.array_equal(U.flat(dl.global_params), theta)
    finally:
        c.close()


def _spawn(master, npeers, mode, T, H, victim_at):
    return subprocess.Popen([sys.executable, os.path.join(HERE, "support", "diloco_peer.py"), master, SECRET.decode(),
                             str(npeers), mode, str(T), str(H), str(victim_at)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_peer_killed_mid_run_survivors_continue(svc, mode):
    """(d) Two peers (threads) and a peer process that SIGKILLs itself inside the all-reduce of
    outer step K (async: while it overlaps the next inner steps). The survivors re-run it over
    themselves, keep training, stay bit-identical at every step, and θ_global equals the
    reference averaging over all 3 before step K and over the 2 survivors from step K on."""
    n, T, H, K = 3, 4, 2, 1
    comms = make_group(svc.address, 2)
    victim = _spawn(svc.address, n, mode, T, H, K)
    try:
        def survivor(c):
            end = time.monotonic() + 60
            while c.world_size < n:  # admit the victim process
                assert time.monotonic() < end and victim.poll() is None, "victim process never joined"
                if c.are_peers_pending():
                    c.update_topology()
                else:
                    time.sleep(0.02)
            dl = DiLoCo(c, U.ADAM, _outer(), H, loss_fn=U.loss_fn,
                        asynchronous=mode == "async").init(U.init_params())
            worlds = []
            hashes = _train(dl, c.rank, T, H, after_outer=lambda t: worlds.append(c.world_size))
            dl.flush()
            return dl, hashes, worlds

        res = run_threads([lambda c=c: survivor(c) for c in comms], timeout=90)
        start = json.loads(victim.stdout.readline() or "{}")
        assert start.get("event") == "start" and start["rank"] == 2 and start["world"] == n, start
        assert victim.wait(10) == -9, victim.stderr.read()[-3000:]   # it died by SIGKILL
        outer_lines = [json.loads(line) for line in victim.stdout.read().splitlines()]
        assert [o["t"] for o in outer_lines] == list(range(K))          # it died in outer step K
        dls = [r[0] for r in res]
        _assert_same_on_all(dls, [r[1] for r in res])
        assert [o["hash"] for o in outer_lines] == res[0][1][:K]        # equal to the victim before
        assert all(r[2][-1] == 2 for r in res) and res[0][2][0] == n
        # the kill landed in an all-reduce: aborted everywhere and re-run over the survivors
        assert all(dl.reducer.retries >= 1 for dl in dls), [dl.reducer.retries for dl in dls]
        worlds = dls[0].reducer.worlds
        assert worlds == dls[1].reducer.worlds and worlds == [3] * K + [2] * (T - K), worlds
        contributors = [[0, 1, 2] if w == 3 else [0, 1] for w in worlds]
        theta, outer_ref, pending = U.reference(U.init_params(), U.ADAM, LR, MOM, H, T, contributors,
                                                delayed=mode == "async")
        if mode == "async":  # flushed: the last average is applied too
            theta = outer_ref.apply(theta, pending)
        got = U.flat(dls[0].global_params)
        assert np.array_equal(got, theta), np.abs(got - theta).max()
    finally:
        close_all(comms)
        if victim.poll() is None:
            victim.kill()
        victim.wait()
        victim.stdout.close()
        victim.stderr.close()
