"""`jaxodc train`: bad input is refused before any rank starts (exit status 2, a message naming the
problem); an end-to-end run on 2 local ranks trains the collective baseline and ODC, saves
checkpoints, and a second invocation with --resume continues one of them (records, checkpoint
steps, the table and the timeline are checked)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--minibatch", "2", "--max-tokens", "32", "--d-model", "16", "--layers", "1", "--heads", "2"]


def _main(argv, capsys):
    from jaxodc.cli.train import main
    code = main(argv)
    return code, capsys.readouterr().err


def test_bad_input_exits_2_before_launching(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("10\n20\n300  # too long\n12\n")
    code, err = _main(["--lengths", str(lengths)] + SMALL, capsys)
    assert code == 2 and "1 sample length(s) exceed --max-tokens 32 (first: sample 2, length 300)" in err, err
    code, err = _main(["--comm", "odc,nccl"], capsys)
    assert code == 2 and "unknown --comm nccl; choose one of odc, collective" in err, err
    code, err = _main(["--comm", "collective", "--balance", "lb_steal"], capsys)
    assert code == 2 and "lb_steal claims microbatches at run time; it needs --comm odc" in err, err
    code, err = _main(["--resume"], capsys)
    assert code == 2 and "--resume needs --checkpoint DIR" in err, err
    code, err = _main(["--steps", "0"], capsys)
    assert code == 2 and "--steps must be >= 1" in err, err
    code, err = _main(["--compress", "fraction=2"], capsys)
    assert code == 2 and "compression 'fraction=2': fraction must be in (0, 1], got 2.0" in err, err
    code, err = _main(["--compress", "ratio=1"], capsys)
    assert code == 2 and "ratio must be > 1 (dense bytes / sketch bytes), got 1.0" in err, err
    code, err = _main(["--compress", "width=3"], capsys)
    assert code == 2 and "expected 'none', 'default' or key=value pairs" in err, err
    code, err = _main(["--link-mbps", "100"], capsys)
    assert code == 2 and "--link-mbps / --link-ms emulate ODC's tcp transport: add --transport tcp" in err, err
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello world"}\n{"text": "a longer sample"}\n')
    code, err = _main(["--data", str(data), "--ranks", "2"] + SMALL, capsys)
    assert code == 2 and "2 samples cannot fill one minibatch of 2 per rank x 2 ranks" in err, err
    data.write_text('{"text": "ok"}\n[1, 2]\n')
    code, err = _main(["--data", str(data)] + SMALL, capsys)
    assert code == 2 and 'd.jsonl:2: expected an object with a string "text" field' in err, err


def _train(args, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "jaxodc", "train"] + args, cwd=ROOT, env=env, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    assert p.returncode == 0, p.stdout[-4000:]
    return p.stdout


@pytest.mark.timeout(300)
def test_train_checkpoint_and_resume(tmp_path):
    ck, js = tmp_path / "ck", tmp_path / "runs.json"
    common = ["--ranks", "2", "--comm", "collective,odc", "--checkpoint", str(ck), "--json", str(js)] + SMALL
    out = _train(common + ["--steps", "2", "--save-every", "1", "--warmup", "0"])
    for name in ("collective + lb_micro", "odc + lb_mini"):
        for step in (0, 1):
            assert f"{name.split(' + ')[0]:>10} + {name.split(' + ')[1]:<8} minibatch {step}: loss" in out, out
    runs = json.load(open(js))
    assert set(runs) == {"collective + lb_micro", "odc + lb_mini"}
    for name, recs in runs.items():
        assert sorted((r["rank"], r["step"]) for r in recs) == [(0, 0), (0, 1), (1, 0), (1, 1)], name
        assert sum(r["samples"] for r in recs) == 2 * 2 * 2
        losses = {r["step"]: r["loss"] for r in recs}
        assert all(r["loss"] == losses[r["step"]] for r in recs)  # the global loss on every rank
        assert len({r["params_sha256"] for r in recs}) == 1 and len(recs[0]["params_sha256"]) == 64
    two_steps = runs["odc + lb_mini"][0]["params_sha256"]
    for sub in ("collective-lb_micro", "odc-lb_mini"):
        assert json.load(open(ck / sub / "manifest.json"))["step"] == 2
    assert "final loss" in out and "samples/s" in out and "ODC + LB-Mini vs collective + LB-Micro:" in out

    # resume one run from its sub-directory (a single run uses --checkpoint DIR itself)
    png = tmp_path / "t.png"
    out = _train(["--ranks", "2", "--comm", "odc", "--checkpoint", str(ck / "odc-lb_mini"), "--json", str(js)]
                 + SMALL + ["--steps", "3", "--resume", "--warmup", "0", "--timeline", str(png)])
    assert "odc + lb_mini  resumed from" in out and "at minibatch 2" in out, out
    assert "odc + lb_mini  minibatch 2: loss" in out and "minibatch 1: loss" not in out, out
    runs = json.load(open(js))
    assert list(runs) == ["odc + lb_mini"] and sorted(r["step"] for r in runs["odc + lb_mini"]) == [2, 2]
    assert runs["odc + lb_mini"][0]["params_sha256"] != two_steps  # one more minibatch trained
    assert png.stat().st_size > 1000 and f"timeline: {png}" in out
    assert json.load(open(ck / "odc-lb_mini" / "manifest.json"))["step"] == 3


def test_reproducible_is_forwarded_to_the_ranks():
    from jaxodc.cli import train as cli
    assert "--reproducible" in cli.worker_argv(cli.parser().parse_args(["--reproducible"]))
    assert "--reproducible" not in cli.worker_argv(cli.parser().parse_args([]))


def test_path_arguments_are_checked_before_training(tmp_path, capsys):
    missing = tmp_path / "nope"
    code, err = _main(["--checkpoint", str(missing), "--resume"] + SMALL, capsys)
    assert code == 2 and err == (f"jaxodc train: --resume: the checkpoint directory {missing} does not exist; "
                                 "check the path, or drop --resume to train from scratch\n"), err
    assert not missing.exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, err = _main(["--checkpoint", str(afile)] + SMALL, capsys)
    assert code == 2 and err == (f"jaxodc train: --checkpoint {afile} is a file; give a directory (it is created "
                                 "if missing)\n"), err
    code, err = _main(["--data", str(missing)] + SMALL, capsys)
    assert code == 2 and err == f"jaxodc train: --data {missing} does not exist; give the file to read\n", err
    code, err = _main(["--lengths", str(tmp_path)] + SMALL, capsys)
    assert code == 2 and f"--lengths {tmp_path} is a directory" in err, err
    code, err = _main(["--json", str(tmp_path)] + SMALL, capsys)
    assert code == 2 and f"--json {tmp_path} is a directory; give a file name" in err, err
    code, err = _main(["--export", str(afile / "x.msgpack")] + SMALL, capsys)
    assert code == 2 and f"--export: cannot create the directory {afile}" in err, err
    code, err = _main(["--ranks", "100000"] + SMALL, capsys)
    assert code == 2 and "--ranks 100000: more ranks than this machine can run" in err, err


def test_non_utf8_data_names_file_and_line(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"text": "fine"}\n\n{"text": "caf\xff"}\n')
    code, err = _main(["--data", str(data)] + SMALL, capsys)
    assert code == 2 and err == (f"jaxodc train: {data}:3: not UTF-8 text (byte 0xff at column 14); re-encode "
                                 "the file as UTF-8\n"), err


def test_truncated_records_are_counted(tmp_path, capsys):
    from jaxodc.cli.train import load_samples, parser
    data = tmp_path / "d.jsonl"
    texts = ["x" * n for n in (10, 40, 32, 33, 100, 5)]  # 3 of 6 longer than 32 tokens
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    args = parser().parse_args(["--data", str(data)] + SMALL)
    samples = load_samples(args, 1, report=True)
    assert [len(t) for t in samples.tokens] == [min(len(t), 32) for t in texts]
    assert capsys.readouterr().err == (f"jaxodc train: --data {data}: 3 of 6 records are longer than --max-tokens "
                                       "32 and were cut to it\n")
    load_samples(args, 1)
    assert capsys.readouterr().err == ""


def test_a_failing_rank_prints_one_line_and_logs_its_traceback(tmp_path, capsys, monkeypatch):
    from jaxodc.cli.train import _as_rank
    from jaxodc.train.checkpoint import CheckpointError
    monkeypatch.setenv("JAXODC_RANK", "1")
    monkeypatch.setenv("JAXODC_LOG_DIR", str(tmp_path))

    def fail(_args):
        raise CheckpointError("/ck/units-00000001.npz: CRC mismatch in unit 3")
    assert _as_rank(fail, None) == (1, None)
    err = capsys.readouterr().err
    path = tmp_path / f"jaxodc_train_rank1_{os.getpid()}.traceback"
    assert err == ("jaxodc train: rank 1: CheckpointError: /ck/units-00000001.npz: CRC mismatch in unit 3 -- restore "
                   "the checkpoint, or train without --resume / with another --checkpoint (traceback in "
                   f"{path})\n"), err
    text = path.read_text()
    assert text.startswith("Traceback (most recent call last)") and "in fail" in text
    assert _as_rank(lambda a: {"r": a}, 5) == (0, {"r": 5})


@pytest.mark.timeout(300)
def test_damaged_checkpoint_under_the_launcher_is_a_few_lines(tmp_path):
    """Every rank fails restoring a damaged checkpoint: the output is one line per rank at most and
    the launcher's line naming the log, no traceback."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "manifest.json").write_text("{not json")
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(tmp_path))  # the failed job's logs stay there
    p = subprocess.run([sys.executable, "-m", "jaxodc", "train", "--ranks", "2", "--steps", "2", "--checkpoint",
                        str(ck), "--resume"] + SMALL, cwd=ROOT, env=env, text=True, capture_output=True, timeout=240)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    lines = p.stderr.splitlines()
    assert 2 <= len(lines) <= 3, p.stderr
    assert any(f"rank 0: CheckpointError: {ck}/manifest.json: unreadable checkpoint manifest" in x
               and "traceback in" in x for x in lines), p.stderr
    assert lines[-1].startswith("jaxodc launch: rank ") and "exited with status 1: [rank" not in lines[-1]
    assert "its full output is in" in lines[-1], p.stderr


@pytest.mark.timeout(300)
def test_sigint_stops_training_with_one_line(tmp_path):
    import signal
    import time
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "jaxodc", "train", "--ranks", "2", "--steps", "10000"] + SMALL,
                            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while "minibatch 1: loss" not in proc.stdout.readline():  # training runs
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert err.count("\n") == 1 and err.startswith("jaxodc launch: received SIGINT; stopping the job (2 running"), err
    assert "Traceback" not in out
