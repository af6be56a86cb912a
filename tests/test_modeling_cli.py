"""`jaxodc train --task sft|grpo --tokenizer DIR --data FILE.jsonl`: bad data and settings are
refused before any rank starts (exit 2, naming file and line); SFT on chat data and GRPO on
rollouts (KL against the initial weights computed up front) train on 2 local ranks, ODC and the
collective, and report the truncation."""
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
