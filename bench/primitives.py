"""`jaxodc bench primitives`: ODC gather / scatter-accumulate (shm and tcp) against jax's
all_gather / psum_scatter over gloo on the same processes, plus memcpy bandwidth (the physical
limit), for several unit sizes at 2 and 4 ranks. Writes one JSON record per measurement.

    jaxodc bench primitives --json bench/out/primitives.json [--sizes-mb 1,4,16,64,256] [--ranks 2,4]

With --gpu the ranks run jax on CUDA (they may share one GPU): ODC over cuda_ipc (server memory on
the GPU, data GPU to GPU) and over nvshmem (forced on one host; left out when the NVSHMEM plugin is
not built) against the staged shm and tcp paths (device=None), plus the device's own
copy bandwidth (op memcpy, transport device). The gloo collectives are left out there: they are CPU
collectives, and NCCL needs one GPU per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import msgpack
import numpy as np

from jaxodc.bench.common import median_time, print_table, write_records
from jaxodc.launch.launcher import launch_ranks

MB = 1 << 20


def _reps(nbytes: int) -> int:
    return 3 if nbytes >= 128 * MB else 7


def worker(sizes_mb: list[int], out_path: str, gpu: bool = False) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxodc.launch.context import init_from_env, init_jax_distributed, shutdown
    from jaxodc.odc import Runtime
    from jaxodc.ops import odc_gather, odc_gather_into, odc_scatter_accumulate

    ctx = init_from_env()
    if gpu:
        assert jax.default_backend() == "gpu", "bench primitives --gpu: jax sees no GPU"
    else:
        init_jax_distributed(ctx)
    world, rank = ctx.world, ctx.rank
    numels = [mb * MB // 4 for mb in sizes_mb]
    records = []

    def slowest(name: str, seconds: float) -> float:
        return max(msgpack.unpackb(b) for b in ctx.allgather(name, msgpack.packb(seconds)))

    def record(op, transport, nbytes, seconds, **extra):
        records.append({"op": op, "transport": transport, "ranks": world, "bytes": nbytes,
                        "seconds": seconds, "gbps": nbytes / seconds / 1e9, **extra})

    sync = lambda: ctx.barrier("rep")  # noqa: E731 - untimed alignment of the ranks before each rep

    transports = ("shm", "tcp")
    if gpu:
        from jaxodc.odc.runtime import load_nvshmem_plugin
        why = load_nvshmem_plugin()
        if why and rank == 0:
            print(f"bench primitives: no nvshmem records: {why}", flush=True)
        transports = ("cuda_ipc",) + (() if why else ("nvshmem",)) + transports
    for transport in transports:
        # Staged transports keep host server memory (device=None) so they measure the staged path.
        rt = Runtime(numels, rank=rank, world=world, rendezvous=ctx.rendezvous,
                     job_id=f"{ctx.job_id}{transport}", transport=transport, timeout_s=300,
                     device="auto" if transport in ("cuda_ipc", "nvshmem") else None)
        rng = np.random.default_rng(rank)
        for u in range(len(numels)):
            rt.publish(u, rng.standard_normal(rt.shard_size(u)).astype(np.float32), 0)
        version = 0
        for u, numel in enumerate(numels):
            nbytes, reps = numel * 4, _reps(numel * 4)
            shard = jnp.asarray(rt.read_shard(u))
            # "fresh": XLA allocates the output each call (page faults dominate at large sizes);
            # "into": a persistent donated buffer, as a prefetching trainer would keep.
            gather = jax.jit(lambda s, v, u=u, n=numel: odc_gather(s, v, runtime=rt, unit=u, numel=n))
            gather(shard, 0).block_until_ready()
            t = median_time(lambda: gather(shard, 0).block_until_ready(), reps, sync)
            record("gather", transport, nbytes, slowest(f"g{transport}{u}", t), variant="fresh")
            gather_into = jax.jit(lambda b, s, v, u=u: odc_gather_into(b, s, v, runtime=rt, unit=u), donate_argnums=0)
            buffer = [gather_into(jnp.zeros(numel, jnp.float32), shard, 0)]

            def gather_persistent():
                buffer[0] = gather_into(buffer[0], shard, 0)
                buffer[0].block_until_ready()

            t = median_time(gather_persistent, reps, sync)
            record("gather", transport, nbytes, slowest(f"gi{transport}{u}", t), variant="into",
                   slot_bytes=rt.stats()["slot_bytes"], max_unit_bytes=max(numels) * 4)
            del buffer

            scatter = jax.jit(lambda s, g, v, u=u: odc_scatter_accumulate(s, g, v, runtime=rt, unit=u))
            grad = jnp.ones(numel, jnp.float32)

            def push_minibatch():
                nonlocal version
                scatter(shard, grad, version).block_until_ready()
                rt.done(version)
                rt.wait_complete(version)
                rt.fetch_grad(u)
                version += 1

            push_minibatch()
            t = median_time(push_minibatch, reps, sync)
            record("scatter_accumulate", transport, nbytes, slowest(f"s{transport}{u}", t))
        rt.close()

    if gpu:
        for numel in numels:
            nbytes, reps = numel * 4, _reps(numel * 4)
            if rank == 0:  # the physical limit: one read + one write of the unit by a kernel, alone
                x = jnp.ones(numel, jnp.float32)
                copy = jax.jit(lambda a: a + 1.0)
                copy(x).block_until_ready()
                record("memcpy", "device", nbytes, median_time(lambda: copy(x).block_until_ready(), reps))
            sync()
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(records, f)
        shutdown(ctx)
        return

    mesh = Mesh(np.array(jax.devices()), ("r",))
    for numel in numels:
        nbytes, reps = numel * 4, _reps(numel * 4)
        shard_n = -(-numel // world)
        x = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("r")), np.ones(shard_n, np.float32), (shard_n * world,))
        all_gather = jax.jit(jax.shard_map(lambda a: jax.lax.all_gather(a, "r", tiled=True), mesh=mesh,
                                           in_specs=P("r"), out_specs=P(), check_vma=False))
        all_gather(x).block_until_ready()
        t = median_time(lambda: all_gather(x).block_until_ready(), reps, sync)
        record("all_gather", "gloo", nbytes, slowest(f"ag{numel}", t))

        y = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("r")), np.ones((1, shard_n * world), np.float32), (world, shard_n * world))
        psum_scatter = jax.jit(jax.shard_map(
            lambda a: jax.lax.psum_scatter(a[0], "r", scatter_dimension=0, tiled=True)[None], mesh=mesh,
            in_specs=P("r"), out_specs=P("r")))
        psum_scatter(y).block_until_ready()
        t = median_time(lambda: psum_scatter(y).block_until_ready(), reps, sync)
        record("psum_scatter", "gloo", nbytes, slowest(f"ps{numel}", t))

        if rank == 0:  # the physical limit, measured alone
            src, dst = np.ones(numel, np.float32), np.empty(numel, np.float32)
            np.copyto(dst, src)
            record("memcpy", "local", nbytes, median_time(lambda: np.copyto(dst, src), reps))
        sync()

    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(records, f)
    shutdown(ctx)


def summarize(records: list[dict]) -> list[str]:
    """Bar ratios at 64 MB and 2 ranks (where present)."""
    def gbps(op, transport, variant=None, ranks=2, nbytes=64 * MB):
        return next((r["gbps"] for r in records if r["op"] == op and r["transport"] == transport
                     and r.get("variant") == variant and r["ranks"] == ranks and r["bytes"] == nbytes), None)
    lines = []
    ci, cs, dm = gbps("gather", "cuda_ipc", "into"), gbps("scatter_accumulate", "cuda_ipc"), gbps("memcpy", "device")
    si, ss = gbps("gather", "shm", "into"), gbps("scatter_accumulate", "shm")
    if None not in (ci, cs, si, ss):
        lines.append(f"64 MB, 2 ranks (GPU): cuda_ipc / staged shm = {ci / si:.2f}x gather (into), "
                     f"{cs / ss:.2f}x scatter_accumulate")
    if None not in (ci, dm):
        lines.append(f"64 MB, 2 ranks (GPU): cuda_ipc gather / device copy kernel = {ci / dm:.2f}x")
    ni, ns = gbps("gather", "nvshmem", "into"), gbps("scatter_accumulate", "nvshmem")
    if None not in (ni, ns, ci, cs):
        lines.append(f"64 MB, 2 ranks (GPU): nvshmem / cuda_ipc = {ni / ci:.2f}x gather (into), "
                     f"{ns / cs:.2f}x scatter_accumulate")
    gi, gf = gbps("gather", "shm", "into"), gbps("gather", "shm", "fresh")
    ag, mc = gbps("all_gather", "gloo"), gbps("memcpy", "local")
    s, ps = gbps("scatter_accumulate", "shm"), gbps("psum_scatter", "gloo")
    if None not in (gi, gf, ag, mc, s, ps):
        lines.append(f"64 MB, 2 ranks: shm gather / gloo all_gather = {gi / ag:.2f}x into a persistent buffer, "
                     f"{gf / ag:.2f}x with a fresh output (bar >= 1.5)")
        lines.append(f"64 MB, 2 ranks: shm gather / memcpy = {gi / mc:.2f}x into a persistent buffer, "
                     f"{gf / mc:.2f}x with a fresh output (bar >= 0.5)")
        lines.append(f"64 MB, 2 ranks: shm scatter_accumulate / gloo psum_scatter = {s / ps:.2f}x (bar >= 1.2)")
    seen = set()
    for r in records:
        if r["op"] == "gather" and "slot_bytes" in r and r["ranks"] not in seen:
            seen.add(r["ranks"])
            lines.append(f"{r['ranks']} ranks: receive slots hold {r['slot_bytes'] / MB:.3f} MB per rank; the "
                         f"largest unit is {r['max_unit_bytes'] / MB:.3f} MB (bound: one unit incl. padding)")
    return lines


# The ranks share one host: NVSHMEM bootstraps over loopback and needs no network transport.
GPU_ENV = {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": os.environ.get("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo"),
           "NVSHMEM_REMOTE_TRANSPORT": os.environ.get("NVSHMEM_REMOTE_TRANSPORT", "none")}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxodc bench primitives")
    p.add_argument("--json", help="write the records here")
    p.add_argument("--sizes-mb", default="1,4,16,64,256")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--gpu", action="store_true", help="ranks run jax on CUDA; adds the cuda_ipc and nvshmem transports")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    if args.worker:
        worker(sizes, args.out, gpu=args.gpu)
        return 0
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in (int(w) for w in args.ranks.split(",")):
            out = os.path.join(tmp, f"w{world}.json")
            launch_ranks(world, "jaxodc.bench.primitives",
                         ["--worker", "--sizes-mb", args.sizes_mb, "--out", out] + (["--gpu"] if args.gpu else []),
                         timeout_s=1800,
                         env=GPU_ENV if args.gpu else None)
            with open(out) as f:
                records += json.load(f)
    records.sort(key=lambda r: (r["ranks"], r["bytes"], r["op"], r["transport"], r.get("variant", "")))
    keys = ("op", "transport", "ranks", "bytes", "seconds", "gbps", "variant")
    write_records(args.json, [{k: r[k] for k in keys if k in r} for r in records])
    rows = [dict(r, MB=r["bytes"] / MB) for r in records]
    print_table(rows, ["ranks", "MB", "op", "transport", "variant", "seconds", "gbps"])
    for line in summarize(records):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
