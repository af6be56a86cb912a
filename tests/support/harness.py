"""Multi-process test harness: run a function on `world` fresh Python processes, one per rank.

    from harness import run_ranks

    def body(ctx, n):              # module level, so the children can import it
        return ctx.rank * n

    def test_it():
        assert run_ranks(body, 3, args=(10,)) == [0, 10, 20]

Each rank is a subprocess running this file as a script, with the launcher's environment (fresh
rendezvous / jax coordinator ports and job id), PYTHONPATH = the parent's sys.path (so the
children import the test module exactly as pytest did), and inside it
`jaxodc.launch.context.init_from_env()` then `fn(ctx, *args)`. Results come back pickled, by rank.

Worker environment (overridable with env=): JAX_PLATFORMS=cpu, and
XLA_FLAGS=--xla_cpu_multi_thread_eigen=false plus OMP_NUM_THREADS=1 so that several ranks on a
2-core machine do not each spin up a full thread pool. (XLA rejects unknown `--` flags and silently
ignores dash-less words such as `intra_op_parallelism_threads=1`, so only the eigen flag is used.)

Failures: if a rank raises (or exits non-zero), the others get a short grace period, are killed,
and `RankFailure` is raised with the failing ranks' tracebacks and output. On timeout every rank
still running is killed (SIGKILL to its process group) and `RankTimeout` names them. Shared
memory of the job (/dev/shm/jaxodc_<job>_*) is always removed afterwards.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

__all__ = ["run_ranks", "RankFailure", "RankTimeout", "WORKER_ENV"]

WORKER_ENV = {
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
    "OMP_NUM_THREADS": "1",
}
_FAIL_GRACE_S = 2.0  # after one rank fails, how long the others may take to finish on their own
_TAIL = 40


class RankFailure(AssertionError):
    """A rank raised or exited abnormally; the message holds its traceback and output."""


class RankTimeout(RankFailure, TimeoutError):
    """Some ranks did not finish within the timeout; they were killed."""


def _child_pythonpath() -> str:
    paths = []
    for p in sys.path:
        p = os.path.abspath(p or os.getcwd())
        if os.path.isdir(p) and p not in paths:
            paths.append(p)
    return os.pathsep.join(paths)


def _fn_ref(fn) -> dict:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module is None or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"run_ranks needs a module-level function, got {fn!r}")
    ref = {"module": module, "qualname": qualname, "file": None}
    if module == "__main__":
        ref["file"] = os.path.abspath(sys.modules["__main__"].__file__)
    return ref


def _tail(path: str, n: int = _TAIL) -> str:
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return "(no output file)"
    return "\n".join(lines[-n:]) if lines else "(no output)"


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # group created by start_new_session
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run_ranks(fn, world: int, *, args=(), timeout_s: float = 60.0, env=None) -> list:
    """Run fn(ctx, *args) on `world` new processes; return the results ordered by rank.

    env: extra environment for the workers (a value of None removes the variable)."""
    from jaxodc.launch.context import cleanup_shm, free_port, new_job_id
    from jaxodc.launch.launcher import rank_env

    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    tmp = tempfile.mkdtemp(prefix="jaxodc_harness_")
    job_id = new_job_id()
    procs: list[subprocess.Popen] = []
    try:
        with open(os.path.join(tmp, "spec.pkl"), "wb") as f:
            pickle.dump({"fn": _fn_ref(fn), "args": tuple(args), "timeout_s": timeout_s}, f)
        base = dict(os.environ)
        base.update(WORKER_ENV)
        base["PYTHONPATH"] = _child_pythonpath()
        for k, v in (env or {}).items():
            if v is None:
                base.pop(k, None)
            else:
                base[k] = str(v)
        coordinator = f"127.0.0.1:{free_port()}"
        jax_coordinator = f"127.0.0.1:{free_port()}"
        for rank in range(world):
            renv = rank_env(base, rank=rank, world=world, local_rank=rank, local_world=world,
                            coordinator=coordinator, jax_coordinator=jax_coordinator,
                            job_id=job_id)
            with open(os.path.join(tmp, f"rank{rank}.out"), "wb") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--rank-entry", tmp],
                    env=renv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True))
        return _collect(procs, tmp, timeout_s)
    finally:
        for p in procs:
            _kill_group(p)
        cleanup_shm(job_id)
        shutil.rmtree(tmp, ignore_errors=True)


def _failed(rank: int, proc: subprocess.Popen, tmp: str) -> bool:
    return os.path.exists(os.path.join(tmp, f"error{rank}.txt")) or proc.poll() not in (None, 0)


def _collect(procs: list[subprocess.Popen], tmp: str, timeout_s: float) -> list:
    world = len(procs)
    deadline = time.monotonic() + timeout_s
    fail_deadline = None
    while True:
        running = [r for r, p in enumerate(procs) if p.poll() is None]
        failed = [r for r, p in enumerate(procs) if _failed(r, p, tmp)]
        if failed and fail_deadline is None:
            fail_deadline = time.monotonic() + _FAIL_GRACE_S
        if not running or (fail_deadline is not None and time.monotonic() > fail_deadline):
            break
        if time.monotonic() > deadline:
            # Ranks that already returned a result are only waiting in the final barrier.
            stuck = [r for r in running
                     if not os.path.exists(os.path.join(tmp, f"result{r}.pkl"))]
            returned = [r for r in running if r not in stuck]
            for p in procs:
                _kill_group(p)
            report = "\n".join(f"--- rank {r} output (last {_TAIL} lines) ---\n"
                               f"{_tail(os.path.join(tmp, f'rank{r}.out'))}" for r in stuck)
            note = (f"; ranks {returned} had returned and were waiting for them" if returned
                    else "")
            raise RankTimeout(
                f"run_ranks: ranks {stuck} of {world} did not finish within {timeout_s:g} s "
                f"(killed){note}\n{report}")
        time.sleep(0.02)
    # Decide who failed before killing anyone: killing rank 0 (the rendezvous server) makes the
    # survivors raise connection errors that are consequences, not causes.
    failed = [r for r, p in enumerate(procs) if _failed(r, p, tmp)]
    killed = [r for r, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        _kill_group(p)
    if failed:
        # Ranks that raised come first: the others usually failed because of them.
        raised = [r for r in failed if os.path.exists(os.path.join(tmp, f"error{r}.txt"))]
        parts = []
        for r in raised + [r for r in failed if r not in raised]:
            code = procs[r].returncode
            how = ("still running when the failure was seen" if r in killed
                   else f"killed by signal {-code}" if code < 0 else f"exit status {code}")
            err = os.path.join(tmp, f"error{r}.txt")
            tb = open(err).read() if os.path.exists(err) else "(no Python traceback)"
            parts.append(f"--- rank {r} ({how}) ---\n{tb}\n--- rank {r} output (last {_TAIL} "
                         f"lines) ---\n{_tail(os.path.join(tmp, f'rank{r}.out'))}")
        others = [r for r in killed if r not in failed]
        note = f"; ranks {others} were still running and were killed" if others else ""
        raise RankFailure(f"run_ranks: ranks {raised or failed} of {world} failed{note}\n"
                          + "\n".join(parts))
    results = []
    for r in range(world):
        path = os.path.join(tmp, f"result{r}.pkl")
        if not os.path.exists(path):
            raise RankFailure(f"run_ranks: rank {r} exited 0 without a result\n"
                              f"{_tail(os.path.join(tmp, f'rank{r}.out'))}")
        with open(path, "rb") as f:
            results.append(pickle.load(f))
    return results


# -- child side -----------------------------------------------------------------------------------

def _resolve(ref: dict):
    if ref["file"] is not None:  # fn lives in a script run as __main__
        spec = importlib.util.spec_from_file_location("__jaxodc_harness_main__", ref["file"])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["__main__"] = mod  # so pickled args that name __main__ resolve
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(ref["module"])
    obj = mod
    for part in ref["qualname"].split("."):
        obj = getattr(obj, part)
    return obj


def _write_atomic(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def _rank_entry(tmp: str) -> int:
    rank = int(os.environ["JAXODC_RANK"])
    try:
        with open(os.path.join(tmp, "spec.pkl"), "rb") as f:
            spec = pickle.load(f)
        fn = _resolve(spec["fn"])
        from jaxodc.launch.context import init_from_env, shutdown

        ctx = init_from_env(timeout_s=spec["timeout_s"])
    except BaseException:
        _write_atomic(os.path.join(tmp, f"error{rank}.txt"), traceback.format_exc().encode())
        return 1
    try:
        result = fn(ctx, *spec["args"])
        _write_atomic(os.path.join(tmp, f"result{rank}.pkl"), pickle.dumps(result))
    except BaseException:
        _write_atomic(os.path.join(tmp, f"error{rank}.txt"), traceback.format_exc().encode())
        # No final barrier: the other ranks may be stuck waiting for this one.
        ctx.rendezvous.close()
        if ctx.server is not None:
            ctx.server.close()
        return 1
    shutdown(ctx)
    return 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--rank-entry":
    sys.exit(_rank_entry(sys.argv[2]))


def error_text(fn) -> str:
    """"Type: message" of what fn() raised, or "" when it returned: rank bodies return it so the
    test process can check the error every rank saw."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the caller checks
        return f"{type(e).__name__}: {e}"
    return ""
