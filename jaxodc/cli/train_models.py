"""What `jaxodc train --model / --task / --tokenizer` select: the model (the staged LM, the linen
Llama, the image models, a Hugging Face checkpoint read rank by rank), the post-training data and
objective (SFT masks, GRPO), and the checks of those options before any rank starts. The
building blocks live in jaxodc.models and jaxodc.modeling; this is their command-line wiring."""
from __future__ import annotations

import os

MODELS = ("lm", "llama", "cnn", "nnx")
IMAGE_MODELS = ("cnn", "nnx")  # trained on the digits (jaxodc.data.load_digits)


def hf_dir(args) -> str | None:
    """The checkpoint directory of --model hf:DIR, else None."""
    return args.model[3:] if args.model.startswith("hf:") else None


def hf_model_of(args, world: int, comm: str):
    """(program, abstract params) of --model hf:DIR for `world` ranks under `comm`: each rank's
    shards are read from the files when the trainer starts."""
    from jaxodc.modeling.hf_load import load_hf
    from jaxodc.modeling.rl import task_fields
    ckpt = load_hf(hf_dir(args))
    grpo = grpo_of(args) if args.task == "grpo" else None
    return (ckpt.program(world, comm=comm, max_tokens=args.max_tokens, loss=task_loss(args),
                         fields=task_fields(args.task, grpo)), ckpt.abstract_params())


def check_hf(args, full: bool) -> None:
    """--model hf:DIR / --export-hf: the checkpoint checked before any rank starts; `full`: every
    tensor against the model (this traces it, so not in a rank process, whose jax must first
    join jax.distributed), else config.json and the files' headers."""
    if args.export_hf and not hf_dir(args):
        raise ValueError("--export-hf writes a Hugging Face checkpoint: it needs --model hf:DIR")
    if not hf_dir(args):
        return
    from jaxodc.cli import sites
    if sites.enabled(args):
        raise ValueError("--model hf:DIR trains within one site; --groups / --coord do not take it yet")
    if full:
        from jaxodc.modeling.hf_load import load_hf
        cfg = load_hf(hf_dir(args)).config
    else:
        from jaxodc.modeling.hf_config import read_config
        from jaxodc.modeling.hf_load import index_tensors
        cfg = read_config(hf_dir(args))
        index_tensors(hf_dir(args))
    if not (args.data and args.data.endswith(".jsonl")) and cfg.vocab < 256:
        raise ValueError(f"--model {args.model}: vocab_size {cfg.vocab} < 256, and the data here are byte-level "
                         f"tokens (0..255)")


def model_of(args):
    """(model or loss_fn, initial params) for --model: the staged LM, or the linen Llama whose loss
    is the sum of its per-token losses on a packed microbatch (the trainer divides by the
    minibatch's token count), or an image model (image_model_of)."""
    import jax
    if args.model in IMAGE_MODELS:
        return image_model_of(args)
    if args.model == "lm":
        from jaxodc.models.lm import LM, LMConfig
        model = LM(LMConfig(vocab=vocab_of(args), d_model=args.d_model, n_layers=args.layers, n_heads=args.heads))
        return model, model.init(jax.random.PRNGKey(args.seed))
    from jaxodc.balance.packing import pack
    from jaxodc.models.llama import Llama, LlamaConfig
    from jaxodc.modeling.adapters import linen_loss_fn
    cfg = LlamaConfig(vocab=vocab_of(args), d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads or args.heads, ffn=4 * args.d_model)
    llama = Llama(cfg)
    params = jax.jit(llama.init)(jax.random.PRNGKey(args.seed), pack([], args.max_tokens).as_dict())
    loss_fn = linen_loss_fn(llama, task_loss(args))
    loss_fn.token_losses = llama.apply  # per-token cross entropy: GRPO's reference log-probs (with_reference)
    return loss_fn, params


def image_model_of(args):
    """(loss_fn, initial params) of --model cnn / nnx on packed digits: each image's cross entropy
    counted once per loss token (decode_images' weight), so the trainer's division by the
    minibatch's token count gives the mean over images. The CNN's BatchNorm statistics are its
    mutable state (the image-weighted mean over the minibatch's microbatches)."""
    import jax
    import jax.numpy as jnp

    from jaxodc.balance.packing import pack
    from jaxodc.data import decode_images
    example = pack([], args.max_tokens).as_dict()
    if args.model == "cnn":
        from jaxodc.models.cnn import CNN
        from jaxodc.modeling.adapters import linen_loss_fn
        cnn = CNN()
        params = jax.jit(cnn.init)(jax.random.PRNGKey(args.seed), decode_images(example)[0])

        def loss(apply, batch):
            images, weight = decode_images(batch)
            return jnp.sum(apply(images) * weight)
        return linen_loss_fn(cnn, loss, mutable=("batch_stats",)), params
    from flax import nnx

    from jaxodc.models.nnx_mlp import Classifier
    from jaxodc.modeling.adapters import nnx_loss_fn

    def nnx_loss(model, batch):
        images, weight = decode_images(batch)
        flat = {**images, "x": jnp.reshape(images["x"], (images["x"].shape[0], -1))}
        return jnp.sum(model(flat) * weight)
    return nnx_loss_fn(Classifier(d_in=64, width=args.d_model, n_blocks=args.layers, n_classes=10,
                                  rngs=nnx.Rngs(args.seed)), nnx_loss)


# --------------------------------------------------------------------------- post-training data and objective

def add_task_arguments(g) -> None:
    """--task, --tokenizer, --truncation and GRPO's settings."""
    g.add_argument("--task", default=None, choices=("sft", "grpo"),
                   help="sft: --data is prompt/completion, chat messages or text JSONL, trained on the completion / "
                        "assistant tokens; grpo: --data is rollouts (prompt, completion, reward or advantage, "
                        "optional logprobs / ref_logprobs) trained with GRPO's clipped objective")
    g.add_argument("--tokenizer", metavar="DIR", help="a directory with tokenizer.json (and tokenizer_config.json with "
                                                     "its chat template); default: bytes")
    g.add_argument("--truncation", default="right", choices=("right", "drop", "error"),
                   help="a sample over --max-tokens: keep its first --max-tokens tokens (right), drop it, or stop")
    g.add_argument("--clip-eps", type=float, default=0.2, help="grpo: the ratio's clip range below 1")
    g.add_argument("--clip-eps-high", type=float, default=None, help="grpo: the clip range above 1 (default --clip-eps)")
    g.add_argument("--kl", type=float, default=0.0, help="grpo: weight of the KL term against the initial weights "
                                                         "(the rollouts' ref_logprobs, else computed from them)")


def task_data(args) -> bool:
    """Whether --data is read by jaxodc.modeling.dataset (--task or --tokenizer given)."""
    return args.task is not None or args.tokenizer is not None


def check_task_args(args) -> None:
    if args.task is None and args.tokenizer is None:
        return
    if not args.data:
        raise ValueError("--task / --tokenizer train on --data FILE.jsonl")
    if args.model in IMAGE_MODELS:
        raise ValueError(f"--model {args.model} trains on images: --task / --tokenizer do not apply")
    from jaxodc.cli import sites
    if args.task == "grpo" and sites.enabled(args):
        raise ValueError("--task grpo trains on one site (the --groups / --coord trainers take no GRPO objective)")
    if args.task == "grpo":
        grpo_of(args)
        from jaxodc.modeling.precision import precision_of
        p = precision_of(args.precision)
        if p.param_dtype != "fp32" and p.cast_inputs:
            raise ValueError("--task grpo with --precision bf16 needs bf16,keep_inputs (the advantages and "
                             "log-probabilities stay fp32)")


def grpo_of(args):
    from jaxodc.modeling.rl import GRPO
    return GRPO(clip_eps=args.clip_eps, clip_eps_high=args.clip_eps_high, kl_coef=args.kl)


def vocab_of(args) -> int:
    """The model's vocabulary: --tokenizer's, else bytes."""
    if args.tokenizer is None:
        from jaxodc.data import VOCAB
        return VOCAB
    from jaxodc.modeling.tokenizer import load_tokenizer
    return load_tokenizer(args.tokenizer).vocab_size


def load_task_samples(args):
    """--data read for --task (jaxodc.modeling.dataset); the truncation report is printed once."""
    from jaxodc.modeling.dataset import load_rollouts, load_sft
    from jaxodc.modeling.tokenizer import load_tokenizer
    tok = load_tokenizer(args.tokenizer)
    load = load_rollouts if args.task == "grpo" else load_sft
    samples, report = load(args.data, tok, max_len=args.max_tokens, truncation=args.truncation)
    if not args.worker and os.environ.get("JAXODC_RANK", "0") == "0":
        print(f"data: {report}", flush=True)
    return samples


def task_loss(args):
    """The linen loss(apply, batch) of --task: the summed per-token loss, or GRPO's."""
    from jaxodc.modeling.rl import task_loss as loss_of
    return loss_of(args.task, grpo_of(args) if args.task == "grpo" else None)


def task_kwargs(args) -> dict:
    """Trainer(task=, grpo=) for --task."""
    if args.task == "grpo":
        return {"task": "grpo", "grpo": grpo_of(args)}
    return {}


def with_reference(args, model, params, samples):
    """GRPO with --kl and rollouts without ref_logprobs: every rank computes them from the initial
    weights (the frozen reference) before training."""
    from jaxodc.modeling.rl import REF_LOGP, reference_logprobs
    if args.task != "grpo" or not args.kl or REF_LOGP in getattr(samples.tokens[0], "fields", {}):
        return samples
    fn = getattr(model, "token_losses", None)
    if fn is None:
        raise ValueError("--kl needs the rollouts' ref_logprobs for this model (it exposes no per-token losses)")
    from jaxodc.data import Samples
    return Samples(reference_logprobs(fn, params, samples.tokens, args.max_tokens))
