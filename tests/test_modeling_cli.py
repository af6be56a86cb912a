"""`jaxodc train --task sft|grpo --tokenizer DIR --data FILE.jsonl`: bad data and settings are
refused before any rank starts (exit 2, naming file and line); SFT on chat data and GRPO on
rollouts (KL against the initial weights computed up front) train on 2 local ranks, ODC and the
collective, and report the truncation; GRPO on a Hugging Face checkpoint (--model hf:DIR) trains
GRPO's objective."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from support.tiny_tokenizer import CHATML, write_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--minibatch", "2", "--max-tokens", "64", "--d-model", "16", "--layers", "1", "--heads", "2"]


def _main(argv, capsys):
    from jaxodc.cli.train import main
    code = main(argv)
    return code, capsys.readouterr().err


def test_bad_task_input_exits_2(tmp_path, capsys):
    tok = write_tokenizer(str(tmp_path / "tok"), CHATML)
    data = tmp_path / "chat.jsonl"
    data.write_bytes(b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                     b'{"messages": [{"role": "wizard", "content": "hi"}]}\n')
    code, err = _main(["--data", str(data), "--task", "sft", "--tokenizer", tok] + SMALL, capsys)
    assert code == 2 and "chat.jsonl:2: message 0 has role 'wizard'" in err, err
    data.write_bytes(b'{"prompt": "a", "completion": "b", "reward": 1}\n{"prompt": "a", "completion": "\xff"}\n')
    code, err = _main(["--data", str(data), "--task", "grpo", "--tokenizer", tok] + SMALL, capsys)
    assert code == 2 and "chat.jsonl:2: not UTF-8" in err, err
    code, err = _main(["--task", "sft"] + SMALL, capsys)
    assert code == 2 and "--task / --tokenizer train on --data FILE.jsonl" in err, err
    code, err = _main(["--data", str(data), "--task", "grpo", "--precision", "bf16"] + SMALL, capsys)
    assert code == 2 and "needs bf16,keep_inputs" in err, err
    code, err = _main(["--data", str(data), "--task", "grpo", "--clip-eps", "0"] + SMALL, capsys)
    assert code == 2 and "GRPO needs 0 < clip_eps < 1" in err, err
    code, err = _main(["--data", str(data), "--task", "grpo", "--groups", "2"] + SMALL, capsys)
    assert code == 2 and "--task grpo trains on one site" in err, err
    code, err = _main(["--data", str(data), "--tokenizer", str(tmp_path / "nowhere")] + SMALL, capsys)
    assert code == 2 and "nowhere: no tokenizer.json there" in err, err


def _train(args, timeout=400):
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "jaxodc", "train"] + args, cwd=ROOT, env=env, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    assert p.returncode == 0, p.stdout[-4000:]
    return p.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sft_and_grpo_runs(tmp_path):
    from jaxodc.modeling import synthetic_data as synthetic
    from jaxodc.modeling.tokenizer import Tokenizer
    tok = write_tokenizer(str(tmp_path / "tok"), CHATML)
    chat = synthetic.write_chat(str(tmp_path / "chat.jsonl"), 16, 10, seed=1)
    out = _train(["--data", chat, "--task", "sft", "--tokenizer", tok, "--comm", "odc,collective",
                  "--steps", "2", "--warmup", "0"] + SMALL)
    assert "data: " in out and "truncation 'right' at 64 tokens" in out, out
    assert "odc + lb_mini" in out and "collective + lb_micro" in out, out
    rollouts = synthetic.write_rollouts(str(tmp_path / "r.jsonl"), Tokenizer(tok), 4, 4, 6, seed=2, prompt_words=(2, 4))
    out = _train(["--data", rollouts, "--task", "grpo", "--tokenizer", tok, "--model", "llama", "--kl", "0.05",
                  "--balance", "lb_steal", "--steps", "2", "--warmup", "0"] + SMALL)
    assert "odc + lb_steal" in out and "minibatch 1: loss" in out, out


@pytest.mark.timeout(600)
def test_grpo_on_hf_checkpoint_trains_the_grpo_objective(tmp_path):
    """`--model hf:DIR --task grpo`: the first minibatch (every rollout, each once) reports GRPO's
    loss computed here from the whole checkpoint, not the plain cross entropy."""
    import re

    import numpy as np
    from jaxodc.balance.packing import fields_of, pack
    from jaxodc.modeling import synthetic_data
    from jaxodc.modeling.dataset import load_rollouts
    from jaxodc.modeling.hf_load import load_hf
    from jaxodc.modeling.rl import GRPO
    from jaxodc.modeling.synthetic import tiny_config, write_checkpoint
    from jaxodc.modeling.tokenizer import ByteTokenizer
    d = str(tmp_path / "ck")
    write_checkpoint(d, tiny_config("llama", vocab=256, hidden=16, layers=1, heads=2, kv_heads=1), seed=3)
    rollouts = synthetic_data.write_rollouts(str(tmp_path / "r.jsonl"), ByteTokenizer(), 2, 4, 6, seed=2,
                                             prompt_words=(2, 4))
    out = _train(["--model", f"hf:{d}", "--data", rollouts, "--task", "grpo", "--ranks", "2", "--comm", "odc",
                  "--minibatch", "4", "--max-tokens", "64", "--steps", "1", "--warmup", "0"])
    got = float(re.search(r"minibatch 0: loss (-?[0-9.]+)", out).group(1))
    samples, _ = load_rollouts(rollouts, ByteTokenizer(), 64)
    assert len(samples) == 8
    ck = load_hf(d)
    params, fields = ck.params(), fields_of(samples.tokens)
    apply = lambda b: ck.model.apply(params, b)  # noqa: E731 - per-token cross entropy x loss_mask
    grpo = ce = count = 0.0
    for s in samples.tokens:
        batch = pack([s], 64, fields=fields).as_dict()
        grpo += float(GRPO().linen_loss(apply, batch))
        ce += float(apply(batch).sum())
        count += float(np.sum(batch["loss_mask"]))
    assert got == pytest.approx(grpo / count, abs=2e-4), (got, grpo / count)
    assert abs(ce / count - grpo / count) > 1.0  # the two objectives are told apart
