"""Whole files and a full disk, for everything vramfit writes (run directories, checkpoints, caches, reports).

Every whole file is written under a temporary name and renamed (:func:`write_atomic`), so a kill never leaves
half a file; a failed write that came from a full disk or quota (:func:`is_disk_full`, the one test for it) is
raised as :class:`DiskFull`, with the free and needed MiB in its message, and leaves no partial file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import threading

from launcher.units import MiB

# Below this much free space a failed write counts as a full disk even when the library hid the errno
# (torch.save reports ENOSPC as "RuntimeError: [enforce fail at inline_container.cc] unexpected pos",
# safetensors and DCP wrap it in their own errors).
FULL_BELOW_BYTES = MiB


def json_safe(obj):
    """JSON cannot hold inf/nan: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
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


@contextlib.contextmanager
def atomic_path(path: str, *, suffix: str = "", needed: int | None = None):
    """A temporary name beside ``path`` to write to (ending in ``suffix``, for writers that read the format from
    it); renamed to ``path`` when the block ends, so readers see the old file or the new one, never half of one.
    On any failure the temporary file is removed, and a full disk is raised as :class:`DiskFull`."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}{suffix}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        remove_quietly(tmp)
        if isinstance(e, OSError) and not isinstance(e, DiskFull) and is_disk_full(e, path):
            raise DiskFull(disk_full_message(f"writing {os.path.basename(path)}", os.path.dirname(path) or ".",
                                             needed=needed)) from None
        raise


def write_atomic(path: str, data: str | bytes, *, fsync: bool = True) -> None:
    """Write ``path`` whole through :func:`atomic_path`. ``fsync``: on disk before the rename (what a run
    directory and a checkpoint need to survive a power loss; a cache that is only a speed-up may skip it)."""
    raw = data.encode() if isinstance(data, str) else data
    with atomic_path(path, needed=len(raw)) as tmp, open(tmp, "wb") as fh:
        fh.write(raw)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())


def write_json(path: str, obj) -> None:
    write_atomic(path, json.dumps(json_safe(obj), indent=2) + "\n")


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
