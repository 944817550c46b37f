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

import errno
import fcntl
import json
import math
import os
import shutil
import socket
import sys
import time

from launcher.units import MiB

SUMMARY_KEYS = ("status", "engine", "profile", "precision", "device", "steps", "first_loss", "final_loss",
                "tokens_per_s", "peak_gpu_bytes", "peak_cpu_rss_bytes", "predicted_gpu_bytes",
                "predicted_cpu_bytes", "skipped_steps", "loss_scale", "fallbacks", "resumed_from")
METRIC_KEYS = ("step", "loss", "lr", "loss_scale", "skipped", "grad_norm", "tokens", "tokens_per_s",
               "gpu_allocated_bytes", "gpu_reserved_bytes", "cpu_rss_bytes", "time_s")
LOCK = "vramfit.lock"
# Below this much free space a failed write counts as a full disk even when the library hid the errno
# (torch.save reports ENOSPC as "RuntimeError: [enforce fail at inline_container.cc] unexpected pos",
# safetensors and DCP wrap it in their own errors).
FULL_BELOW_BYTES = MiB


def _clean(obj):
    """JSON cannot hold inf/nan: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


# ------------------------------------------------------------------------------------------------
# A full disk


class DiskFull(OSError):
    """A write that did not fit. The partial files are already removed when this is raised; the message says
    what was written where, the free and needed MiB, and the fix."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def free_bytes(path: str) -> int | None:
    """Free bytes on the file system holding ``path`` (its nearest existing parent); None when unknown."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def is_disk_full(exc: BaseException, path: str) -> bool:
    """Did ``exc``, raised while writing under ``path``, come from a full disk (or quota)?"""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:  # the errno may sit on a cause a library wrapped
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)  # libraries in other languages keep only the words (safetensors: "... (os error 28)")
        if any(w in text for w in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT),
                                   f"(os error {errno.ENOSPC})", f"(os error {errno.EDQUOT})")):
            return True
        e = e.__cause__ or e.__context__
    free = free_bytes(path)
    return free is not None and free < FULL_BELOW_BYTES


def size_text(n: int) -> str:
    """Exact enough to act on: '12.3 MiB', or KiB below one MiB (not '0.01 GiB')."""
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB"


def disk_full_message(what: str, where: str, *, free_before: int | None = None, needed: int | None = None,
                      written: int | None = None) -> str:
    """'disk full: ...' with the exact MiB: what was free when the write began (else now), what it needs
    (when known: the previous checkpoint's size), what had been written (the partial files, now removed)."""
    parts = [f"disk full: {what} did not fit in {where}"]
    if free_before is not None:
        parts.append(f"{size_text(free_before)} were free when it began")
    if needed is not None:
        parts.append(f"it needs about {size_text(needed)}")
    if written is not None:
        parts.append(f"{size_text(written)} had been written when the disk filled; those partial files are removed")
    if free_before is None:
        free = free_bytes(where)
        if free is not None:
            parts.append(f"{size_text(free)} are free there now")
    return "; ".join(parts)


def remove_quietly(path: str) -> None:
    """Remove a partial file or directory (what a failed write left)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if os.path.exists(os.path.join(d, f)))


# ------------------------------------------------------------------------------------------------
# Whole files


def write_atomic(path: str, text: str) -> None:
    """Write ``path`` under a temporary name, then rename: readers see the old file or the new one. A full
    disk removes the temporary file and raises :class:`DiskFull`."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        remove_quietly(tmp)
        if isinstance(e, OSError) and is_disk_full(e, path):
            raise DiskFull(disk_full_message(f"writing {os.path.basename(path)}", os.path.dirname(path) or ".",
                                             needed=len(text.encode()))) from None
        raise


def write_json(path: str, obj) -> None:
    write_atomic(path, json.dumps(_clean(obj), indent=2) + "\n")


def read_json(path: str):
    with open(path) as fh:
        return json.load(fh)


def read_jsonl(path: str) -> list[dict]:
    """The complete lines of a JSON-lines file. A last line cut short (a kill or a full disk during the
    append) is left out rather than failing the reader."""
    out = []
    with open(path) as fh:
        for ln in fh:
            if not ln.strip():
                continue
            try:
                out.append(json.loads(ln))
            except json.JSONDecodeError:
                if ln.endswith("\n"):  # damage inside the file is not a torn append: say so
                    raise
    return out


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
        self.write_text(name, json.dumps(_clean(obj), indent=2) + "\n")

    def append_metrics(self, row: dict) -> None:
        if not self.is_main:
            return
        if self._metrics is None:
            self._metrics = open(self.file("metrics.jsonl"), "a", buffering=1)
        self._metrics.write(json.dumps(_clean(row)) + "\n")

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
