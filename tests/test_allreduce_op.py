"""The ring all-reduce as an FFI custom call inside jax.jit equals numpy (and the eager ring)."""
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxodc.comm.ring import RingEndpoint
from jaxodc.ops import all_reduce, all_reduce_tree


@pytest.fixture(scope="module")
def ring3():
    eps = [RingEndpoint(secret=b"ffi", timeout_s=10) for _ in range(3)]
    addrs = [e.address for e in eps]
    with ThreadPoolExecutor(3) as ex:
        list(ex.map(lambda i: eps[i].connect_ring(addrs, i, 1), range(3)))
    yield eps
    for e in eps:
        e.close()


def per_peer(eps, fn):
    with ThreadPoolExecutor(len(eps)) as ex:
        return list(ex.map(fn, range(len(eps))))


def test_jit_all_reduce_equals_numpy(ring3):
    xs = [np.random.default_rng(i).standard_normal((33, 7)).astype(np.float32) for i in range(3)]

    def run(i):
        def f(x):
            y, token = all_reduce(x * 2.0, ring3[i], op="avg")
            return y + 1.0, token
        y, token = jax.jit(f)(xs[i])
        assert token.dtype == jnp.int32 and token.shape == (1,) and int(token[0]) == 1  # a fresh token, advanced
        return np.asarray(y)

    res = per_peer(ring3, run)
    want = np.mean([2.0 * x for x in xs], axis=0) + 1.0
    for r in res:
        np.testing.assert_allclose(r, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(r, res[0])
    # identical to the eager ring on the same inputs
    eager = per_peer(ring3, lambda i: ring3[i].all_reduce(2.0 * xs[i], op="avg", tag=9) + 1.0)
    np.testing.assert_array_equal(res[0], eager[0])


def test_token_ordered_tree_and_int_ops(ring3):
    trees = [{"a": jnp.arange(10, dtype=jnp.int32) * (i + 1), "b": jnp.full((5,), float(i), jnp.float32),
              "c": jnp.asarray(np.random.default_rng(i).standard_normal(1001), jnp.bfloat16)} for i in range(3)]

    def run(i):
        f = jax.jit(lambda t: all_reduce_tree(t, ring3[i].handle, op="max")[0])
        return jax.tree_util.tree_map(np.asarray, f(trees[i]))

    res = per_peer(ring3, run)
    np.testing.assert_array_equal(res[0]["a"], np.arange(10) * 3)
    np.testing.assert_array_equal(res[0]["b"], np.full(5, 2.0, np.float32))
    want_c = np.max([np.asarray(t["c"]).astype(np.float32) for t in trees], axis=0)
    np.testing.assert_array_equal(res[0]["c"].astype(np.float32), want_c)
    for r in res[1:]:
        for k in "abc":
            np.testing.assert_array_equal(r[k], res[0][k])


def test_explicit_token_chain_and_quantized(ring3):
    xs = [np.random.default_rng(10 + i).uniform(-1, 1, 4000).astype(np.float32) for i in range(3)]

    def run(i):
        @jax.jit
        def f(x):
            tok = jnp.zeros((1,), jnp.int32)
            y, tok = all_reduce(x, ring3[i], op="sum", token=tok)
            z, tok = all_reduce(y, ring3[i], op="min", quantize="uint8", token=tok, tag=1)
            return y, z, tok
        return [np.asarray(v) for v in f(xs[i])]

    res = per_peer(ring3, run)
    s = np.sum(xs, axis=0)
    np.testing.assert_allclose(res[0][0], s, rtol=1e-5, atol=1e-5)
    assert int(res[0][2][0]) == 2  # each call advanced the token
    for r in res[1:]:
        np.testing.assert_array_equal(r[1], res[0][1])  # quantised result bit-identical
    step = (s.max() - s.min()) / 255
    assert np.abs(res[0][1] - s).max() <= 3 * step


def test_bad_endpoint_handle_raises():
    with pytest.raises(Exception, match="no live endpoint"):
        jax.block_until_ready(jax.jit(lambda x: all_reduce(x, 987654321)[0])(jnp.ones(3)))
