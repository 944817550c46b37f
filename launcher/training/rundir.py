"""The run directory (contract in DESIGN.md): config.yaml, plan.json, ds_config.json, metrics.jsonl,
memory.csv, summary.json, checkpoints/, final/. Only rank 0 writes; every write of a whole file goes
to a temporary name first and is renamed, so a kill never leaves half a file behind, and a full disk
leaves no partial file either (:class:`DiskFull` says so in MiB).

One process per run directory: :class:`RunLock` holds ``vramfit.lock`` (the holder's pid and host) with
``flock`` for as long as the run lasts, so a second ``vramfit train`` with the same run_name is refused
instead of writing the same checkpoints and metrics. The kernel drops an flock when its process dies
(SIGKILL, OOM killer, power loss of the client), so a lock file left behind by a dead process is simply
taken over: no pid-liveness guessing, which cannot work across hosts anyway.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time

from launcher.machine.files import json_safe, read_jsonl, write_atomic

SUMMARY_KEYS = ("status", "engine", "profile", "precision", "device", "steps", "first_loss", "final_loss",
                "tokens_per_s", "peak_gpu_bytes", "peak_cpu_rss_bytes", "predicted_gpu_bytes",
                "predicted_cpu_bytes", "skipped_steps", "loss_scale", "fallbacks", "resumed_from")
METRIC_KEYS = ("step", "loss", "lr", "loss_scale", "skipped", "grad_norm", "tokens", "tokens_per_s",
               "gpu_allocated_bytes", "gpu_reserved_bytes", "cpu_rss_bytes", "time_s")
LOCK = "vramfit.lock"
# ------------------------------------------------------------------------------------------------
# One process per run directory


class LockHeld(Exception):
    """Another live process holds the run directory. ``str()``: value, rule and fix."""


class RunLock:
    """``vramfit.lock`` in the run directory, held with ``flock`` until :meth:`release` (see the module
    docstring). The file holds JSON: pid, host, start time, command line, for the refusal message."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK)
        self.fd: int | None = None
        self.taken_over: dict | None = None  # what a dead holder's lock file said, when we took it over

    def _read(self) -> dict:
        try:
            with open(self.path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return {}

    def acquire(self) -> RunLock:
        """Take the lock or raise :class:`LockHeld`."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                time.sleep(0.05)  # the holder may be writing its details this very moment
                h = self._read()
                who = (f"pid {h.get('pid', '?')} on host {h.get('host', '?')}, started {h.get('started', '?')}"
                       if h else "another process")
                raise LockHeld(f"run_name: {os.path.dirname(self.path)} is in use by {who}; rule: one vramfit process "
                               f"per run directory; fix: wait for it to finish, stop it (kill -TERM {h.get('pid', 'PID')} "
                               "saves a checkpoint), or choose another run_name") from None
            # The file may have been removed (a holder releasing) between our open and our flock: then we
            # hold a lock on a file nobody else sees, so try again on the file at the path.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            break
        previous = os.read(fd, 65536)
        if previous.strip():
            try:
                self.taken_over = json.loads(previous)
            except ValueError:
                self.taken_over = {"content": previous[:200].decode(errors="replace")}
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(sys.argv)[:500]}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        except OSError:  # a full disk: the lock holds all the same, a refusal just cannot name us
            pass
        self.fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file, then let go of the lock (in that order: a waiting process that opened the
        old file sees it gone and tries again on a new one)."""
        if self.fd is None:
            return
        try:
            os.remove(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


# ------------------------------------------------------------------------------------------------
# A start that failed before its first checkpoint

FAILED_START = "failed-start-"  # <run>/failed-start-N/: what such a start wrote, set aside by the next start
KEPT_ON_TAKE_OVER = (LOCK, "oom-ladder.json")  # the lock is the new start's; the OOM rung is what it goes on with


def failed_start(path: str) -> bool:
    """Whether the run directory ``path`` holds a start that ended before its first checkpoint: no checkpoint at all
    (not even a damaged or half-written one), no final/, and no summary saying it finished. Such a directory holds
    nothing to resume, so the next start with the same run_name takes it over instead of refusing it."""
    ckpts = os.path.join(path, "checkpoints")
    if os.path.isdir(os.path.join(path, "final")) or (os.path.isdir(ckpts) and os.listdir(ckpts)):
        return False
    try:
        with open(os.path.join(path, "summary.json")) as fh:
            status = json.load(fh).get("status")
    except FileNotFoundError:
        status = None
    except (OSError, ValueError, AttributeError):  # cut short, or not a summary: not a finished run's either
        status = "unreadable"
    return status not in ("completed", "stopped_early")


def set_aside_failed_start(path: str) -> str | None:
    """Move what a failed start wrote in ``path`` into ``path/failed-start-N/`` (kept for a look: its log lines,
    metrics and diagnosis), so the next start writes into a clean run directory; the lock and an OOM ladder record
    stay. Returns the folder (None when there was nothing to move)."""
    names = [n for n in os.listdir(path) if n not in KEPT_ON_TAKE_OVER and not n.startswith(FAILED_START)]
    if not names:
        return None
    n = 1 + sum(1 for x in os.listdir(path) if x.startswith(FAILED_START))
    while os.path.exists(os.path.join(path, f"{FAILED_START}{n}")):
        n += 1
    aside = os.path.join(path, f"{FAILED_START}{n}")
    os.mkdir(aside)
    for name in names:
        os.rename(os.path.join(path, name), os.path.join(aside, name))
    return aside


# ------------------------------------------------------------------------------------------------
# The run directory


class RunDir:
    def __init__(self, path: str, is_main: bool = True):
        self.path = path
        self.is_main = is_main
        self._metrics = None
        self._held: dict[str, str] | None = None

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def checkpoints(self) -> str:
        return self.file("checkpoints")

    def create(self) -> None:
        if self.is_main:
            os.makedirs(self.checkpoints, exist_ok=True)

    def hold(self) -> None:
        """Keep whole-file writes in memory until :meth:`commit`: a resume writes nothing into the run it
        continues until its checkpoint has loaded, so a resume that fails leaves that run as it was."""
        self._held = {}

    def commit(self) -> None:
        held, self._held = self._held or {}, None
        for name, text in held.items():
            self.write_text(name, text)

    def write_text(self, name: str, text: str) -> None:
        if not self.is_main:
            return
        if self._held is not None:
            self._held[name] = text
            return
        write_atomic(self.file(name), text)

    def write_json(self, name: str, obj) -> None:
        self.write_text(name, json.dumps(json_safe(obj), indent=2) + "\n")

    def append_metrics(self, row: dict) -> None:
        if not self.is_main:
            return
        if self._metrics is None:
            self._metrics = open(self.file("metrics.jsonl"), "a", buffering=1)
        self._metrics.write(json.dumps(json_safe(row)) + "\n")

    def truncate_metrics(self, last_step: int) -> None:
        """On resume: keep the lines up to the checkpoint's step as they are (the rest will be recomputed),
        and drop a last line cut short by a kill or a full disk."""
        path = self.file("metrics.jsonl")
        if not self.is_main or not os.path.exists(path):
            return
        keep = []
        with open(path) as fh:
            for ln in fh:
                if not ln.endswith("\n"):
                    break  # torn append
                if ln.strip() and json.loads(ln).get("step", 0) <= last_step:
                    keep.append(ln)
        write_atomic(path, "".join(keep))

    def metrics(self) -> list[dict]:
        path = self.file("metrics.jsonl")
        return read_jsonl(path) if os.path.exists(path) else []

    def close(self) -> None:
        if self._metrics is not None:
            try:
                self._metrics.close()
            except OSError:  # the flush of the last line on a full disk: the loop already reported the disk
                pass
            self._metrics = None


def default_run_name(model_name: str) -> str:
    base = os.path.basename(os.path.normpath(model_name)) or "model"
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S')}"
