"""Processes a test starts and must end: each in its own process group, its output in a file, killed with its
children however the test ends (a failed assert, a timeout, an interrupt).

Output goes to a file, not a pipe: a pipe that nobody reads fills at 64 KiB and then stops the child in its
next write (a training run logging for minutes), which looks like a hang. Tests wait for what must eventually
be true (:meth:`Started.wait_until`), never for one file that a fast machine may already have rotated away.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def clean_env(extra: dict | None = None) -> dict:
    """This environment without a launcher's rank variables, with the repository first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


class Started:
    def __init__(self, popen: subprocess.Popen, log: str, err_log: str | None = None):
        self.popen, self.log, self.err_log = popen, log, err_log

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stdout(self) -> str:
        """What the process wrote (stdout and stderr together, unless they were asked apart)."""
        with open(self.log, errors="replace") as f:
            return f.read()

    def stderr(self) -> str:
        if self.err_log is None:
            return ""
        with open(self.err_log, errors="replace") as f:
            return f.read()

    def output(self) -> str:
        return self.stdout() + self.stderr()

    def send_signal(self, sig: int, group: bool = False) -> None:
        """``sig`` to the process (``group``: to its whole process group, as a preemption signals every rank)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig) if group else self.popen.send_signal(sig)

    def wait_until(self, ready, what: str, timeout_s: float = 300, poll_s: float = 0.1) -> None:
        """Poll ``ready()`` until it is true; fail with the process's output when it exits first or time runs out."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert self.popen.poll() is None, f"exited ({self.popen.returncode}) before {what}:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f} s:\n{self.output()[-3000:]}"
            time.sleep(poll_s)

    def wait(self, timeout_s: float) -> int:
        return self.popen.wait(timeout=timeout_s)


@contextlib.contextmanager
def started(args: list[str], log: str, *, cwd: str | None = None, env: dict | None = None, apart: bool = False):
    """``args`` started in a new session (its own process group), stdout and stderr into ``log`` (``apart``:
    stderr into ``log``.err); on the way out whatever is left of the group is killed (SIGKILL) and reaped."""
    err_log = log + ".err" if apart else None
    with open(log, "w") as out, open(err_log or os.devnull, "w") as err:
        popen = subprocess.Popen(args, stdout=out, stderr=err if apart else subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, text=True, cwd=cwd or ROOT,
                                 env=env if env is not None else clean_env(), start_new_session=True)
    try:
        yield Started(popen, log, err_log)
    finally:
        try:  # every descendant, found before the leader dies: torchrun starts its ranks in sessions of their own
            tree = psutil.Process(popen.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)  # the group, even if the leader has exited
        for child in tree:
            with contextlib.suppress(psutil.Error):
                child.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=60)


def torchrun(nproc: int, script: str, *args: str, timeout: float = 600, stop_when=None,
             log: str | None = None, launcher_args: tuple = (), env: dict | None = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=N SCRIPT ARGS`` on a free port, one intra-op thread per rank (N ranks share
    the cores). ``stop_when``: a function that, once true, has every rank sent SIGTERM, as a preemption does.
    Returns the exit code with stdout and stderr; the ranks are killed on the way out whatever happens."""
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = log or os.path.join(tempfile.mkdtemp(prefix="torchrun-"), "torchrun.log")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
           *launcher_args, script, *args]
    with started(cmd, log, env=clean_env({"OMP_NUM_THREADS": "1", **(env or {})}), apart=True) as p:
        if stop_when is not None:
            p.wait_until(stop_when, "the step to stop at", timeout_s=timeout, poll_s=0.05)
            p.send_signal(signal.SIGTERM, group=True)
        code = p.wait(timeout)
        return subprocess.CompletedProcess(cmd, code, p.stdout(), p.stderr())


def vramfit(*args: str) -> list[str]:
    """The command line of ``vramfit ARGS`` as the tests run it (this interpreter, this checkout)."""
    return [sys.executable, "-m", "launcher", *args]


def checkpoint_steps(run_dir) -> list[int]:
    """Steps of the complete checkpoints in a run directory now (rotation may remove any of them next)."""
    folder = os.path.join(run_dir, "checkpoints")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(int(n[len("step-"):]) for n in names if n.startswith("step-") and n[len("step-"):].isdigit())


def metrics_steps(run_dir) -> int:
    """Lines in metrics.jsonl now (one per finished optimizer step)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.endswith("\n"))


def torchrun_nodes(nodes: int, script: str, *args: str, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """``nodes`` torchrun invocations of one rank each that meet at a rendezvous on this machine (``--nnodes
    --node_rank --master_addr``), as machines of one run do; every invocation's exit code and output."""
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tempfile.mkdtemp(prefix="torchrun-nodes-")
    with contextlib.ExitStack() as stack:
        runs = []
        for rank in range(nodes):
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node_rank={rank}",
                   "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", script, *args]
            runs.append((cmd, stack.enter_context(started(cmd, os.path.join(folder, f"node{rank}.log"),
                                                          env=clean_env({"OMP_NUM_THREADS": "1"}), apart=True))))
        return [subprocess.CompletedProcess(cmd, p.wait(timeout), p.stdout(), p.stderr()) for cmd, p in runs]
