"""`jaxodc train`: train a small model with the sharded trainer on local ranks, and print loss,
throughput and bubble rate per run. --model lm (default) is the unit-staged LM of models/lm.py;
--model llama the linen Llama of models/llama.py, trained unchanged through linen_loss_fn (units
discovered, each gathered where it is used). --model cnn (the linen BatchNorm CNN of
models/cnn.py) and --model nnx (the nnx classifier of models/nnx_mlp.py) train on scikit-learn's
8x8 digits, each image a fixed-length sample of 65 tokens (pixels, then the label:
jaxodc.data.decode_images), so balancing, packing and the trainers are the token path's; a
microbatch holds --max-tokens / 65 images (default 16) and the loss is the mean over images.
--model hf:DIR loads a Hugging Face checkpoint directory of the Llama family (jaxodc.modeling),
each rank reading only its own shards; --export-hf DIR writes the trained model back out as one.

    jaxodc train --ranks 2 --comm odc --balance lb_mini --steps 20 --minibatch 4 --max-tokens 256
    jaxodc train --comm collective,odc --balance lb_micro,lb_mini --timeline out.png   # compare
    jaxodc train --checkpoint ckpt --save-every 5 ... ; jaxodc train --checkpoint ckpt --resume ...
    jaxodc train --model llama --export llama.msgpack   # full params, loaded by flax.serialization
    jaxodc train --model cnn --comm odc,collective      # BatchNorm CNN on the digits
    jaxodc train --model hf:DIR --export-hf OUT         # a Hugging Face checkpoint in, and out again

Without `jaxodc launch` around it, the command starts --ranks local rank processes itself (one
compute thread each) and reports when they finish; started by `jaxodc launch -n N -m
jaxodc.cli.train ...` (or SLURM), every process is a rank and rank 0 reports.

Data: --preset (long-tailed sample lengths of byte-level stdlib text, the default), --lengths FILE
(your lengths, same text) or --data FILE.jsonl ({"text": ...} per line). With --task sft|grpo (or
--tokenizer DIR) --data is read by jaxodc.modeling.dataset: prompt / completion, chat messages and
text for sft, rollouts with rewards for grpo, tokenised with DIR's tokenizer.json and chat
template, the loss on the completion / assistant tokens only (add_task_arguments). Minibatches come from a
seeded shuffled stream, so --resume continues with the minibatch after the checkpoint's step;
--steps counts all minibatches, resumed ones included. The first --warmup minibatches of each run
(compilation) are left out of the throughput figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

from jaxodc.cli.train_models import (IMAGE_MODELS, MODELS, add_task_arguments, check_hf, check_task_args, hf_dir,
                                     hf_model_of, load_task_samples, model_of, task_data, task_kwargs, with_reference)

DEFAULT_MAX_TOKENS = 256  # image models: 16 images of jaxodc.data.IMAGE_TOKENS
BALANCE_NAMES = {"lb_mini": "LB-Mini", "lb_micro": "LB-Micro", "lb_steal": "LB-Steal", "local_sort": "LocalSort"}
COLLECTIVE_NOTE = ("(collective microbatch intervals include time blocked inside all_gather / psum_scatter, so its\n"
                   " measured bubble is a lower bound; ODC ranks block only on owners' publications)")
TIMELINE_TITLE = "per-rank compute (bars) and idle (gaps) per minibatch"


def _precision(text: str) -> str:
    """--precision's value, checked and in its canonical spelling (train.precision)."""
    from jaxodc.modeling.precision import precision_of
    try:
        return str(precision_of(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _model_name(text: str) -> str:
    """--model's value: one of MODELS or hf:DIR."""
    if text in MODELS or (text.startswith("hf:") and len(text) > 3):
        return text
    raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(MODELS)}, or hf:DIR)")


def parser(prog: str = "jaxodc train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Train a small model with the sharded trainer.")
    a = p.add_argument
    a("--model", default="lm", type=_model_name, help="lm: the unit-staged LM (models/lm.py); llama: the linen "
                                                    "Llama (models/llama.py) through linen_loss_fn; cnn: the linen "
                                                    "BatchNorm CNN (models/cnn.py) and nnx: the nnx classifier "
                                                    "(models/nnx_mlp.py), both on sklearn's 8x8 digits; hf:DIR "
                                                    "a Hugging Face checkpoint directory (Llama, Mistral, Qwen2)")
    a("--ranks", type=int, default=2, help="local ranks to start (ignored under jaxodc launch)")
    a("--comm", default="odc", help="odc, collective, or a comma list to compare runs")
    a("--balance", default=None, help="local_sort, lb_micro, lb_mini or lb_steal (comma list per run); "
                                      "default lb_mini for odc, lb_micro for collective")
    a("--steps", type=int, default=10, help="minibatches in total (a resumed run continues up to it)")
    a("--warmup", type=int, default=1, help="minibatches of this invocation left out of throughput")
    a("--minibatch", type=int, default=4, help="samples per rank per minibatch")
    a("--max-tokens", type=int, default=None, help="tokens per packed microbatch (the memory bound; default "
                                                   "256, or 16 images of 65 tokens for cnn / nnx)")
    a("--min-bucket", type=int, default=0, help="bucketed microbatch row lengths from this size (0: off)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, help="sample-length preset: longalign (default), swe, aime")
    src.add_argument("--lengths", metavar="FILE", help="file of sample lengths (stdlib text)")
    src.add_argument("--data", metavar="FILE.jsonl", help='jsonl file, one {"text": ...} per line')
    a("--samples", type=int, default=0, help="samples to draw from --preset (default ranks*minibatch*steps)")
    a("--d-model", type=int, default=64)
    a("--layers", type=int, default=2)
    a("--heads", type=int, default=4)
    a("--kv-heads", type=int, default=0, help="llama: key/value heads (grouped-query attention; 0: --heads)")
    a("--cost", default="", help="the balancers' cost model as a,b,c (a*s^2 + b*tokens + c per microbatch, e.g. "
                                  "calibrated seconds); default: CostModel.for_transformer(--d-model)")
    a("--lr", type=float, default=3e-3, help="adam learning rate")
    a("--clip", type=float, default=1.0, help="global-norm gradient clipping (0: off)")
    a("--seed", type=int, default=0, help="parameter init seed")
    a("--compress", default="none", help="TAGC gradient compression: none, default (the big non-attention "
                                         "matrices, kept fraction 0.05, sketch ratio 10) or key=value pairs "
                                         "over fraction, ratio, min_elems, seed")
    a("--precision", default="fp32", type=_precision,
      help="fp32, or bf16: gather, compute and send gradients in bf16 (fp32 master shards, optimizer, "
           "sums); bf16,reduce=fp32: the collective reduce-scatters in fp32; ,keep_inputs: float inputs "
           "stay fp32 (jaxodc.MixedPrecision)")
    a("--transport", default="auto", help="ODC transport between ranks: auto, shm or tcp")
    a("--collective-transport", default="gloo", choices=("gloo", "jaxodc"),
      help="the collective trainer's collectives: jax's (gloo on CPU) or jaxodc's lock-step shm / tcp ones")
    a("--link-mbps", type=float, default=0.0, help="emulate a link of this many Mbit/s on ODC's tcp transport")
    a("--link-ms", type=float, default=0.0, help="emulate this many ms of one-way latency on ODC's tcp transport")
    a("--host-cache", action=argparse.BooleanOptionalAction, default=None,
      help="odc across hosts: each remote shard fetched once per host and minibatch into the host's shared memory, "
           "the host's ranks gathering from it (default on, or $JAXODC_ODC_HOST_CACHE)")
    a("--reproducible", action="store_true",
      help="ODC owners sum pushes exactly (order-independent): the same seed, data and world give bit-identical "
           "parameters; 16 bytes per owned element instead of 4, under 3%% of throughput; CPU owners only "
           "(default: the fp32 sum, or $JAXODC_ODC_ACCUMULATE)")
    a("--straggle", default="none", help="inject slowdowns no plan foresees (a sleep after the microbatch): none, "
                                         "default (p=0.05,rank_p=0.05,factor=3) or key=value pairs over rank_p (chance a "
                                         "rank runs a minibatch factor x slower), p (chance a microbatch runs factor x "
                                         "slower wherever it runs), factor, rank + window=start:stop (that rank runs "
                                         "factor x slower in those minibatches), seed")
    a("--checkpoint", metavar="DIR", help="checkpoint directory (one sub-directory per run when comparing)")
    a("--resume", action="store_true", help="restore from --checkpoint when it holds a checkpoint")
    a("--save-every", type=int, default=0, help="also save every N minibatches (default: at the end only)")
    a("--export", metavar="PATH", help="write the trained full parameters as a Flax msgpack file (load with "
                                       "flax.serialization.msgpack_restore; one file per run when comparing)")
    a("--export-hf", metavar="DIR", help="--model hf: write the trained model as a Hugging Face directory "
                                         "(config.json, safetensors shards, index; one sub-directory per run "
                                         "when comparing)")
    a("--timeline", metavar="PNG", help="per-rank Gantt chart of compute vs idle")
    a("--json", metavar="PATH", help="write every rank's per-minibatch records here (each carries params_sha256, "
                                     "a hash of the run's final full parameters: equal hashes, equal bits)")
    a("--progress", action="store_true", help="progress bar instead of a line per minibatch")
    a("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed")
    a("--worker", action="store_true", help=argparse.SUPPRESS)
    add_task_arguments(p.add_argument_group("post-training data and objective (jaxodc.modeling)"))
    from jaxodc.cli import sites
    sites.add_arguments(p.add_argument_group("across sites (jaxodc.optim.sites)"))
    return p


def runs_of(args) -> list[tuple[str, str]]:
    """(comm, balance) per run from the comma lists (a single value applies to every run)."""
    comms = [c.strip() for c in args.comm.split(",") if c.strip()]
    bals = [b.strip() for b in args.balance.split(",") if b.strip()] if args.balance else []
    n = max(len(comms), len(bals), 1)
    if len(comms) not in (1, n) or len(bals) not in (0, 1, n):
        raise ValueError(f"--comm has {len(comms)} values and --balance {len(bals)}; give one or the same number")
    comms = comms * n if len(comms) == 1 else comms
    bals = bals * n if len(bals) == 1 else bals
    from jaxodc.balance.plan import validate_run
    runs = [(c, validate_run(c, bals[i] if bals else None, "--{name} {value}")) for i, c in enumerate(comms)]
    if len(set(runs)) != len(runs):
        raise ValueError(f"runs repeat: {runs}")
    return runs


def run_name(comm: str, balance: str) -> str:
    return f"{comm} + {balance}"


def pretty(name: str) -> str:
    comm, _, bal = name.partition(" + ")
    return f"{'ODC' if comm == 'odc' else comm} + {BALANCE_NAMES.get(bal, bal)}"


def check_args(args) -> None:
    from jaxodc.data import IMAGE_TOKENS
    images = args.model in IMAGE_MODELS
    if args.max_tokens is None:
        args.max_tokens = 16 * IMAGE_TOKENS if images else DEFAULT_MAX_TOKENS
    if images:
        if args.max_tokens % IMAGE_TOKENS:
            raise ValueError(f"--model {args.model}: --max-tokens {args.max_tokens} must be a multiple of "
                             f"{IMAGE_TOKENS} (an image is {IMAGE_TOKENS} tokens: 64 pixels, then the label)")
        if args.min_bucket or args.preset or args.lengths or args.data:
            raise ValueError(f"--model {args.model} trains on the digits, whole images per row: "
                             "--min-bucket, --preset, --lengths and --data do not apply")
    for k in ("ranks", "steps", "minibatch", "max_tokens"):
        if getattr(args, k) < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    if args.warmup < 0 or args.save_every < 0 or args.min_bucket < 0 or args.samples < 0:
        raise ValueError("--warmup, --save-every, --min-bucket and --samples must be >= 0")
    if args.resume and not args.checkpoint:
        raise ValueError("--resume needs --checkpoint DIR")
    if args.d_model % args.heads or (args.d_model // args.heads) % 2:
        raise ValueError(f"--d-model {args.d_model} must split into --heads {args.heads} heads of even size")
    if args.kv_heads < 0 or (args.kv_heads and args.heads % args.kv_heads):
        raise ValueError(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if args.kv_heads and args.model != "llama":
        raise ValueError("--kv-heads applies to --model llama")
    check_task_args(args)
    from jaxodc.compress import parse_compression
    parse_compression(args.compress)  # a bad setting fails here, naming it
    from jaxodc.train.straggle import parse_straggle
    parse_straggle(args.straggle)
    cost_of(args)
    if args.link_mbps < 0 or args.link_ms < 0:
        raise ValueError("--link-mbps and --link-ms must be >= 0")
    if (args.link_mbps or args.link_ms) and args.transport != "tcp":
        raise ValueError("--link-mbps / --link-ms emulate ODC's tcp transport: add --transport tcp")


def cost_of(args, width: int | None = None):
    """The balancers' CostModel: --cost a,b,c, or the transformer default for the model's width
    (`width`, else --d-model)."""
    from jaxodc.balance.cost import CostModel
    if not args.cost:
        return CostModel.for_transformer(width or args.d_model)
    try:
        return CostModel(*(float(x) for x in args.cost.split(",")))
    except (TypeError, ValueError) as e:
        raise ValueError(f"--cost {args.cost!r}: expected three numbers a,b,c >= 0 ({e})") from None


def check_writable_dir(path: str, flag: str) -> None:
    """Creates `path` if needed; raises OSError naming it unless this process can write there (the
    rank that writes at the end of training is rank 0, started from here)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OSError(f"{flag}: cannot create the directory {path}: {e.strerror or e}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise OSError(f"{flag}: the directory {path} is not writable")


def check_paths(args) -> None:
    """Every path argument, before anything trains: raises ValueError / OSError naming the flag,
    the path and what to do."""
    for flag in ("data", "lengths"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            what = "is a directory" if os.path.isdir(path) else "does not exist"
            raise ValueError(f"--{flag} {path} {what}; give the file to read")
        if path and not os.access(path, os.R_OK):
            raise ValueError(f"--{flag} {path} is not readable")
    ck = args.checkpoint
    if ck and os.path.exists(ck) and not os.path.isdir(ck):
        raise ValueError(f"--checkpoint {ck} is a file; give a directory (it is created if missing)")
    if args.resume and ck and not os.path.isdir(ck):
        raise ValueError(f"--resume: the checkpoint directory {ck} does not exist; check the path, or drop "
                         "--resume to train from scratch")
    if ck:
        check_writable_dir(ck, "--checkpoint")
    for flag in ("json", "timeline", "export"):
        if getattr(args, flag):
            path = getattr(args, flag)
            if os.path.isdir(path):
                raise ValueError(f"--{flag} {path} is a directory; give a file name")
            check_writable_dir(os.path.dirname(os.path.abspath(path)), f"--{flag}")


def load_samples(args, world: int, report: bool = False):
    """The run's samples (data.Samples); raises ValueError for unusable input. `report`: say how
    many --data records were cut to --max-tokens."""
    from jaxodc.data import Samples, load_digits, load_jsonl, load_lengths, stdlib_corpus, synthetic_text
    if args.model in IMAGE_MODELS:
        samples = load_digits()
    elif args.data and task_data(args):
        samples = load_task_samples(args)
    elif args.data:
        counts = {}
        samples = Samples(load_jsonl(args.data, max_len=args.max_tokens, counts=counts))
        if report and counts["truncated"]:
            print(f"jaxodc train: --data {args.data}: {counts['truncated']} of {counts['records']} records are "
                  f"longer than --max-tokens {args.max_tokens} and were cut to it", file=sys.stderr, flush=True)
    elif args.lengths:
        lengths = load_lengths(args.lengths)
        long = [(i, int(x)) for i, x in enumerate(lengths) if x > args.max_tokens]
        if long:
            raise ValueError(f"{args.lengths}: {len(long)} sample length(s) exceed --max-tokens {args.max_tokens} "
                             f"(first: sample {long[0][0]}, length {long[0][1]}); raise --max-tokens or drop them")
        short = [i for i, x in enumerate(lengths) if x < 2]
        if short:
            raise ValueError(f"{args.lengths}: sample {short[0]} has length 1; a sample needs >= 2 tokens")
        samples = Samples.from_corpus(stdlib_corpus(), lengths, seed=2)
    else:
        n = args.samples or world * args.minibatch * args.steps
        samples = synthetic_text(args.preset or "longalign", n, args.max_tokens, seed=1, min_len=min(8, args.max_tokens))
    if len(samples) < world * args.minibatch:
        raise ValueError(f"{len(samples)} samples cannot fill one minibatch of {args.minibatch} per rank x {world} ranks")
    return samples


def checkpoint_dir(args, run: tuple[str, str], n_runs: int) -> str | None:
    if not args.checkpoint:
        return None
    return args.checkpoint if n_runs == 1 else os.path.join(args.checkpoint, f"{run[0]}-{run[1]}")


def export_path(args, run: tuple[str, str], n_runs: int) -> str | None:
    """--export itself, or with several runs one file per run: model.odc-lb_mini.msgpack."""
    if not args.export or n_runs == 1:
        return args.export
    stem, ext = os.path.splitext(args.export)
    return f"{stem}.{run[0]}-{run[1]}{ext}"


def hf_export_dir(args, run: tuple[str, str], n_runs: int) -> str | None:
    if not args.export_hf:
        return None
    return args.export_hf if n_runs == 1 else os.path.join(args.export_hf, f"{run[0]}-{run[1]}")


# --------------------------------------------------------------------------- rank side

def worker(args) -> dict | None:
    """Train every run on this rank; returns {run name: every rank's records as dicts} on rank
    0 (None elsewhere) and writes it to --json when given."""
    from dataclasses import asdict

    from jaxodc.launch.context import init_from_env, init_jax_distributed, shutdown

    runs = runs_of(args)
    ctx = init_from_env()
    try:
        if any(c == "collective" for c, _ in runs):
            init_jax_distributed(ctx)  # before jax creates its backends
        samples = load_samples(args, ctx.world, report=ctx.rank == 0 and not args.worker)
        out = {run_name(*run): [asdict(r) for r in _train_run(args, ctx, samples, run, len(runs))] for run in runs}
    except BaseException:
        ctx.rendezvous.close()  # no final barrier: the other ranks may be stuck
        if ctx.server is not None:
            ctx.server.close()
        raise
    if ctx.rank == 0 and args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(args.json + ".tmp", args.json)
    shutdown(ctx)
    return out if ctx.rank == 0 else None


def _train_run(args, ctx, samples, run: tuple[str, str], n_runs: int):
    """One (comm, balance) run on this rank; returns every rank's timed records."""
    import optax

    from jaxodc.train import checkpoint
    from jaxodc.train.api import Trainer
    from jaxodc.optim.clipping import clip_by_global_norm
    from jaxodc.train.metrics import Progress

    comm, balance = run
    model, params = hf_model_of(args, ctx.world, comm) if hf_dir(args) else model_of(args)
    width = model.hf_config.hidden if hf_dir(args) else args.d_model
    samples = with_reference(args, model, params, samples)
    opt = optax.adam(args.lr)
    if args.clip > 0:
        opt = optax.chain(clip_by_global_norm(args.clip), opt)
    say = (lambda *a: print(*a, flush=True)) if ctx.rank == 0 else (lambda *a: None)
    from jaxodc.compress import parse_compression
    from jaxodc.odc import Link
    from jaxodc.train.straggle import parse_straggle
    odc_kwargs = {"transport": args.collective_transport} if comm != "odc" else {
        "transport": args.transport, "link": Link(args.link_mbps, args.link_ms) if args.link_mbps or args.link_ms else None,
        "host_cache": args.host_cache}
    trainer = Trainer(model, opt, comm=comm, balance=balance, max_tokens=args.max_tokens, params=params,
                      cost=cost_of(args, width), ctx=ctx, min_bucket=args.min_bucket or None,
                      compress=parse_compression(args.compress), precision=args.precision,
                      straggle=parse_straggle(args.straggle), reproducible=True if args.reproducible else None,
                      **task_kwargs(args), **odc_kwargs)
    with trainer:
        ck = checkpoint_dir(args, run, n_runs)
        if args.resume and checkpoint.exists(ck):
            say(f"{comm:>10} + {balance:<8} resumed from {ck} at minibatch {trainer.restore(ck)}")
        batches = trainer.minibatch_stream(len(samples), args.minibatch, args.steps, seed=2)
        bar = Progress(len(batches), f"{comm}+{balance}", enabled=args.progress and ctx.rank == 0)
        timed, saved = [], trainer.step
        runtime = getattr(trainer.state, "rt", None)
        fetched = (lambda: runtime.gather_wire_bytes) if hasattr(runtime, "gather_wire_bytes") else None
        for i, idx in enumerate(batches):
            before = fetched() if fetched else 0
            rec = trainer.fit(samples.tokens, [idx])[0]
            if fetched:  # gathered bytes that crossed the network in this minibatch
                rec = dataclasses.replace(rec, gather_wire_bytes=fetched() - before)
            if i >= args.warmup:
                timed.append(rec)
            if args.progress:
                bar.update(loss=rec.loss)
            else:
                wire = "" if rec.wire_bytes is None else f", gradient bytes sent {rec.wire_bytes / 1e6:.3g} MB"
                if rec.kept_fraction is not None:
                    wire += (f" (compressed pieces {rec.wire_bytes_selected / 1e6:.3g} MB, kept {rec.kept_fraction:.3f}, "
                             f"peeled {rec.peeled}, estimated {rec.estimated})")
                say(f"{comm:>10} + {balance:<8} minibatch {rec.step}: loss {rec.loss:.4f}{wire}")
            if ck and args.save_every and trainer.step % args.save_every == 0:
                trainer.save(ck)
                saved = trainer.step
        if ck and saved != trainer.step:
            trainer.save(ck)
        if ck:
            say(f"{comm:>10} + {balance:<8} checkpoint: {os.path.abspath(ck)} (minibatch {trainer.step})")
        export = export_path(args, run, n_runs)
        if export:
            say(f"{comm:>10} + {balance:<8} export: {trainer.export(export)} (minibatch {trainer.step})")
        export = hf_export_dir(args, run, n_runs)
        if export:
            say(f"{comm:>10} + {balance:<8} Hugging Face export: {trainer.export_hf(export)} "
                f"(minibatch {trainer.step})")
        digest = params_sha256(trainer.full_params())  # collective: every rank assembles them
        links = pair_transports(trainer.state, ctx.world, ctx.rank)
        records = trainer.gather_records([dataclasses.replace(r, transports=links) for r in timed])
        rows = {r.rank: r.transports for r in records}
        say(f"{comm:>10} + {balance:<8} transports (rank: to rank 0..{ctx.world - 1}): "
            + "; ".join(f"{k}: {' '.join(rows[k] or ['?'])}" for k in sorted(rows)))
        return [dataclasses.replace(r, params_sha256=digest) for r in records]


def pair_transports(state, world: int, rank: int) -> list[str] | None:
    """How this rank reaches each rank: the ODC runtime's transports, the lock-step group's
    links, or "gloo" for jax's collectives."""
    runtime = getattr(state, "rt", None)
    if runtime is not None and getattr(runtime, "transports", None) is not None:
        return list(runtime.transports)
    group = getattr(state, "group", None)
    if group is not None:
        return list(group.links)
    if getattr(state, "transport", None) == "gloo":
        return ["self" if r == rank else "gloo" for r in range(world)]
    return None


def params_sha256(params) -> str:
    """sha256 of full parameters, the same for every comm / balance / transport: each leaf's path,
    dtype, shape and bytes, in path order (two runs that agree in it hold bit-identical parameters)."""
    import hashlib

    import jax
    import numpy as np
    def host(x):  # typed PRNG keys (nnx's RNG state) hash by their key data
        if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.ascontiguousarray(x)

    h = hashlib.sha256()
    leaves = sorted(((jax.tree_util.keystr(p), host(x))
                     for p, x in jax.tree_util.tree_leaves_with_path(params)), key=lambda t: t[0])
    for path, x in leaves:
        h.update(f"{path}|{x.dtype.str}|{x.shape}|".encode())
        h.update(x.tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- report

def report(json_path: str, timeline: str | None, shown_json: str | None = None) -> None:
    """Table of final loss, samples/s, tokens/s and bubble per run, the speed-up of the second
    run over the first, and the timeline PNG."""
    from jaxodc.train.metrics import summarize
    from jaxodc.cli.timeline import load_runs
    runs = load_runs(json_path)
    summaries = {name: summarize(recs) for name, recs in runs.items() if recs}
    print()
    print(f"{'mode':<24}{'final loss':>12}{'samples/s':>12}{'tokens/s':>12}{'bubble':>10}{'grad MB/mb':>12}"
          f"{'end ms':>9}")
    for name, s in summaries.items():
        wire = [r.wire_bytes for r in runs[name] if r.wire_bytes is not None]
        mb = f"{sum(wire) / len(wire) / 1e6:>12.3g}" if wire else f"{'-':>12}"  # per rank and minibatch
        print(f"{name:<24}{s['loss']:>12.4f}{s['samples_per_s']:>12.2f}{s['tokens_per_s']:>12.0f}"
              f"{s['bubble_rate']:>10.1%}{mb}" + (f"{1e3 * s['end_s']:>9.2f}" if s.get("end_s") is not None else f"{'-':>9}"))
    for name in runs:
        if not runs[name]:
            print(f"{name:<24}  (no timed minibatches: raise --steps above --warmup)")
    if any(name.startswith("collective") for name in summaries):
        print(COLLECTIVE_NOTE)
    names = list(summaries)
    if len(names) == 2 and summaries[names[0]]["samples_per_s"] > 0:
        base, other = summaries[names[0]], summaries[names[1]]
        print(f"\n{pretty(names[1])} vs {pretty(names[0])}: {other['samples_per_s'] / base['samples_per_s']:.2f}x samples/s")
    if timeline and summaries:
        from jaxodc.cli.timeline import draw
        os.makedirs(os.path.dirname(os.path.abspath(timeline)), exist_ok=True)
        path = draw({n: runs[n] for n in summaries}, timeline, title=TIMELINE_TITLE)
        print(f"timeline: {os.path.abspath(path)}")
    if shown_json:
        print(f"records:  {os.path.abspath(shown_json)}")


# --------------------------------------------------------------------------- entry point

def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    launched = "JAXODC_RANK" in os.environ or "SLURM_PROCID" in os.environ
    try:
        check_args(args)
        runs_of(args)
        check_paths(args)
        if not launched:
            from jaxodc.launch.launcher import capacity_error
            if capacity_error(args.ranks, "--ranks"):
                raise ValueError(capacity_error(args.ranks, "--ranks"))
            load_samples(args, args.ranks, report=True)  # bad input fails here, before any rank starts
            from jaxodc.train.straggle import parse_straggle
            straggle = parse_straggle(args.straggle)
            if straggle is not None:
                straggle.check_world(args.ranks)
        check_hf(args, full=not (launched or args.worker))
        if args.export_hf:
            check_writable_dir(os.path.abspath(args.export_hf), "--export-hf")
        from jaxodc.cli import sites
        sites.check(args)
    except (ValueError, OSError) as e:
        print(f"jaxodc train: {e}", file=sys.stderr)
        return 2
    if sites.enabled(args):
        return _main_sites(args, launched)
    if args.worker:
        return _as_rank(worker, args)[0]
    tmp = None
    if not args.json:
        fd, tmp = tempfile.mkstemp(prefix="jaxodc_train_", suffix=".json")
        os.close(fd)
        args.json = tmp
    if hf_dir(args):
        args.model = "hf:" + os.path.abspath(hf_dir(args))
    for k in ("json", "timeline", "checkpoint", "export", "export_hf", "data", "lengths"):  # ranks may start elsewhere
        if getattr(args, k):
            setattr(args, k, os.path.abspath(getattr(args, k)))
    try:
        if launched:  # this process is one rank of a job someone else started
            status, out = _as_rank(worker, args)
            if status or out is None:  # failed, or not rank 0
                return status
        else:
            from jaxodc.launch.launcher import RanksFailed, launch_ranks
            try:
                launch_ranks(args.ranks, "jaxodc.cli.train", worker_argv(args), timeout_s=args.timeout)
            except RanksFailed as e:  # the launcher has said which rank failed and why
                return e.status
        report(args.json, args.timeline, None if tmp else args.json)
    finally:
        if tmp:
            os.unlink(tmp)
    return 0


def _as_rank(fn, args) -> tuple[int, object]:
    """Run this rank's part; a failure becomes one line naming the rank, the error (whose message
    names the file or peer) and what to do, with the traceback in a log file the line names."""
    import traceback
    rank = os.environ.get("JAXODC_RANK") or os.environ.get("SLURM_PROCID") or "0"
    try:
        return 0, fn(args)
    except Exception as e:  # noqa: BLE001 - reported in one line, in full in the log
        from jaxodc.launch.launcher import LOG_DIR_ENV
        log_dir = os.environ.get(LOG_DIR_ENV) or tempfile.gettempdir()
        path = os.path.join(log_dir, f"jaxodc_train_rank{rank}_{os.getpid()}.traceback")
        try:
            with open(path, "w") as f:
                f.write(traceback.format_exc())
            where = f"traceback in {path}"
        except OSError as werr:
            where = f"traceback not saved: {werr}"
        print(f"jaxodc train: rank {rank}: {type(e).__name__}: {e} -- {_advice(e)} ({where})",
              file=sys.stderr, flush=True)
        return 1, None


def _advice(e: Exception) -> str:
    """What a person can do about a rank's error."""
    from jaxodc.train.checkpoint import CheckpointError
    if isinstance(e, CheckpointError):
        return "restore the checkpoint, or train without --resume / with another --checkpoint"
    if isinstance(e, ConnectionError) or type(e).__name__ in ("PeerError", "OdcTimeoutError", "CommError"):
        return "another rank failed or is unreachable: look at its line"
    if isinstance(e, (OSError, ValueError)):
        return "fix the input or path named above and run again"
    return "this looks like a bug in jaxodc: report it with the traceback"


def _main_sites(args, launched: bool) -> int:
    """--groups / --coord: this process is a rank of one site, or starts every site here."""
    from jaxodc.cli import sites
    if args.worker or launched:
        sites.worker(args, model_of, load_samples)
        return 0
    tmp = None
    if not args.json:
        tmp = tempfile.mkdtemp(prefix="jaxodc_sites_")
        args.json = os.path.join(tmp, "records")
    args.json = os.path.abspath(args.json)
    try:
        status = sites.run_local(args, worker_argv(args))
        sites.report(args.json, args.groups)
    finally:
        if tmp:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    return status


def worker_argv(args) -> list[str]:
    """The rank processes' argv: this invocation's options plus --worker."""
    out = ["--worker"]
    for action in parser()._actions:
        if not action.option_strings or action.dest in ("help", "worker", "ranks", "timeout"):
            continue
        v = getattr(args, action.dest)
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            out += [flag] if v else []
        elif v is not None:
            out += [flag, str(v)]
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
