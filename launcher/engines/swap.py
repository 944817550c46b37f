"""NVMe swap folders: one per DeepSpeed engine under ``memory.nvme_path``, removed when the engine closes, at exit,
or, when a run was killed before either, by the next run on this host that finds them."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile

from launcher.log import logger
from launcher.machine.files import tree_bytes

_OPEN: set[str] = set()  # the swap folders of engines not closed yet: removed at exit if still there


@atexit.register
def _remove_open() -> None:
    for folder in list(_OPEN):
        shutil.rmtree(folder, ignore_errors=True)


def release(folder: str) -> None:
    """Remove an engine's swap folder (it closed)."""
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        _OPEN.discard(folder)


SWAP_PREFIX = "vramfit-swap-"


def nvme_folder(cfg, spec) -> str:
    """ZeRO-Infinity's swap folder: a new folder of this engine's under ``memory.nvme_path``
    (``vramfit-swap-<host>-<pid>-<random>``). DeepSpeed writes a file per swapped tensor there and never deletes
    them, and its checkpoints copy the whole folder, so each engine (an OOM ladder's rebuild is another) gets its
    own: a checkpoint then holds only its engine's files. The engine removes it when it closes (:func:`release`);
    folders left by processes of this host that no longer run (killed) are removed here."""
    if not spec.profile.nvme:
        return ""
    root = os.path.abspath(os.path.expanduser(cfg.memory.nvme_path))
    remove_stale_swap_folders(root)
    folder = tempfile.mkdtemp(prefix=f"{SWAP_PREFIX}{_host()}-{os.getpid()}-", dir=root)
    _OPEN.add(folder)
    return folder


def _host() -> str:
    return socket.gethostname().replace("/", "_") or "host"


def remove_stale_swap_folders(root: str) -> list[str]:
    """Remove the swap folders under ``root`` that this host's processes made and that are gone (a run killed
    before its engine closed): gigabytes of scratch that would otherwise fill the disk run after run. Only this
    host's: a disk mounted in several containers or machines holds folders whose process IDs mean nothing
    here. Returns what was removed."""
    removed = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        host, pid, _ = (name[len(SWAP_PREFIX):].rsplit("-", 2) + ["", "", ""])[:3] if name.startswith(
            SWAP_PREFIX) and name.count("-") >= 4 else ("", "", "")
        path = os.path.join(root, name)
        if (host != _host() or not pid.isdigit() or not os.path.isdir(path) or os.path.islink(path)
                or _alive(int(pid))):
            continue
        size = tree_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        logger.info(f"removed {path} ({size / 2**30:.2f} GiB): the NVMe swap folder of a run that is no longer "
                    f"running (process {pid})")
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
