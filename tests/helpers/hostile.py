"""The hostile user's harness (tests/test_fuzz.py): a command run as a user runs it, and what a refusal must be.

A refusal exits non-zero, prints no traceback, says the value, the rule and the fix on one line, and writes
nothing. Commands run in this process (``launcher.cli.main``, hundreds of cases in seconds); an exception that
escapes ``main`` is what a user would see as a traceback, so it is returned in the text of stderr.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import traceback
import zlib

from launcher import cli
from launcher.machine import dist

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR",
                 "TORCHELASTIC_RESTART_COUNT")


def vramfit(capsys, monkeypatch, *argv, env=None, cwd=None, console=False, out=False):
    """``vramfit ARGV`` in this process with the launcher's variables ``env`` (the others unset): (exit code,
    stderr), and stdout too with ``out`` (``capfd`` as ``capsys``: a command's result goes to file descriptor 1).
    ``console``: through the console script's path (``main()`` reading ``sys.argv``)."""
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    if cwd:
        monkeypatch.chdir(cwd)
    argv = [str(a) for a in argv]
    dist.current.cache_clear()
    capsys.readouterr()
    tb = ""
    try:
        if console:
            monkeypatch.setattr(sys, "argv", ["vramfit", *argv])
            # the console script's process ends after main and destroys even a process group of one; this test
            # process goes on, and DeepSpeed keeps groups made from the one it made earlier: keep it, as in-process
            # callers of main(argv) do
            shutdown = dist.shutdown
            monkeypatch.setattr(dist, "shutdown", lambda keep_single=False: shutdown(keep_single=True))
            rc = cli.main()
        else:
            rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    except BaseException:  # noqa: BLE001 -- anything escaping main is a traceback to the user
        rc, tb = None, traceback.format_exc()
    finally:
        dist.current.cache_clear()
    captured = capsys.readouterr()
    return (rc, captured.err + tb, captured.out) if out else (rc, captured.err + tb)


def snapshot(root) -> dict:
    """{relative path: (size, CRC-32, mode)} of every file and {path/: mode} of every directory under ``root``."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            p = os.path.join(d, name)
            out[os.path.relpath(p, root) + "/"] = os.stat(p).st_mode
        for name in files:
            p = os.path.join(d, name)
            try:
                with open(p, "rb") as fh:
                    crc = zlib.crc32(fh.read())
            except PermissionError:  # a file the case made unreadable: its size and mode tell a change
                crc = None
            out[os.path.relpath(p, root)] = (os.path.getsize(p), crc, os.stat(p).st_mode)
    return out


def changes(before: dict, after: dict) -> list[str]:
    return sorted(k for k in set(before) | set(after) if before.get(k, "absent") != after.get(k, "absent"))


def message_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if "rule:" in ln and "fix:" in ln]


def refused(rc, err, *names, code=2) -> None:
    """Exit ``code`` (any non-zero one when None), no traceback, and one message line that names the value, the rule
    and the fix and holds every one of ``names`` (each a string, or a tuple of strings of which one must appear)."""
    assert (rc != 0 and rc is not None) if code is None else rc == code, f"exit code {rc}, wanted {code}:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    lines = message_lines(err)
    assert lines, f"no line with rule and fix:\n{err[-3000:]}"

    def has(line, n):
        return any(x in line for x in n) if isinstance(n, tuple) else n in line

    assert any(all(has(ln, n) for n in names) for ln in lines), (
        f"no one line names all of {names!r}:\n" + "\n".join(lines))


# ------------------------------------------------------------------------------------------------
# Read-only folders


def is_root() -> bool:
    return os.geteuid() == 0


@contextlib.contextmanager
def read_only(monkeypatch, *paths):
    """Make folders read-only (mode 555) for the ``with`` block. The superuser writes there all the same, and the
    kernel's access(2) says so, so as root ``os.access`` answers as it does for anyone else: no write where the
    mode grants none. The commands refuse on ``os.access``'s word, so a refusal that goes missing is seen either
    way: as root the command then writes there, and the snapshot shows it. ``really_read_only`` makes a folder
    read-only for root too, for the cases run in a fresh interpreter."""
    modes = {p: os.stat(p).st_mode for p in paths}
    for p in paths:
        os.chmod(p, 0o555)
    if is_root():
        real = os.access

        def access(path, mode, *a, **k):
            if mode & os.W_OK and os.path.exists(path) and not os.stat(path).st_mode & 0o222:
                return False
            return real(path, mode, *a, **k)

        monkeypatch.setattr(os, "access", access)
    try:
        yield
    finally:
        for p, m in modes.items():
            os.chmod(p, stat.S_IMODE(m))
        if is_root():
            monkeypatch.setattr(os, "access", real)


@contextlib.contextmanager
def really_read_only(path):
    """``path``, an existing folder, read-only for this process and the ones it starts, as the kernel sees it: mode
    555 for a user; for root, whom modes do not stop, a read-only tmpfs mounted over it with its content copied in
    (skipped where this process may not mount). What was there before is there again afterwards."""
    import pytest

    if not is_root():
        mode = os.stat(path).st_mode
        os.chmod(path, 0o555)
        try:
            yield
        finally:
            os.chmod(path, stat.S_IMODE(mode))
        return
    if shutil.which("mount") is None:
        pytest.skip("running as root without a mount command: no folder is read-only for root")
    with tempfile.TemporaryDirectory() as keep:
        content = os.path.join(keep, "content")
        shutil.copytree(path, content)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"running as root, and cannot mount a read-only tmpfs here ({r.stderr.strip()}): no folder "
                        "is read-only for root")
        try:
            shutil.copytree(content, path, dirs_exist_ok=True)
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)
            yield
        finally:
            subprocess.run(["umount", str(path)], check=True, capture_output=True)
