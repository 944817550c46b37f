"""The hardware probe: what this machine can run, read once before anything is loaded.

Everything here shows in ``vramfit doctor --json``. bf16 support is decided by compute capability
(>= 8.0, Ampere and newer), not by ``torch.cuda.is_bf16_supported()``, which answers yes on a T4
through emulation. What of DeepSpeed is usable (the package, its ops and their builds) is asked of
:mod:`launcher.machine.deepspeed_ops`.
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import shutil
from dataclasses import asdict, dataclass, field

from launcher.machine.deepspeed_ops import (
    async_io_status,
    compilers,
    cpu_adam_status,
    deepspeed_op_names,
    deepspeed_status,
    ninja_report,
    op_state,
    stale_op_locks,
    use_env_ninja,
)
from launcher.precision import supports_bf16, supports_fp16
from launcher.units import GiB


@dataclass
class GPUInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    capability: tuple[int, int]
    fp16: bool
    bf16: bool


@dataclass
class Hardware:
    gpus: list[GPUInfo] = field(default_factory=list)
    ram_total_bytes: int = 0
    ram_available_bytes: int = 0
    swap_total_bytes: int = 0
    swap_free_bytes: int = 0
    memlock_limit_bytes: int | None = None  # `ulimit -l`; None = unlimited
    shm_free_bytes: int | None = None
    cpu_count: int = 1
    python: str = ""
    torch: str = ""
    cuda: str | None = None
    deepspeed: str | None = None
    deepspeed_error: str | None = None
    cpu_adam: str = "unknown"  # 'built' | 'buildable' | 'unavailable: why'
    transformers: str | None = None
    peft: str | None = None
    bitsandbytes: str | None = None
    stale_op_locks: list[str] = field(default_factory=list)
    compilers: dict = field(default_factory=dict)  # 'cxx' and 'nvcc': path or None (doctor)
    ninja: str = ""  # which ninja builds DeepSpeed's ops (doctor)
    ops: dict = field(default_factory=dict)  # DeepSpeed op -> {'state', 'detail'} (doctor)
    threads: dict = field(default_factory=dict)  # the training process's thread settings (launcher.machine.threads)
    async_io: str = "not checked"  # DeepSpeed's async_io op (ZeRO-Infinity's NVMe offload): 'usable' or why not
    nvme: dict | None = None  # memory.nvme_path measured (probe_disk): path, free_bytes, fs_type, tmpfs, speeds

    @property
    def has_cuda(self) -> bool:
        return bool(self.gpus)

    def gpu(self, index: int = 0) -> GPUInfo | None:
        return self.gpus[index] if index < len(self.gpus) else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["has_cuda"] = self.has_cuda
        return d


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


_DISKS: dict = {}


def probe_disk(path: str, sample_bytes: int = 64 * 1024 * 1024) -> dict:
    """``memory.nvme_path`` measured: free bytes, the file system (tmpfs is RAM in disguise), and its write and
    read speeds: ``sample_bytes`` written and fsynced, dropped from the page cache, read back (once per path
    and process; about a second on an NVMe disk). vramfit's calibration measures the output directory's disk;
    the swap folder may be another disk, so it is measured here."""
    import time

    path = os.path.abspath(os.path.expanduser(path))
    if path in _DISKS:
        return dict(_DISKS[path])
    out = {"path": path, "free_bytes": int(shutil.disk_usage(path).free), "fs_type": _fs_type(path)}
    out["tmpfs"] = out["fs_type"] in ("tmpfs", "ramfs")
    chunk = os.urandom(4 * 1024 * 1024)
    name = os.path.join(path, f".vramfit-disk-{os.getpid()}")
    try:
        t = time.perf_counter()
        with open(name, "wb") as fh:
            for _ in range(max(1, sample_bytes // len(chunk))):
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        written = max(1, sample_bytes // len(chunk)) * len(chunk)
        out["write_bytes_per_s"] = written / max(time.perf_counter() - t, 1e-9)
        fd = os.open(name, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read the disk, not the page cache
            t = time.perf_counter()
            while os.read(fd, len(chunk)):
                pass
            out["read_bytes_per_s"] = written / max(time.perf_counter() - t, 1e-9)
        finally:
            os.close(fd)
    except OSError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        with contextlib.suppress(OSError):
            os.remove(name)
    _DISKS[path] = out
    return dict(out)


def _fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (from /proc/mounts; '' when unknown)."""
    best, kind = "", ""
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) >= len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def with_nvme(hw: Hardware, nvme_path: str) -> Hardware:
    """``hw`` with ``memory.nvme_path`` measured (unchanged when it is empty or not a usable folder: the config
    check has said why)."""
    if nvme_path and os.path.isdir(os.path.expanduser(nvme_path)) and os.access(os.path.expanduser(nvme_path), os.W_OK):
        hw.nvme = probe_disk(nvme_path)
    return hw


def memlock_limit() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def probe(with_cpu_adam: bool = False) -> Hardware:
    import psutil
    import torch

    hw = Hardware()
    vm, sw = psutil.virtual_memory(), psutil.swap_memory()
    hw.ram_total_bytes, hw.ram_available_bytes = int(vm.total), int(vm.available)
    hw.swap_total_bytes, hw.swap_free_bytes = int(sw.total), int(sw.free)
    hw.memlock_limit_bytes = memlock_limit()
    if os.path.isdir("/dev/shm"):
        hw.shm_free_bytes = int(shutil.disk_usage("/dev/shm").free)
    hw.cpu_count = os.cpu_count() or 1
    hw.python = platform.python_version()
    hw.torch = torch.__version__
    hw.cuda = torch.version.cuda
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            cap = (props.major, props.minor)
            hw.gpus.append(GPUInfo(i, props.name, int(total), int(free), cap, fp16=supports_fp16(cap), bf16=supports_bf16(cap)))
    hw.deepspeed, hw.deepspeed_error = deepspeed_status()
    hw.cpu_adam = cpu_adam_status(hw.deepspeed_error) if with_cpu_adam else "not checked"
    hw.stale_op_locks = stale_op_locks() if with_cpu_adam else []
    if with_cpu_adam:
        hw.compilers, hw.ninja = compilers(), ninja_report()
        if hw.deepspeed_error is None:
            ninja = use_env_ninja()
            hw.ops = {n: {"state": st.state, "detail": st.detail} for n in deepspeed_op_names()
                      for st in [op_state(n, ninja)]}
    hw.async_io = async_io_status(hw.deepspeed_error) if with_cpu_adam else "not checked"
    hw.transformers, hw.peft, hw.bitsandbytes = _version("transformers"), _version("peft"), _version("bitsandbytes")
    return hw


def pin_memory_ok(hw: Hardware, pinned_bytes: int) -> tuple[bool, str]:
    """Pinned (page-locked) host memory only when ``ulimit -l`` and free RAM allow it."""
    if not hw.has_cuda:
        return False, "no CUDA device: pinned memory brings nothing"
    if hw.memlock_limit_bytes is not None and hw.memlock_limit_bytes < pinned_bytes:
        return False, (f"ulimit -l is {hw.memlock_limit_bytes / GiB:.2f} GiB < {pinned_bytes / GiB:.2f} GiB to pin; "
                       "pin_memory off (raise it with `ulimit -l unlimited` or docker --ulimit memlock=-1)")
    if pinned_bytes > hw.ram_available_bytes:  # the plan holds the whole host peak, pinned blocks included, to the
        return False, (f"pinning {pinned_bytes / GiB:.2f} GiB would lock more than the "  # budget
                       f"{hw.ram_available_bytes / GiB:.2f} GiB of RAM available; pin_memory off")
    return True, "ulimit -l and free RAM allow it"


def enforce_gpu_budget(gpu_budget, device) -> str | None:
    """``memory.gpu_budget=GiB`` on a bigger card: cap this process's allocator, so that a 16 GB card can be
    reproduced on any larger one (allocations past the cap raise OutOfMemoryError like a full card).
    Returns what was done, for the log (None: nothing to do)."""
    import torch

    if gpu_budget == "auto":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    budget = float(gpu_budget) * GiB
    if budget >= total:
        return None
    torch.cuda.set_per_process_memory_fraction(budget / total, device)
    return f"GPU budget {gpu_budget} GiB enforced: {budget / total:.1%} of {total / GiB:.1f} GiB"


def format_report(hw: Hardware) -> str:
    def gb(x):
        return "n/a" if x is None else f"{x / GiB:.1f} GiB"

    lines = []
    if hw.gpus:
        for g in hw.gpus:
            lines.append(f"GPU {g.index}: {g.name}, {gb(g.free_bytes)} free of {gb(g.total_bytes)}, "
                         f"compute {g.capability[0]}.{g.capability[1]}, fp16 {'yes' if g.fp16 else 'no'}, "
                         f"bf16 {'yes' if g.bf16 else 'no (capability < 8.0)'}")
    else:
        lines.append("GPU: none (training runs on the CPU)")
    lines.append(f"RAM: {gb(hw.ram_available_bytes)} available of {gb(hw.ram_total_bytes)}; "
                 f"swap {gb(hw.swap_free_bytes)} free of {gb(hw.swap_total_bytes)}")
    lines.append(f"ulimit -l: {'unlimited' if hw.memlock_limit_bytes is None else gb(hw.memlock_limit_bytes)}; "
                 f"/dev/shm free: {gb(hw.shm_free_bytes)}; CPUs: {hw.cpu_count}")
    lines.append(f"python {hw.python}, torch {hw.torch}, CUDA {hw.cuda or 'none'}, "
                 f"transformers {hw.transformers}, peft {hw.peft}, bitsandbytes {hw.bitsandbytes or 'not installed'}")
    lines.append(f"deepspeed: {hw.deepspeed or 'not usable: DeepSpeed ' + str(hw.deepspeed_error)}; "
                 f"CPU Adam op: {hw.cpu_adam}; async_io op (NVMe offload): {hw.async_io}")
    if hw.threads:
        t = hw.threads
        lines.append(f"threads: {t['intra_op']} intra-op ({t['parallel_backend']}), {t['interop']} inter-op, {t['cores']} "
                     f"cores; OMP_WAIT_POLICY {t['wait_policy']}; a run sets its own with train.threads (auto: the "
                     "cores other processes leave free)")
    if hw.compilers:
        lines.append(f"compilers: g++ {hw.compilers.get('cxx') or 'not found (CPU ops cannot be JIT-built)'}; nvcc "
                     f"{hw.compilers.get('nvcc') or 'not found (CUDA ops cannot be JIT-built; vramfit needs none)'}")
    if hw.ninja:
        lines.append(hw.ninja)
    for name, st in hw.ops.items():
        if st["state"] == "stale":
            lines.append(f"DeepSpeed op {name}: would be REBUILT at its next load ({st['detail']}); "
                         "vramfit doctor --build-ops rebuilds it now")
        else:
            lines.append(f"DeepSpeed op {name}: {st['state']}" + (f" ({st['detail']})" if st["detail"] else ""))
    for path in hw.stale_op_locks:
        lines.append(f"stale op build lock (a killed run left it; runs would wait on it): {path} -- "
                     "training removes it, or delete it yourself")
    return "\n".join(lines)

