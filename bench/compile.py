"""`jaxodc bench compile`: what unrolling a scanned layer stack costs at compile time.

    python -m jaxodc bench compile --json bench/out/compile.json

The sharded trainers unroll an `nn.scan` stack so each layer's unit is gathered where it is used
(docs/any_model.md, "Scan: unrolled, not kept"). One record per depth: the time to trace the loss
and find its units (`plan_s`) and to compile the sharded microbatch gradient for 2 ranks
(`sharded_compile_s`, identity gathers: no communication), beside the compile time of the plain
single-process `jax.value_and_grad` of the same loss, whose scan is kept (`plain_compile_s`).
The linen Llama (models/llama.py, `nn.scan(nn.remat)` over layers).
"""
from __future__ import annotations

import argparse
import time

from jaxodc.bench.common import print_table, write_records


def _args(argv):
    p = argparse.ArgumentParser(prog="jaxodc bench compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the records here")
    p.add_argument("--layers", default="4,8,16,32", help="depths, comma-separated")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16)
    return p.parse_args(argv)


def measure(layers: int, d_model: int, tokens: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxodc.models.llama import Llama, LlamaConfig
    from jaxodc.modeling.adapters import linen_loss_fn
    from jaxodc.modeling.program import program_of

    cfg = LlamaConfig(n_layers=layers, d_model=d_model, ffn=2 * d_model, vocab=64, scan_axis=1, tie_embeddings=True)
    batch = {"tokens": np.ones((1, tokens), np.int32), "targets": np.ones((1, tokens), np.int32),
             "segment_ids": np.ones((1, tokens), np.int32), "positions": np.arange(tokens, dtype=np.int32)[None],
             "loss_mask": np.ones((1, tokens), np.float32)}
    params = jax.jit(lambda k: Llama(cfg).init(k, batch))(jax.random.key(0))
    loss = linen_loss_fn(Llama(cfg), lambda apply, b: jnp.sum(apply(b)))

    start = time.perf_counter()
    program = program_of(loss, params, 2, example_batch=batch)
    plan_s = time.perf_counter() - start
    shards = {u.name: jax.ShapeDtypeStruct((u.shard,), jnp.float32) for u in program.layout.units}
    world = program.layout.world
    step = jax.jit(program.grad(lambda s, spec, ctx: jnp.tile(s, world), jnp.float32))
    start = time.perf_counter()
    step.lower(shards, program.consts, batch, jnp.float32(1.0), None).compile()
    sharded_s = time.perf_counter() - start
    plain = jax.jit(jax.value_and_grad(lambda p: loss(p, batch)))
    start = time.perf_counter()
    plain.lower(params).compile()
    plain_s = time.perf_counter() - start
    return {"layers": layers, "units": len(program.layout.units), "plan_s": plan_s,
            "sharded_compile_s": sharded_s, "plain_compile_s": plain_s, "ratio": sharded_s / plain_s}


def main(argv: list[str]) -> int:
    args = _args(argv)
    records = [measure(int(n), args.d_model, args.tokens) for n in args.layers.split(",")]
    write_records(args.json, records)
    print("compile time of the sharded step (scan unrolled, one unit per layer) against plain training (scan kept)")
    print_table(records, ["layers", "units", "plan_s", "sharded_compile_s", "plain_compile_s", "ratio"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
