"""What of DeepSpeed this machine can use: whether it imports (a broken install is hidden for the whole process),
its CPU Adam and async_io ops, and the JIT builds of its ops (which ninja builds them, whether a load would compile,
building them ahead with ``vramfit doctor --build-ops``). Read by the probe (:mod:`launcher.machine.hardware`), the
DeepSpeed engine and the calibration."""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import shutil
import sys
import time
from dataclasses import dataclass


def deepspeed_status() -> tuple[str | None, str | None]:
    """(version, error): DeepSpeed is usable when it imports; the error says why not, as a phrase that
    follows "DeepSpeed" ("is not installed ...", "failed to import: ...").

    A DeepSpeed that is installed but does not import (a wheel built for another CUDA, say) is made
    absent for the whole process: transformers and accelerate ask ``find_spec("deepspeed")`` and import it
    whenever it is found (``save_pretrained`` unwraps models through accelerate), so a broken one on the
    path would crash them long after vramfit decided to train without it."""
    if os.environ.get("VRAMFIT_DISABLE_DEEPSPEED"):
        hide_module("deepspeed")
        return None, "is disabled by VRAMFIT_DISABLE_DEEPSPEED"
    if _IMPORT_FAILED.get("deepspeed") and sys.modules.get("deepspeed", 0) is None:  # hidden by an earlier call
        return None, _IMPORT_FAILED["deepspeed"]
    if importlib.util.find_spec("deepspeed") is None:
        return None, "is not installed (pip install 'vramfit[deepspeed]')"
    try:
        import deepspeed  # noqa: F401

        return deepspeed.__version__, None
    except Exception as e:  # a broken install raises all sorts of things
        hide_module("deepspeed")
        _IMPORT_FAILED["deepspeed"] = (
            f"failed to import ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}), so it is treated as "
            "not installed; fix the install (e.g. a DeepSpeed built for this torch and CUDA) or pip uninstall deepspeed")
        return None, _IMPORT_FAILED["deepspeed"]


_IMPORT_FAILED: dict[str, str] = {}  # why a module that failed to import was hidden, for every later caller to say


def hide_module(name: str) -> None:
    """Make ``name`` unimportable in this process: ``import name`` raises ModuleNotFoundError and
    ``importlib.util.find_spec(name)`` returns None (a None entry in sys.modules means both). Submodules
    left behind by a failed import go too."""
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    sys.modules[name] = None  # type: ignore[assignment]


def cpu_adam_status(deepspeed_error: str | None) -> str:
    """Whether DeepSpeed's CPU Adam op is built already or can be JIT-built (compiler + ninja)."""
    err = deepspeed_error
    if err:
        return f"unavailable: deepspeed {err}"
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        b = CPUAdamBuilder()
        if getattr(b, "is_compatible", lambda verbose=False: True)(False) is False:
            return "unavailable: not compatible with this system"
        for _root, _dirs, files in os.walk(op_cache_dir()):
            if any(f.startswith("cpu_adam") and f.endswith(".so") for f in files):
                return "built"
        if shutil.which("ninja") is None and importlib.util.find_spec("ninja") is None:
            return "unavailable: ninja not found (pip install ninja)"
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            return "unavailable: no C++ compiler (apt-get install g++)"
        return "buildable (JIT on first use, a few minutes)"
    except Exception as e:
        return f"unavailable: {type(e).__name__}: {e}"


_ASYNC_IO: dict = {}


def async_io_status(deepspeed_error: str | None = None) -> str:
    """'usable', or why DeepSpeed's async_io op (what ZeRO-Infinity reads and writes NVMe with) cannot build
    here: it compiles against libaio (Debian: apt-get install libaio-dev). Asked once per process."""
    if deepspeed_error:
        return f"unavailable: deepspeed {deepspeed_error}"
    if "status" not in _ASYNC_IO:
        try:
            from deepspeed.ops.op_builder import AsyncIOBuilder

            ok = AsyncIOBuilder().is_compatible(verbose=False)
            _ASYNC_IO["status"] = "usable" if ok else ("unavailable: libaio was not found (apt-get install libaio-dev, "
                                                        "then vramfit doctor)")
        except Exception as e:  # noqa: BLE001 -- a broken op builder says what it says
            _ASYNC_IO["status"] = f"unavailable: {type(e).__name__}: {e}"
    return _ASYNC_IO["status"]




def build_ops() -> str:
    """JIT-build the DeepSpeed ops vramfit uses (CPU Adam; FusedAdam and the shared-memory comm op on a
    CPU-only host) now, so that the first run does not wait minutes for the compiler."""
    ver, err = deepspeed_status()
    if err:
        return f"DeepSpeed ops: not built, deepspeed {err}"

    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    lines = [ninja_report()]
    use_env_ninja()  # the ninja every run uses (see use_env_ninja): a build by another one would not be reused
    remember_cpu_info()  # DeepSpeed probes the CPU anew for every op it builds
    if acc.device_name() == "cpu":
        # The shared-memory comm op through DeepSpeed's own call, the one its process group makes.
        from deepspeed.comm.torch import build_shm_op

        t = time.perf_counter()
        try:
            build_shm_op()
            lines.append(f"ShareMemCommBuilder: ready ({time.perf_counter() - t:.0f} s)")
        except Exception as e:  # report, do not hide: the run would fail the same way later
            lines.append(f"ShareMemCommBuilder: FAILED: {type(e).__name__}: {e}")
    names = ["CPUAdamBuilder"] + (["FusedAdamBuilder"] if acc.device_name() == "cpu" else [])
    for name in names:
        t = time.perf_counter()
        try:
            builder = acc.create_op_builder(name)
            if builder is None:
                lines.append(f"{name}: not used by the {acc.device_name()} accelerator")
                continue
            builder.load(verbose=False)
            lines.append(f"{name}: ready ({time.perf_counter() - t:.0f} s)")
        except Exception as e:  # report, do not hide: the run would fail the same way later
            lines.append(f"{name}: FAILED: {type(e).__name__}: {e}")
    return "DeepSpeed ops:\n  " + "\n  ".join(lines)


def op_cache_dir() -> str:
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")


# ------------------------------------------------------------------------------------------------
# DeepSpeed's JIT ops: which ninja builds them, whether a load would compile


def deepspeed_op_names() -> list[str]:
    """DeepSpeed's JIT ops a vramfit run or benchmark may load here: the shared-memory comm op (DeepSpeed's CPU
    accelerator loads it with the process group), and its Adam ops (a user's deepspeed_config with an
    ``optimizer`` section; the catalogue's profiles step with torch's fused AdamW and need neither)."""
    try:
        from deepspeed.accelerator import get_accelerator

        cpu = get_accelerator().device_name() == "cpu"
    except Exception:  # noqa: BLE001 -- DeepSpeed not importable: no ops to speak of
        return []
    return (["deepspeed_shm_comm"] if cpu else []) + ["cpu_adam", "fused_adam"]


_PATH_AT_START = os.environ.get("PATH", "")  # before use_env_ninja: what a plain start of this command finds

# Minutes a first build of each op took on a 2-core EPYC (its ninja logs; load 2-8 while it built): what the
# notice says when this machine has no build of its own on record.
OP_BUILD_MINUTES = {"cpu_adam": 1, "fused_adam": 4, "deepspeed_shm_comm": 2}


def env_ninja() -> str | None:
    """The ninja of this Python environment (the ``ninja`` package, a DeepSpeed dependency), or None."""
    try:
        import ninja
    except ImportError:
        return None
    path = os.path.join(getattr(ninja, "BIN_DIR", ""), "ninja")
    return path if os.access(path, os.X_OK) else None


def use_env_ninja() -> str | None:
    """Put this environment's ninja first on ``PATH`` (for this process and its children); returns the ninja
    that torch's JIT builds now run.

    torch runs whichever ``ninja`` ``PATH`` finds first, and two versions disagree about what is built:
    ninja 1.13 hashes the build commands it records in ``.ninja_log`` with another function than 1.11, so each
    reads the other's entries as "command line changed" and compiles the op again (minutes) although
    ``build.ninja`` and the sources are the same. An activated environment finds its own ninja (1.13 from the
    ``ninja`` package here), ``.venv/bin/python -m launcher`` without activation the system's (1.11): runs
    started both ways rebuilt each op in turn. Putting the environment's ninja first is what activating
    the environment does, for this one tool."""
    mine = env_ninja()
    if mine is None:
        return shutil.which("ninja")
    folder = os.path.dirname(mine)
    parts = os.environ.get("PATH", "").split(os.pathsep)
    if not parts or parts[0] != folder:
        os.environ["PATH"] = os.pathsep.join([folder] + [x for x in parts if x != folder])
    return mine


def remember_cpu_info() -> None:
    """Keep py-cpuinfo's first answer for the rest of this process. ``cpuinfo.get_cpu_info()`` starts a Python
    subprocess to read the CPU's flags: 1.2-1.4 s a call on a 2-core Xeon. DeepSpeed calls it twice for every
    op it JIT-loads (its ``-march`` and SIMD flags) and once for every ``DeepSpeedCPUAdam`` made, each time
    anew: five calls, 6.7 s, in a calibration's optimizer part. The CPU does not change while a process runs.
    Each caller gets its own deep copy: the flags are a list a caller could change."""
    try:
        import cpuinfo
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "remembered", False):
        return
    first = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info() -> dict:
        return copy.deepcopy(first())

    get_cpu_info.remembered = True
    cpuinfo.get_cpu_info = get_cpu_info


@dataclass
class OpState:
    name: str
    state: str  # 'installed' (prebuilt with DeepSpeed) | 'built' | 'stale' (a load recompiles) | 'not built'
    detail: str = ""  # why stale, or what is missing
    last_build_s: float | None = None  # how long this machine's last build of it took (from the ninja log)

    @property
    def compiles(self) -> bool:
        """Loading the op now runs the compiler."""
        return self.state in ("stale", "not built")

    def notice(self) -> str:
        """What a run says before loading an op that compiles (a build is never silent)."""
        minutes = (max(1, round(self.last_build_s / 60)) if self.last_build_s
                   else OP_BUILD_MINUTES.get(self.name, 2))
        first = "first use" if self.state == "not built" else f"its build is out of date: {self.detail}"
        return (f"building DeepSpeed op {self.name} ({first}, about {minutes} minute{'s' if minutes != 1 else ''}; "
                "`vramfit doctor --build-ops` builds them ahead of a run)")


def _last_build_s(folder: str) -> float | None:
    """Seconds of the last build in ``folder``'s ``.ninja_log`` (its lines: start ms, end ms, mtime, output, hash)."""
    try:
        with open(os.path.join(folder, ".ninja_log")) as fh:
            rows = [ln.split("\t") for ln in fh if not ln.startswith("#")]
    except OSError:
        return None
    ends = [int(r[1]) for r in rows if len(r) >= 5 and r[1].isdigit()]
    # a build starts again at 0 ms: the last build is the run of entries after the last restart
    starts = [i for i, r in enumerate(rows) if len(r) >= 5 and r[0].isdigit() and int(r[0]) < 50]
    if not ends or not starts:
        return None
    last = rows[starts[-1]:]
    return max(int(r[1]) for r in last if len(r) >= 5 and r[1].isdigit()) / 1000.0


def op_state(name: str, ninja: str | None = None) -> OpState:
    """Whether loading DeepSpeed's op ``name`` would compile, asked of the ninja torch will run (``ninja -n``:
    a dry run that changes nothing). It judges the ``build.ninja`` already there; a DeepSpeed or torch
    upgrade that changes the flags rewrites that file at the next load and so is not seen here."""
    import subprocess

    try:
        from deepspeed.git_version_info import installed_ops

        if installed_ops.get(name):
            return OpState(name, "installed")
    except Exception:  # noqa: BLE001 -- DeepSpeed not importable: then nothing is built either
        pass
    folder = os.path.join(op_cache_dir(), name)
    last = _last_build_s(folder)
    if not os.path.isfile(os.path.join(folder, f"{name}.so")):
        return OpState(name, "not built", f"no {name}.so in {folder}", last)
    ninja = ninja or shutil.which("ninja")
    if ninja is None or not os.path.isfile(os.path.join(folder, "build.ninja")):
        return OpState(name, "built", "not checked: no ninja or no build.ninja", last)
    try:
        out = subprocess.run([ninja, "-n", "-d", "explain"], cwd=folder, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return OpState(name, "built", f"not checked: {type(e).__name__}", last)
    text = out.stdout + out.stderr
    if out.returncode == 0 and "no work to do" in text:
        return OpState(name, "built", "", last)
    why = next((ln.split("explain:", 1)[1].strip() for ln in text.splitlines() if "explain:" in ln), text.strip()[:200])
    return OpState(name, "stale", f"{why} (ninja {ninja})", last)


def ninja_report() -> str:
    """Which ninja builds DeepSpeed's ops here, and any other one on PATH that a different start would pick."""
    import subprocess

    def version(path):
        try:
            return subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return "?"

    mine = env_ninja()
    found = shutil.which("ninja", path=_PATH_AT_START)
    if mine is None:
        return f"ninja: {found} ({version(found)}) from PATH" if found else "ninja: not found (pip install ninja)"
    text = f"ninja: {mine} ({version(mine)}), this environment's, used for every op build"
    if found and os.path.realpath(found) != os.path.realpath(mine):
        text += f"; PATH alone would find {found} ({version(found)}), which vramfit puts behind it"
    return text


def compilers() -> dict:
    """The compilers JIT-built ops need: g++ (CPU ops; CXX if set) and nvcc (CUDA ops), path or None."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc") or (os.path.join(cuda_home, "bin", "nvcc") if cuda_home and os.path.isfile(
        os.path.join(cuda_home, "bin", "nvcc")) else None)
    return {"cxx": shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++"), "nvcc": nvcc}


def stale_op_locks(max_age_s: float = 900.0) -> list[str]:
    """Build locks of JIT-compiled ops older than ``max_age_s``.

    torch takes ``<op>/lock`` around every JIT load (a real build takes minutes, an up-to-date check a
    second). A process killed inside that window leaves the file behind, and every later run waits on it
    forever without a word. A lock older than any build is one nobody will release."""

    root, now, found = op_cache_dir(), time.time(), []
    if not os.path.isdir(root):
        return found
    for d, _dirs, files in os.walk(root):
        if "lock" in files:
            path = os.path.join(d, "lock")
            try:
                if now - os.path.getmtime(path) > max_age_s:
                    found.append(path)
            except OSError:
                pass
    return found


def clear_stale_op_locks(max_age_s: float = 900.0) -> list[str]:
    removed = []
    for path in stale_op_locks(max_age_s):
        try:
            os.remove(path)
            removed.append(path)
        except OSError:
            pass
    return removed
