"""Single-process references for cross-site training (tests/test_sites.py).

They share the model, data and minibatch choice with `jaxodc train --groups` (the CLI's model_of,
load_samples and jaxodc.optim.sites.site_minibatches) and nothing else: inner training is
jaxodc.train.reference.ReferenceTrainer (full parameters, plain optax, every sample packed on its
own), the cross-site average is a numpy mean and the outer Nesterov step is numpy."""
import numpy as np

from jaxodc.balance.packing import loss_tokens, pack
from jaxodc.cli.train import load_samples, parser
from jaxodc.cli.train_models import model_of
from jaxodc.modeling.program import program_of
from jaxodc.train.reference import ReferenceTrainer
from jaxodc.optim.sites import site_minibatches


# `jaxodc train --groups` flags of a small job (2 ranks per site) that the references replay in seconds
SMALL = ["--ranks", "2", "--minibatch", "2", "--max-tokens", "96", "--d-model", "32", "--layers", "1",
         "--heads", "2", "--clip", "0", "--lr", "3e-3", "--timeout", "240"]


def cli_args(argv: list[str]):
    return parser().parse_args(argv)


def _minibatch(samples, idx, max_tokens):
    mbs = [pack([samples.tokens[i]], max_tokens).as_dict() for i in idx]
    return mbs, loss_tokens([len(samples.tokens[i]) for i in idx])


def _setup(args):
    import optax
    model, params = model_of(args)
    samples = load_samples(args, args.ranks)
    return model, params, samples, optax.adam(args.lr)


def hybrid(args) -> dict:
    """Single-group training on the union of every site's minibatches, step by step."""
    model, params, samples, opt = _setup(args)
    ref = ReferenceTrainer(model, opt, params)
    for k in range(args.steps):
        idx = np.concatenate([site_minibatches(len(samples), args.minibatch, args.ranks, s, k, 1, seed=2)[0]
                              for s in range(args.groups)])
        ref.step(*_minibatch(samples, idx, args.max_tokens))
    return ref.numpy_params()


def diloco(args, asynchronous: bool) -> dict:
    """DiLoCo over the sites: H inner Adam steps per site from θ_global (each site keeps its own
    inner state), the sites' pseudo-gradients averaged, Nesterov SGD on θ_global; async applies
    each average one outer step late (and the last at the end)."""
    model, params, samples, opt = _setup(args)
    H, G = args.diloco, args.groups
    sites = [ReferenceTrainer(model, opt, params) for _ in range(G)]
    flat = lambda tree: {k: np.asarray(v, np.float64) for k, v in _leaves(tree).items()}
    theta = flat(params)
    mom = {k: np.zeros_like(v) for k, v in theta.items()}
    pending = None

    def apply(avg):
        for k in theta:
            mom[k] = avg[k] + args.outer_momentum * mom[k]
            theta[k] = theta[k] - args.outer_lr * (avg[k] + args.outer_momentum * mom[k])

    T = -(-args.steps // H)
    for t in range(T):
        deltas = []
        for s, ref in enumerate(sites):
            ref.params = _unleaves(params, {k: v.astype(np.float32) for k, v in theta.items()})
            for idx in site_minibatches(len(samples), args.minibatch, args.ranks, s, t, H, seed=2):
                ref.step(*_minibatch(samples, idx, args.max_tokens))
            local = flat(ref.params)
            deltas.append({k: theta[k].astype(np.float32) - local[k].astype(np.float32) for k in theta})
        avg = {k: np.mean([d[k] for d in deltas], axis=0) for k in theta}
        if asynchronous:
            if pending is not None:
                apply(pending)
            pending = avg
        else:
            apply(avg)
    if pending is not None:
        apply(pending)
    return _unleaves(params, {k: v.astype(np.float32) for k, v in theta.items()})


def _leaves(tree) -> dict:
    import jax
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _unleaves(like, flat: dict):
    import jax
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [flat[jax.tree_util.keystr(p)] for p, _ in paths])


def shards_of(args, params, rank: int) -> dict:
    """`params` cut the way rank `rank` of a site holds them (unit name -> flat shard)."""
    model, p0 = model_of(args)
    return {k: np.asarray(v) for k, v in program_of(model, p0, args.ranks).shard(params, rank).items()}


def check_shards(sites, args, expected, atol):
    """Every element of every site's final shards (a `PATH.siteS.json` each) against `expected`."""
    for site in sites:
        for rank, got in enumerate(site["shards"]):
            want = shards_of(args, expected, rank)
            assert set(got) == set(want)
            for unit, values in got.items():
                np.testing.assert_allclose(np.asarray(values, np.float32), want[unit], rtol=0, atol=atol,
                                           err_msg=f"site {site['site']} rank {rank} unit {unit}")


def same_on_every_site(sites):
    """Every site ends with the bits of site 0, shard by shard."""
    for rank in range(len(sites[0]["shards"])):
        for site in sites[1:]:
            for unit, values in site["shards"][rank].items():
                assert np.asarray(values).tobytes() == np.asarray(sites[0]["shards"][rank][unit]).tobytes(), \
                    f"site {site['site']} rank {rank} unit {unit} differs from site 0"
