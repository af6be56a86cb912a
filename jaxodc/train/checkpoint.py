"""Checkpoints of the sharded trainers (CollectiveTrainer, OdcTrainer): every rank's fp32
parameter shards, optimizer state and TAGC error-feedback residuals, one file per rank plus a
manifest.

Format (version 1). A checkpoint is a directory DIR:

    DIR/manifest.json               the commit point, the same on every rank
    DIR/rank<r>-<tag>.msgpack       rank r's state of the save `tag`

manifest.json::

    {"format": "jaxodc.checkpoint", "version": 1, "tag": "<step>-<random>", "step": k,
     "world": W, "comm": "odc" | "collective", "layout_fingerprint": "<units.Layout.fingerprint>",
     "units": [{"name", "numel", "padded", "shard", "sharding"}, ...],  # layout order; sharding:
                                                                        # units.UnitSpec.sharding
     "opt_state": {"treedef": "<str of the local state's jax treedef>",
                   "leaves": [[shape, dtype], ...]},   # local leaves; a parameter's piece: its parameter's shape
     "model_state": [[path, shape, dtype], ...],   # mutable model state (modeling/state.py); absent without
     "residuals": [[name, elements], ...],  # TAGC error feedback (ShardedTrainer.local_residuals): per
                                            # compressed unit (collective) or range "unit@offset"
                                            # (ODC), fp32; absent without compression
     "files": [{"rank": r, "file": "rank<r>-<tag>.msgpack", "bytes": n, "crc32": c}, ...]}

rank<r>-<tag>.msgpack, a msgpack map::

    {"format": "jaxodc.checkpoint.rank", "version": 1, "tag", "rank", "world", "step",
     "shards": {unit name: fp32 little-endian bytes of the rank's shard (UnitSpec.shard elements)},
     "opt_state": [bytes of each local optimizer-state leaf, jax tree order, dtype/shape as in
                   the manifest],
     "model_state": [bytes of each mutable-state leaf (BatchNorm statistics: the same on every
                     rank), as in the manifest],                         # absent without
     "residuals": [fp32 little-endian bytes of each of the rank's residuals, as in the manifest]}
                                                                         # absent without

The optimizer state is stored as each rank holds it (optim.placement: the optimizer's own state
tree, parameter-shaped leaves as this rank's flat pieces of their parameter, the rest whole, such
as adam's count). A checkpoint of the state as it was before the optimizer was placed (leaves of
unit shards) has another structure and is refused, naming it. The two comm modes cut units
differently (units.py: ODC "contiguous", the collective "per_leaf"; a manifest without "sharding"
is contiguous), so a checkpoint of one mode restores into the other by resharding: every rank
sends its shards and its state's parameter pieces to every rank, which rebuilds each unit's
leaves (and each piece's parameter) and cuts its own part of the trainer's layout (padding zero). That holds the whole state on every rank for a moment; a restore into the same sharding
moves nothing.

Error-feedback residuals (compress=) are what each rank's compressed pushes have not delivered
yet; restoring them makes a resumed compressed run bit-identical to one that never stopped. They
restore into a trainer of the same comm mode and compressed pieces only (another setting's
residuals would be added to other elements): one that differs is refused, naming both. A
checkpoint without residuals (an uncompressed run's, or one written before they were saved)
restores into a compressed trainer with zero residuals, as a new trainer starts.

Atomicity: each file is written to a temporary name, fsynced and renamed (os.replace). A save
writes all rank files under a fresh tag, then the manifest (the commit), and only after every rank
committed removes the previous tag's files; a crash at any point leaves the previous checkpoint
(or the new one) complete. Every rank writes the manifest, so DIR need not be on a shared
filesystem: each host gets the manifest and its own ranks' files.

Every rank calls save / restore together (they exchange a few values through the trainer's
`allgather_obj`). restore checks world size, layout, optimizer-state structure, tag and checksums
on every rank before changing anything and, if any rank refuses, raises on every rank (naming
what differs and the rank) instead of leaving the others waiting.
"""
from __future__ import annotations

import glob
import json
import os
import secrets
import zlib

import jax
import jax.numpy as jnp
import msgpack
import numpy as np

FORMAT, VERSION = "jaxodc.checkpoint", 1
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored into this trainer (or is damaged)."""


# --------------------------------------------------------------------------- helpers

def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _opt_description(trainer, opt_state) -> dict:
    """The state's structure, the same on every rank: a parameter piece is described by its
    parameter's global shape (pieces differ in length from rank to rank)."""
    leaves, treedef = jax.tree_util.tree_flatten(opt_state)
    shapes = trainer.program.param_tree().shapes
    return {"treedef": str(treedef),
            "leaves": [[list(np.shape(x)) if p is None else list(shapes[p]), np.dtype(np.asarray(x).dtype).str]
                       for x, p in zip(leaves, sharded_state_leaves(trainer))]}


def _model_state(trainer) -> tuple[list, list[np.ndarray]]:
    """The manifest's description and the host values of the trainer's mutable model state
    (modeling/state.py), or ([], [])."""
    state = getattr(getattr(trainer, "program", None), "state", None)
    if state is None:
        return [], []
    consts = trainer.local_consts()
    values = [np.asarray(consts[i]) for i in state.consts]
    return [[p, list(x.shape), x.dtype.str] for p, x in zip(state.paths, values)], values


def _residual_description(residuals: dict) -> list:
    return [[name, int(np.size(x))] for name, x in residuals.items()]


def _units(layout) -> list[dict]:
    return [{"name": u.name, "numel": u.numel, "padded": u.padded, "shard": u.shard, "sharding": u.sharding}
            for u in layout.units]


def _saved_layout(layout, saved: list[dict]):
    """The trainer's layout as the checkpoint cut it (its units' sharding and padding), when only
    that differs; else None."""
    import dataclasses
    from jaxodc.modeling.units import Layout, SHARDINGS
    if len(saved) != len(layout.units):
        return None
    units = []
    for u, a in zip(layout.units, saved):
        kind = a.get("sharding", "contiguous")
        if a.get("name") != u.name or a.get("numel") != u.numel or kind not in SHARDINGS:
            return None
        if kind == u.sharding:
            units.append(u)
            continue
        if not isinstance(a.get("padded"), int) or a["padded"] % layout.world or a.get("shard") != a["padded"] // layout.world:
            return None
        units.append(dataclasses.replace(u, sharding=kind, padded=a["padded"]))
    return Layout(tuple(units), layout.world)


def sharded_state_leaves(trainer) -> list[int | None]:
    """For each optimizer-state leaf (jax tree order), the parameter whose local piece it is (the
    placed optimizer's, optim.placement), else None (kept whole on every rank)."""
    return list(trainer.optimizer.state_param)


def _rank_file(rank: int, tag: str) -> str:
    return f"rank{rank}-{tag}.msgpack"


def _agree(trainer, error: str | None, extra: list, what: str) -> list[list]:
    """Exchange (ok flag + `extra`) with every rank; if any rank has an error, raise on all of
    them: the failing ranks with their own message, the others naming the failing ranks.
    Returns every rank's `extra`."""
    got = trainer.allgather_obj([error is not None, *extra])
    bad = [r for r, g in enumerate(got) if g[0]]
    if error is not None:
        raise CheckpointError(error)
    if bad:
        raise CheckpointError(f"rank {trainer.rank}: {what} failed on rank(s) {bad} (see their errors); "
                              "nothing was changed")
    return [g[1:] for g in got]


# --------------------------------------------------------------------------- save

def save(trainer, path: str) -> str:
    """Write `trainer`'s checkpoint into directory `path` (created if needed); returns the
    manifest path. Collective over ranks: every rank calls it at the same step."""
    os.makedirs(path, exist_ok=True)
    rank, world, step = trainer.rank, trainer.world, int(trainer.version)
    shards = trainer.local_shards()
    opt_state = trainer.local_opt_state()
    opt_leaves = jax.tree_util.tree_leaves(opt_state)
    state_desc, state_values = _model_state(trainer)
    residuals = trainer.local_residuals()
    # One tag for all ranks: rank 0's random id (and every rank must be at the same step).
    got = trainer.allgather_obj([step, secrets.randbits(30)])
    steps = [g[0] for g in got]
    if len(set(steps)) != 1:
        raise CheckpointError(f"rank {rank}: ranks are at different steps, cannot save one checkpoint: "
                              + ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps)))
    tag = f"{step:08d}-{got[0][1]:08x}"
    blob = msgpack.packb({
        "format": FORMAT + ".rank", "version": VERSION, "tag": tag, "rank": rank, "world": world, "step": step,
        "shards": {n: np.ascontiguousarray(shards[n], "<f4").tobytes() for n in trainer.layout.names},
        "opt_state": [np.ascontiguousarray(x).tobytes() for x in opt_leaves],
        **({"model_state": [np.ascontiguousarray(x).tobytes() for x in state_values]} if state_desc else {}),
        **({"residuals": [np.ascontiguousarray(x, "<f4").tobytes() for x in residuals.values()]} if residuals else {}),
    })
    fname = _rank_file(rank, tag)
    err = None
    try:
        _write_atomic(os.path.join(path, fname), blob)
    except OSError as e:
        err = f"rank {rank}: cannot write checkpoint file {os.path.join(path, fname)}: {e}"
    crc = zlib.crc32(blob)
    meta = _agree(trainer, err, [len(blob), crc], "writing the checkpoint")
    manifest = {
        "format": FORMAT, "version": VERSION, "tag": tag, "step": step, "world": world,
        "comm": getattr(trainer, "comm", ""), "layout_fingerprint": trainer.layout.fingerprint(),
        "units": _units(trainer.layout), "opt_state": _opt_description(trainer, opt_state),
        **({"model_state": state_desc} if state_desc else {}),
        **({"residuals": _residual_description(residuals)} if residuals else {}),
        "files": [{"rank": r, "file": _rank_file(r, tag), "bytes": meta[r][0], "crc32": meta[r][1]}
                  for r in range(world)],
    }
    mpath = os.path.join(path, MANIFEST)
    err = None
    try:
        _write_atomic(mpath, json.dumps(manifest, indent=1).encode())
    except OSError as e:
        err = f"rank {rank}: cannot write {mpath}: {e}"
    _agree(trainer, err, [], "committing the checkpoint")
    # Everyone committed: the previous save's files of this rank are no longer referenced.
    for old in glob.glob(os.path.join(glob.escape(path), f"rank{rank}-*.msgpack*")):
        if os.path.basename(old) != fname:
            try:
                os.unlink(old)
            except FileNotFoundError:
                pass
    return mpath


# --------------------------------------------------------------------------- restore

def read_manifest(path: str) -> dict:
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath) as f:
            m = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path} ({MANIFEST} missing)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mpath}: unreadable checkpoint manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: not a jaxodc checkpoint manifest")
    if m.get("version") != VERSION:
        raise CheckpointError(f"{mpath}: checkpoint format version {m.get('version')}, this jaxodc reads {VERSION}")
    return m


def exists(path: str) -> bool:
    """True iff `path` holds a committed checkpoint manifest."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def _layout_difference(saved: list[dict], mine: list[dict]) -> str | None:
    if len(saved) != len(mine):
        return (f"the checkpoint has {len(saved)} units {[u['name'] for u in saved]}, "
                f"this trainer {len(mine)} {[u['name'] for u in mine]}")
    for i, (a, b) in enumerate(zip(saved, mine)):
        for k in ("name", "numel", "padded", "shard"):
            if a.get(k) != b[k]:
                return (f"unit {i} ({b['name']!r}): {k} is {a.get(k)!r} in the checkpoint, "
                        f"{b[k]!r} in this trainer")
    return None


def _opt_difference(saved: dict, mine: dict) -> str | None:
    if saved.get("treedef") != mine["treedef"]:
        return (f"optimizer-state structure differs: checkpoint {saved.get('treedef')}, "
                f"this trainer {mine['treedef']} (another optimizer; or a checkpoint saved before the "
                f"optimizer was placed on the model's own tree, whose state follows the units' shards: "
                f"restore it with the jaxodc that wrote it)")
    s, m = saved.get("leaves", []), mine["leaves"]
    if len(s) != len(m):
        return f"optimizer state has {len(s)} leaves in the checkpoint, {len(m)} in this trainer"
    for i, (a, b) in enumerate(zip(s, m)):
        if list(a[0]) != list(b[0]) or a[1] != b[1]:
            return (f"optimizer-state leaf {i}: shape/dtype {tuple(a[0])} {a[1]} in the checkpoint, "
                    f"{tuple(b[0])} {b[1]} in this trainer")
    return None


def _load_rank(trainer, path: str):
    """This rank's checks and payload; raises CheckpointError naming what differs."""
    rank, world = trainer.rank, trainer.world
    m = read_manifest(path)
    where = f"rank {rank}: checkpoint {path}"
    if m.get("world") != world:
        raise CheckpointError(f"{where} was saved by {m.get('world')} ranks; this trainer has world {world}")
    # Units cut the other way (the other comm mode, units.py): read in that layout, resharded by restore.
    saved = _saved_layout(trainer.layout, m.get("units", [])) or trainer.layout
    diff = _layout_difference(m.get("units", []), _units(saved))
    if diff is None and m.get("layout_fingerprint") != saved.fingerprint():
        diff = (f"layout fingerprint {m.get('layout_fingerprint')} in the checkpoint, "
                f"{saved.fingerprint()} in this trainer (leaf paths, shapes or dtypes differ)")
    if diff is not None:
        raise CheckpointError(f"{where}: parameter layout differs: {diff}")
    local = trainer.local_opt_state()
    mine = _opt_description(trainer, local)
    tree = trainer.program.param_tree()
    stored = [[list(np.shape(x)), dt] if p is None else [[tree.layouts(saved, rank)[p].length], dt]  # as saved
              for x, p, (_, dt) in zip(jax.tree_util.tree_leaves(local), sharded_state_leaves(trainer), mine["leaves"])]
    diff = _opt_difference(m.get("opt_state", {}), mine)
    if diff is not None:
        raise CheckpointError(f"{where}: {diff}")
    state_desc, _ = _model_state(trainer)
    if m.get("model_state", []) != state_desc:
        raise CheckpointError(f"{where}: mutable model state differs: {m.get('model_state', [])} ([path, shape, "
                              f"dtype] per leaf) in the checkpoint, {state_desc} in this trainer")
    mine_res = _residual_description(trainer.local_residuals())
    saved_res = m.get("residuals")
    if saved_res is not None and (saved_res != mine_res or m.get("comm") != trainer.comm):
        mine_desc = mine_res or "none (no compression)"
        raise CheckpointError(f"{where}: TAGC error-feedback residuals differ: {saved_res} ([name, elements]) saved "
                              f"by comm={m.get('comm')!r}, {mine_desc} in this trainer (comm={trainer.comm!r}); "
                              "restore into a trainer with the checkpoint's comm and compression setting")
    entry = next((f for f in m.get("files", []) if f.get("rank") == rank), None)
    if entry is None:
        raise CheckpointError(f"{where}: the manifest lists no file for rank {rank}")
    fpath = os.path.join(path, entry["file"])
    try:
        with open(fpath, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise CheckpointError(f"{where}: cannot read {fpath}: {e}") from None
    if len(blob) != entry["bytes"] or zlib.crc32(blob) != entry["crc32"]:
        raise CheckpointError(f"{where}: {fpath} is damaged ({len(blob)} bytes, crc32 {zlib.crc32(blob):08x}; "
                              f"the manifest says {entry['bytes']} bytes, crc32 {entry['crc32']:08x})")
    d = msgpack.unpackb(blob)
    if (d.get("tag"), d.get("rank"), d.get("world")) != (m["tag"], rank, world):
        raise CheckpointError(f"{where}: {fpath} belongs to save {d.get('tag')} of rank {d.get('rank')}, "
                              f"the manifest to save {m['tag']}")
    shards = {}
    for u in saved.units:
        x = np.frombuffer(d["shards"][u.name], "<f4")
        if x.shape != (u.shard,):
            raise CheckpointError(f"{where}: unit {u.name!r} shard has {x.size} elements, expected {u.shard}")
        shards[u.name] = x.astype(np.float32)
    leaves = [np.frombuffer(b, np.dtype(dt)).reshape(shape).copy()
              for b, (shape, dt) in zip(d["opt_state"], stored)]
    treedef = jax.tree_util.tree_structure(trainer.local_opt_state())
    model_state = [np.frombuffer(b, np.dtype(dt)).reshape(shape).copy()
                   for b, (_, shape, dt) in zip(d.get("model_state", []), state_desc)]
    residuals = None  # none saved: zeros (module docstring)
    if saved_res is not None:
        got = d.get("residuals", [])
        if len(got) != len(saved_res):
            raise CheckpointError(f"{where}: {fpath} holds {len(got)} residuals, the manifest lists {len(saved_res)}")
        residuals = {}
        for b, (name, n) in zip(got, saved_res):
            x = np.frombuffer(b, "<f4")
            if x.size != n:
                raise CheckpointError(f"{where}: residual {name!r} has {x.size} elements, expected {n}")
            residuals[name] = x.astype(np.float32)
    return int(m["step"]), m["tag"], shards, (treedef, leaves), model_state, saved, residuals


def _reshard(trainer, saved, shards: dict, treedef, leaves: list):
    """Every unit's shard and the optimizer state's parameter pieces, from the checkpoint's layout
    `saved` to the trainer's (module docstring); collective over ranks."""
    from jaxodc.modeling.units import flat_from_pieces, leaf_views
    from jaxodc.optim.pieces import assemble_host, cut_host
    layout, world, rank = trainer.layout, trainer.world, trainer.rank
    moved = [i for i, u in enumerate(saved.units) if u.sharding != layout.units[i].sharding]
    if not moved:
        return shards, leaves
    tree = trainer.program.param_tree()
    params = [(j, p) for j, p in enumerate(sharded_state_leaves(trainer)) if p is not None]
    local = [shards[layout.units[i].name] for i in moved] + [leaves[j] for j, _ in params]
    got = trainer.allgather_obj([[np.asarray(x).dtype.str, np.ascontiguousarray(x).tobytes()] for x in local])
    every = [[np.frombuffer(got[r][k][1], np.dtype(got[0][k][0])) for r in range(world)] for k in range(len(local))]
    shards, leaves = dict(shards), list(leaves)
    for k, i in enumerate(moved):
        u = layout.units[i].name
        pieces = [jnp.asarray(x) for x in leaf_views(saved[u], np.concatenate(every[k]))]
        a, b = layout[u].shard_range(rank)
        shards[u] = np.asarray(flat_from_pieces(layout[u], pieces))[a:b].astype(every[k][0].dtype)
    for k, (j, p) in enumerate(params, start=len(moved)):
        leaves[j] = cut_host(tree, layout, p, rank, assemble_host(tree, saved, p, every[k]))
    return shards, leaves


def restore(trainer, path: str) -> int:
    """Load the checkpoint in directory `path` into `trainer` (same world size, layout and
    optimizer-state structure) and set its step; returns the step. Collective over ranks."""
    err, payload = None, None
    try:
        payload = _load_rank(trainer, path)
    except CheckpointError as e:
        err = str(e)
    tag_id = int(payload[1].split("-")[1], 16) if payload else 0
    got = _agree(trainer, err, [payload[0] if payload else 0, tag_id], f"restoring checkpoint {path}")
    if len({(a, b) for a, b in got}) != 1:
        raise CheckpointError(f"rank {trainer.rank}: ranks read different saves of {path}: "
                              + ", ".join(f"rank {r}: step {a} id {b:08x}" for r, (a, b) in enumerate(got)))
    step, _, shards, (treedef, leaves), model_state, saved, residuals = payload
    shards, leaves = _reshard(trainer, saved, shards, treedef, leaves)  # every rank reads the same manifest
    trainer.load_local_state(shards, jax.tree_util.tree_unflatten(treedef, leaves), step)
    if model_state:
        trainer.load_model_state(model_state)
    trainer.load_residuals(residuals)
    return step
