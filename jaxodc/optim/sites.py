"""One training job across sites: ODC-sharded training inside each site (a group of W ranks on
fast links) and, across sites, DiLoCo / async DiLoCo or hybrid sharding through the fault-tolerant
communicator over slow links. Design, reasons and measurements: docs/sites.md.

Rank r of every site owns the same shard of every unit, so the outer exchange needs no leader and
no gather inside a site: rank r joins communicator group r ("ring r"), which carries shard r
across the sites, and the W rings run in parallel. A site is the unit of membership: its ranks
admit newcomers only at an outer step where every ring of the site sees them pending (the rings'
answers are consensus answers, so every site decides the same), so a new site joins all W rings
at the same outer step; a site whose rank dies is ended whole by its launcher, and the rings'
survivors retry without it.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import optax

from jaxodc.comm.communicator import CommError, Communicator
from jaxodc.optim.diloco import DiLoCo

MODES = ("diloco", "hybrid")
GRAD_TAG = 7000  # hybrid sharding's per-minibatch gradient all-reduce (DiLoCo's reducer uses its own)


@dataclass(frozen=True)
class SiteConfig:
    """How this site trains with the others.

    Args:
      address: "host:port" of the coordination service every site's ranks register with.
      secret: the job's shared secret (authenticates every connection).
      mode: "diloco" (H inner minibatches, then the pseudo-gradient is averaged across sites) or
        "hybrid" (each minibatch's gradient is averaged across sites before the owners' optimizer
        step: hybrid sharding, any optimizer, fixed membership).
      inner_steps: H, inner minibatches per outer step (diloco).
      asynchronous: async DiLoCo: each outer all-reduce overlaps the next H inner minibatches and
        is applied one outer step late.
      quantize: None or "uint8" / "uint16": the pseudo-gradient's transfer format (the
        communicator's, bit-identical on every peer).
      outer_lr, outer_momentum: the outer optimizer, SGD with Nesterov momentum (momentum 0:
        plain SGD; lr 1, momentum 0 and H = 1 with an SGD inner optimizer is hybrid sharding).
      wan: the emulated link between sites (`jaxodc.odc.Link(mbps, ms)`), None for none.
      timeout_s: how long any wait on the service or a peer may take.
      founders: the founding sites: training starts once this many are in every ring (so that
        they start from the same step). Sites started later join a running job (SiteRank's join).
      join_poll_s: a joining site's ranks compare, this often, whether all of them were voted in;
        a partial admission (a site elsewhere died in the middle of it) is backed out and retried.
      heartbeat_timeout_s: this site's ranks give the service up after this long without a frame
        from it, and a cross-site ring transfer stalled this long fails (match the service's
        --heartbeat-timeout: a partitioned site is then noticed on both sides at once).
      rejoin_s: a site that lost the service (diloco) registers again for up to this long and is
        voted back in at its next outer step, fetching the shared state (DiLoCo's rejoin_s); 0
        ends it instead.
    """

    address: str
    secret: bytes = b""
    mode: str = "diloco"
    inner_steps: int = 16
    asynchronous: bool = False
    quantize: str | None = None
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    wan: object | None = None
    timeout_s: float = 60.0
    founders: int = 1
    join_poll_s: float = 5.0
    heartbeat_timeout_s: float = 10.0
    rejoin_s: float = 0.0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"site mode must be one of {MODES}, got {self.mode!r}")
        if int(self.inner_steps) < 1:
            raise ValueError(f"inner_steps (H) must be >= 1, got {self.inner_steps}")
        if self.mode == "hybrid" and self.asynchronous:
            raise ValueError("hybrid sharding averages every minibatch's gradient: it has no async form")
        if self.quantize not in (None, "uint8", "uint16"):
            raise ValueError(f"quantize must be None, 'uint8' or 'uint16', got {self.quantize!r}")

    def outer_optimizer(self) -> optax.GradientTransformation:
        sgd = optax.sgd(self.outer_lr, momentum=self.outer_momentum or None, nesterov=self.outer_momentum > 0)
        # the count is shared state: a newcomer learns at which outer step the job is
        return optax.chain(sgd, optax.scale_by_schedule(lambda count: 1.0))


@dataclass
class OuterRecord:
    """One outer step (diloco) or minibatch (hybrid) of one rank."""

    site: int
    rank: int
    outer_step: int          # the job's count of outer updates when the step began
    inner: int               # inner minibatches run
    loss: float              # the site's mean minibatch loss over the inner minibatches
    tokens: int              # the site's tokens over them (every rank's)
    seconds: float           # wall time of the whole outer step
    compute_s: float         # of which the inner minibatches
    sites: int               # sites in this rank's ring after the step
    bytes_sent: int          # this rank's cross-site bytes during the step (async: what the
                             # background all-reduce sent meanwhile)
    state_hash: int          # the ring's shared state (diloco) or this rank's shards (hybrid)
    retries: int = 0         # outer all-reduces of this rank re-run after a failure, so far
    events: list = field(default_factory=list)  # membership changes seen at this step


def site_minibatches(n_samples: int, per_rank: int, world: int, site: int, outer_step: int, count: int,
                     seed: int = 0) -> list[np.ndarray]:
    """Site `site`'s global minibatches `outer_step * count` .. +count: every site draws its own
    seeded stream (sites see different data), a pure function of its arguments so that a
    newcomer, a restarted site and a reference compute the same ones."""
    from jaxodc.data import minibatches
    stream = minibatches(n_samples, world * per_rank, seed=seed + 7919 * (site + 1), epochs=None)
    return list(itertools.islice(stream, outer_step * count, (outer_step + 1) * count))


def _outer_count(outer_state) -> int:
    return int(np.asarray(outer_state[1].count))


class SiteRank:
    """This rank's part of a cross-site job, around its site's ODC `Trainer`.

    Args:
      trainer: the site's `jaxodc.train.api.Trainer` with comm="odc" (any balancer).
      config: a `SiteConfig`, the same on every rank of every site.
      site: this site's id (for records and logs).
      join: this site joins a running job: it is voted in at the job's next outer step and fetches
        θ_global and the outer optimizer state (diloco only); otherwise it is one of the founders
        (site 0 founds the rings, so it must be one).

    Example:
      >>> rank = SiteRank(trainer, SiteConfig(address, secret, inner_steps=16), site=0)
      >>> while rank.outer_step_count() < 100:
      ...     rank.outer_step(samples, site_minibatches(len(samples), 4, W, 0, rank.outer_step_count(), 16))
      >>> rank.close()
    """

    def __init__(self, trainer, config: SiteConfig, site: int = 0, join: bool = False):
        if trainer.comm != "odc":
            raise ValueError(f"site {site}: cross-site training shards with ODC inside a site; got comm={trainer.comm!r}")
        self.trainer, self.config, self.site = trainer, config, int(site)
        self.state = trainer.state
        hb = config.heartbeat_timeout_s
        self.comm = Communicator(config.address, peer_group=trainer.rank, secret=config.secret,
                                 timeout_s=config.timeout_s, link=config.wan, heartbeat_s=min(0.5, hb / 10),
                                 master_timeout_s=hb, ring_timeout_s=hb).connect()
        self.diloco: DiLoCo | None = None
        try:
            if join and config.mode == "hybrid":
                raise ValueError(f"site {site}: hybrid sharding keeps its founding sites; only DiLoCo sites join")
            if not join:  # a joining site is admitted by DiLoCo.begin_outer, as the others reach it
                self._await_founders()
            if config.mode == "hybrid":  # membership stays the founding sites (and survivors)
                self.state.grad_exchange = self._average_gradients
                self._steps = 0
            else:
                self.diloco = DiLoCo(self.comm, None, config.outer_optimizer(), config.inner_steps,
                                     asynchronous=config.asynchronous, quantize=config.quantize,
                                     agree=self._every_rank, admit=self._join_every_ring,
                                     rejoin_s=config.rejoin_s).init(self.state.local_shards())
        except BaseException:
            self.comm.close()
            raise

    def _await_founders(self) -> None:
        """Site 0 founds every ring; the other founders join it (all rings or none) and, with it,
        admit the rest until every ring holds all of them. Like an outer step, a newcomer is
        admitted only when every ring sees it pending, and the loop ends on a site-wide
        condition, so this site's ranks make the same calls. (Were any founder allowed to found,
        ring 0 could be founded by one site and ring 1 by another, each site then blocked half
        in its rings.)"""
        comm, deadline = self.comm, time.monotonic() + self.config.timeout_s
        if self.site == 0:
            comm.update_topology(timeout_s=self.config.timeout_s)
        else:
            self._join_every_ring()
        while True:
            worlds = [int(x) for x in self.trainer.ctx.allgather(
                "jaxodc/sites/founders", str(comm.world_size).encode(), timeout_s=self.config.timeout_s)]
            if min(worlds) >= self.config.founders:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._who()}: the rings of this site hold {worlds} of "
                                   f"{self.config.founders} founding sites after {self.config.timeout_s:g} s")
            if self._every_rank(comm.are_peers_pending()):
                comm.update_topology()
            else:
                time.sleep(0.05)

    def _join_every_ring(self) -> None:
        """A joining site enters all its rings at one outer step or none. The others admit it
        only where every ring sees it pending, but a site dying in the middle of that admission
        can abort it in one ring and not another; then the ranks that got in back out
        (reconnect, as if they had died: the rings' survivors retry without them) and every
        rank registers again."""
        comm, deadline = self.comm, time.monotonic() + 4 * self.config.timeout_s
        while True:
            try:
                comm.update_topology(timeout_s=self.config.join_poll_s, found=False)
                admitted = True
            except (TimeoutError, CommError):
                admitted = False
            votes = self.trainer.ctx.allgather("jaxodc/sites/joined", b"1" if admitted else b"0",
                                               timeout_s=self.config.timeout_s)
            if all(v == b"1" for v in votes):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._who()}: not voted into all {len(votes)} rings at one outer step "
                                   f"within {4 * self.config.timeout_s:g} s (admitted: {[v == b'1' for v in votes]})")
            comm.reconnect()

    def _who(self) -> str:
        return f"site {self.site} rank {self.trainer.rank}"

    def _every_rank(self, pending: bool) -> bool:
        """Admit only when every ring of this site has newcomers pending (see the module doc)."""
        votes = self.trainer.ctx.allgather("jaxodc/sites/admit", b"1" if pending else b"0",
                                           timeout_s=self.config.timeout_s)
        return all(v == b"1" for v in votes)

    # --- hybrid sharding ---------------------------------------------------------------------

    def _average_gradients(self, grads: dict[str, np.ndarray], global_tokens: float) -> dict[str, np.ndarray]:
        """Each site's owner holds its shard's gradient normalised by its site's tokens; the
        token-weighted average over sites is the gradient normalised by the union's tokens."""
        names = list(grads)
        n = np.float32(global_tokens)
        buf = np.concatenate([np.asarray(grads[k], np.float32).ravel() * n for k in names] + [np.array([n])])
        total = self.comm.run_with_retry(self.comm.all_reduce, buf, op="sum", tag=GRAD_TAG)
        out, off = {}, 0
        for k in names:
            size = grads[k].size
            out[k] = (total[off:off + size] / total[-1]).reshape(grads[k].shape)
            off += size
        return out

    # --- the outer loop ----------------------------------------------------------------------

    def outer_step_count(self) -> int:
        """Outer updates the job has applied (shared state, so a newcomer knows it after its
        first sync; before that, 0). Hybrid: minibatches this rank has trained."""
        if self.diloco is None:
            return self._steps
        # async: the average in flight is an outer step the count does not show yet
        return _outer_count(self.diloco.outer_state) + (self.diloco._pending is not None)

    def begin(self) -> list[str]:
        """Joins or admits newcomers and syncs the shared state (diloco); returns the membership
        changes seen. Called by outer_step; a loop that chooses its data by outer_step_count()
        calls it first so that a newcomer's count is the job's."""
        if self.diloco is None or self.diloco._begun:
            return []
        before = (self.comm.accepted, self.comm.world_size, self.diloco.rejoins)
        self.diloco.begin_outer()
        # θ_local <- θ_global, published to the site (every rank together, between minibatches)
        self.state.load_local_state(self.diloco.global_params, self.state.opt_state, self.state.version)
        events = []
        rejoined = self.diloco.rejoins != before[2]  # lost the service in here, and came back
        if rejoined:
            events.append("lost the coordination service: registered again")
        if not before[0] or rejoined:
            events.append(f"joined: ring of {self.comm.world_size} site(s)"
                          + (f", state fetched ({self.diloco.last_sync.bytes_received} bytes)"
                             if self.diloco.last_sync and self.diloco.last_sync.keys_fetched else ""))
        elif self.comm.world_size != before[1]:
            events.append(f"sites {before[1]} -> {self.comm.world_size}")
        return events

    def outer_step(self, samples: Sequence[np.ndarray], minibatches: Sequence[Sequence[int]],
                   on_minibatch: Callable | None = None, on_exchange: Callable | None = None) -> OuterRecord:
        """Trains the inner minibatches (H for diloco; hybrid: any number, each averaged across
        sites) and then the outer step. Every rank of every site calls it together.
        `on_minibatch(record)` runs after each inner minibatch and `on_exchange()` just before the
        outer all-reduce (progress lines, churn tests)."""
        t0 = time.perf_counter()
        sites0 = self.comm.world_size
        events = self.begin()
        count = self.outer_step_count()
        sent0 = self.bytes_sent()
        tc = time.perf_counter()
        recs = []
        for mb in minibatches:
            recs += self.trainer.fit(samples, [mb])
            if on_minibatch is not None:
                on_minibatch(recs[-1])
        compute = time.perf_counter() - tc
        if self.diloco is not None:
            if on_exchange is not None:
                on_exchange()
            self.diloco.params = self.state.local_shards()
            rejoins = self.diloco.rejoins
            self.diloco.outer_step()
            digest = self.diloco.state_hash()
            if self.diloco.rejoins != rejoins:  # the others stepped without it: digest is stale
                events.append("lost the coordination service: registered again, rejoins at the next outer step")
        else:
            self._steps += len(recs)
            from jaxodc.comm import shared_state as ss
            digest = ss.combined_hash(ss.state_hashes(self.state.local_shards()))
        if self.comm.world_size < sites0 and not events:
            events.append(f"sites {sites0} -> {self.comm.world_size}")
        tokens = np.sum([int(x) for x in self.trainer.ctx.allgather(
            "jaxodc/sites/tokens", str(sum(r.tokens for r in recs)).encode(), timeout_s=self.config.timeout_s)])
        return OuterRecord(site=self.site, rank=self.trainer.rank, outer_step=count, inner=len(recs),
                           loss=float(np.mean([r.loss for r in recs])) if recs else float("nan"),
                           tokens=int(tokens), seconds=time.perf_counter() - t0, compute_s=compute,
                           sites=self.comm.world_size, bytes_sent=self.bytes_sent() - sent0,
                           state_hash=int(digest), events=events,
                           retries=0 if self.diloco is None else self.diloco.reducer.retries)

    def finish(self) -> None:
        """Async DiLoCo: applies the average still in flight and publishes θ_global to the site."""
        if self.diloco is not None and self.diloco._pending is not None:
            self.diloco.flush()
            self.state.load_local_state(self.diloco.global_params, self.state.opt_state, self.state.version)

    def global_shards(self) -> dict[str, np.ndarray]:
        """This rank's shard of θ_global (diloco) or of the parameters (hybrid)."""
        if self.diloco is None:
            return self.state.local_shards()
        return {k: np.asarray(v) for k, v in self.diloco.global_params.items()}

    def bytes_sent(self) -> int:
        """Cross-site bytes this rank has sent so far (its ring endpoint's count)."""
        return int(self.comm.ep.stats()["bytes_sent"])

    def close(self) -> None:
        """Leaves the communicator (the rings' survivors go on without this site)."""
        if self.diloco is None:
            self.state.grad_exchange = None
        self.comm.close()
