"""Toy problem and single-process references for the DiLoCo tests (also used by diloco_peer.py).

The references share nothing with jaxodc.optim: inner steps are their own jitted JAX function, the
average replays the ring's documented summation order in numpy, and the outer Nesterov step is
numpy. The ring (csrc/ring/ring.h) splits the flat buffer into W chunks at floor(n*c/W); chunk c
starts at ring rank c and is summed along the ring, ((x_c + x_{c+1}) + ...) + x_{c-1}, then
divided by W once; all peers receive those bits. Matching that order makes the reference equal
every element exactly, not just approximately."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

ADAM = optax.adam(1e-2)   # inner optimizer objects shared by peers and references (one compile each)
SGD = optax.sgd(0.1)

SHAPES = {"b1": (8,), "b2": (3,), "w1": (6, 8), "w2": (8, 3)}   # 83 floats: chunks 27/28/28 at W=3


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {k: (0.5 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def batch(rank, k):
    """Peer `rank`'s k-th inner batch (peers see different data)."""
    rng = np.random.default_rng(1000 * rank + k)
    x = rng.standard_normal((16, 6)).astype(np.float32)
    y = (np.sin(x[:, :3] * (1 + rank)) + 0.1 * rng.standard_normal((16, 3))).astype(np.float32)
    return x, y


def flat(tree):
    return np.concatenate([np.asarray(l, np.float32).reshape(-1) for l in jax.tree.leaves(tree)])


def unflat(v, like):
    leaves, treedef = jax.tree.flatten(like)
    out, off = [], 0
    for l in leaves:
        n = int(np.prod(np.shape(l)))
        out.append(v[off:off + n].reshape(np.shape(l)))
        off += n
    return jax.tree.unflatten(treedef, out)


def ring_avg(xs):
    """Average of flat float32 vectors (xs[r] = ring rank r's input) in the ring's order."""
    w, n = len(xs), xs[0].size
    out = np.empty_like(xs[0])
    for c in range(w):
        s, e = n * c // w, n * (c + 1) // w
        acc = xs[c][s:e].copy()
        for k in range(1, w):
            acc = acc + xs[(c + k) % w][s:e]
        out[s:e] = acc / np.float32(w)
    return out


@functools.lru_cache(maxsize=None)   # one compilation per optimizer object across tests
def make_inner(inner_opt):
    @jax.jit
    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, s = inner_opt.update(g, s, p)
        return optax.apply_updates(p, u), s
    return step


class NesterovRef:
    """optax.sgd(lr, momentum, nesterov=True) in numpy float32 (momentum None: plain SGD)."""

    def __init__(self, lr, momentum):
        self.lr, self.m = np.float32(lr), None if momentum is None else np.float32(momentum)
        self.trace = None

    def apply(self, theta, g):
        if self.m is None:
            return theta + g * (-self.lr)
        self.trace = g + self.m * (self.trace if self.trace is not None else np.zeros_like(g))
        return theta + (g + self.m * self.trace) * (-self.lr)


def reference(params0, inner_opt, lr, momentum, H, T, contributors, delayed=False, last=None):
    """θ_global (flat) after T outer steps. contributors[t]: original ranks averaged at outer step
    t, in ring order (every peer keeps training on its own data). delayed: async DiLoCo (average
    of step t applied at step t+1). last: inner steps of the last outer step (a partial round;
    None: H). Returns (theta, outer, pending average or None)."""
    inner = make_inner(inner_opt)
    ranks = sorted({r for c in contributors for r in c})
    states = {r: inner_opt.init(jax.tree.map(jnp.asarray, params0)) for r in ranks}
    theta = flat(params0)
    outer = NesterovRef(lr, momentum)
    pending = None
    for t in range(T):
        deltas = {}
        for r in contributors[t]:
            p = jax.tree.map(jnp.asarray, unflat(theta, params0))
            for i in range(H if last is None or t < T - 1 else last):
                p, states[r] = inner(p, states[r], batch(r, t * H + i))
            deltas[r] = theta - flat(p)
        avg = ring_avg([deltas[r] for r in contributors[t]])
        if not delayed:
            theta = outer.apply(theta, avg)
        else:
            if pending is not None:
                theta = outer.apply(theta, pending)
            pending = avg
    return theta, outer, pending
