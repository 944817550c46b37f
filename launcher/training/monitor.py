"""See the memory while training: a sampler thread, per-phase peaks per step, a leak check, a picture.

- **Timeline** (``memory.csv``, rank 0): a daemon thread samples every ``log.memory_interval_s``: this
  process's GPU memory (``torch.cuda.memory_allocated``/``memory_reserved``), the whole device's used
  memory (NVML through ``torch.cuda.device_memory_used``; ``cudaMemGetInfo`` when pynvml is absent), so
  other tenants show; this process's RSS, the RSS of the process tree (DeepSpeed and torch start
  worker processes) and the system's available RAM.
- **Per-step peaks** (``metrics.jsonl``): the loop marks the micro-batches and the optimizer step;
  hooks on the model mark where a training forward starts and ends, so a step splits into ``forward``
  (until the loss), ``backward`` and ``step``. At each switch the peak of the phase that ended is read
  and the counter reset. GPU: ``torch.cuda.max_memory_allocated`` / ``reset_peak_memory_stats``
  (``peak_forward_bytes``, ``peak_backward_bytes``, ``peak_step_bytes``; null without a GPU: on a CPU
  there is no allocator counter to reset, and samples every 0.5 s would miss a phase's peak). CPU: the
  process's RSS high-water mark (Linux ``VmHWM`` in ``/proc/self/status``, reset by writing 5 to
  ``/proc/self/clear_refs``): exact peaks, not samples, split at the optimizer step only
  (``peak_forward_backward_rss_bytes``, ``peak_step_rss_bytes``; null where the kernel does not allow
  the reset), because one read of /proc costs about 0.1 ms after a step's work has cooled the caches and
  per micro-batch that would show on fast GPU steps. With accumulation a phase's peak is the largest
  over the micro-batches. The run's overall peaks are kept across the resets
  (:meth:`MemoryMonitor.peak_gpu_bytes`), so ``summary.json``'s ``peak_gpu_bytes`` is unchanged.
- **Leak check**: after a warm-up of ``log.leak_steps`` steps, memory after each step (GPU allocated,
  and CPU RSS) that rises over the last ``log.leak_steps`` steps by at least ``log.leak_mib`` without
  ever falling is reported once per series (log line + ``memory_warnings`` in summary.json).
- **Picture** (``memory.png``, drawn by :mod:`launcher.training.plots`): the timeline, the per-phase peaks and
  the planned peaks.

Cost: a sample reads /proc a few times (under a millisecond, every 0.5 s by default); per step, three
RSS high-water reads (0.1-0.2 ms together) and a few microseconds per GPU phase switch.
``scripts/bench_monitor.py`` measures the effect on tokens/s.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import os
import resource
import threading
import time
import weakref

import psutil
import torch

from launcher.log import logger
from launcher.units import GiB, MiB

PHASES = ("forward", "backward", "step")  # GPU peaks: the model hooks split forward from backward
# A run's host phases (summary.json's peak_rss_by_phase, planned as the plan's host phases): set-up until the first
# step (imports, plan, data, the model made, sharded and pinned, the engine's buffers), the steps, checkpoint saves,
# final/ written. Each is the RSS high-water mark while it lasts (the set-up's from the process's start).
HOST_PHASES = ("setup", "train", "checkpoint", "final")
RSS_PHASES = ("forward_backward", "step")  # RSS peaks: split at the optimizer step only (see the docstring)
CSV_COLUMNS = ("time_s", "step", "phase", "gpu_allocated_bytes", "gpu_reserved_bytes", "gpu_device_used_bytes",
               "gpu_device_total_bytes", "cpu_rss_bytes", "cpu_tree_rss_bytes", "ram_available_bytes")
CHILDREN_REFRESH_S = 10.0  # listing the process tree walks /proc (milliseconds); the list is reused between


# ------------------------------------------------------------------------------------------------
# Pure parts


def detect_leak(values: list[float], window: int, min_growth: float, tolerance: float = MiB) -> float | None:
    """Growth over the last ``window`` values when memory only grew, by at least ``min_growth``.

    "Only grew": no step fell by more than ``tolerance`` (allocator noise), and at least half of the
    steps rose. Returns the growth in the values' unit, or None when there is no leak to report.
    """
    if window < 2 or len(values) < window:
        return None
    w = list(values)[-window:]
    diffs = [b - a for a, b in zip(w, w[1:])]
    if any(d < -tolerance for d in diffs):
        return None
    if sum(d > 0 for d in diffs) < len(diffs) / 2:
        return None
    growth = w[-1] - w[0]
    return growth if growth >= min_growth else None


# ------------------------------------------------------------------------------------------------
# Readers


class _RssHighWater:
    """This process's RSS high-water mark, resettable through ``/proc/self/clear_refs`` (Linux).

    Read from ``getrusage`` (a few microseconds) when it agrees with ``VmHWM`` in ``/proc/self/status``
    (about 0.1 ms to generate after a step's work): ``ru_maxrss`` also keeps the high-water mark of the
    memory this process had before ``exec`` -- a parent's, when started by ``vfork`` as Python's
    subprocess does -- as a floor that no reset lowers; when that floor is above our own mark, /proc it is.
    """

    def __init__(self):
        self.status = self.clear = None
        self.initial = None  # the high-water mark before the first reset (model load, data, ...)
        self.rusage = False
        try:
            self.status = os.open("/proc/self/status", os.O_RDONLY)
            self.initial = self.read()
        except (OSError, ValueError):
            self.status = None
            return
        try:
            self.clear = os.open("/proc/self/clear_refs", os.O_WRONLY)
            os.write(self.clear, b"5")
        except OSError:  # not allowed here: the overall peak still reads right, per-phase peaks are null
            self.clear = None
            return
        self.rusage = _ru_maxrss() <= self.read() + MiB

    @property
    def resettable(self) -> bool:
        return self.clear is not None

    def read(self) -> int | None:
        if self.rusage:
            return _ru_maxrss()
        if self.status is None:
            return None
        b = os.pread(self.status, 4096, 0)
        i = b.find(b"VmHWM:")
        return int(b[i + 6:b.index(b"kB", i)]) * 1024 if i >= 0 else None

    def reset(self) -> None:
        if self.clear is not None:
            os.write(self.clear, b"5")

    def close(self) -> None:
        for fd in (self.status, self.clear):
            if fd is not None:
                os.close(fd)
        self.status = self.clear = None
        self.rusage = False

    __del__ = close


def _ru_maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def _device_used_reader(device: torch.device):
    """(fn() -> (used, total) bytes of the whole device, source name), or (None, reason)."""
    if device.type != "cuda":
        return None, "no GPU"
    total = torch.cuda.get_device_properties(device).total_memory
    try:
        torch.cuda.device_memory_used(device)  # NVML (pynvml), maps CUDA_VISIBLE_DEVICES to NVML indices
        return (lambda: (torch.cuda.device_memory_used(device), total)), "nvml"
    except Exception:  # pynvml missing, or no NVML (some containers): the CUDA runtime's view
        pass

    def mem_get_info():
        free, tot = torch.cuda.mem_get_info(device)
        return tot - free, tot

    return mem_get_info, "cudaMemGetInfo"


# ------------------------------------------------------------------------------------------------
# The monitor


class MemoryMonitor:
    """Start after the run directory exists, mark phases from the loop, stop in ``finally``, then plot."""

    def __init__(self, csv_path: str | None, device: torch.device, interval_s: float = 0.5, leak_steps: int = 20,
                 leak_bytes: float = 64 * MiB, enabled: bool = True):
        self.enabled = enabled  # off: no timeline, no per-phase peaks, no leak check; overall peaks still right
        self.csv_path = csv_path if enabled else None  # None: no timeline (ranks other than 0)
        self.device = device
        self.interval_s = float(interval_s)
        self.leak_steps = int(leak_steps)
        self.leak_bytes = float(leak_bytes)
        self.cuda = device.type == "cuda"
        self.phase = "setup"
        self.step = 0
        self.warnings: list[dict] = []
        self.step_peaks: list[tuple] = []  # (time_s, step, {key: bytes}) for the picture, thinned when long
        self._stride = 1
        self._peaks: dict[str, int] = {}
        self._overall = {"gpu": 0, "gpu_reserved": 0, "rss": 0}
        self._max_sample = {"cpu_tree_rss_bytes": 0, "gpu_device_used_bytes": 0}
        self._series = {"gpu_allocated_bytes": collections.deque(maxlen=max(2, self.leak_steps)),
                        "cpu_rss_bytes": collections.deque(maxlen=max(2, self.leak_steps))}
        self._warned: set[str] = set()
        self._watched = None
        self._handles: list = []
        self._thread = None
        self._stop = threading.Event()
        self._fh = self._writer = None
        self._t0 = time.perf_counter()
        self.loop_start_s = None
        self.samples = 0
        self._proc = psutil.Process()
        self._children: list = []
        self._children_at = -1e9
        self._hwm = _RssHighWater()
        self._overall["rss"] = self._hwm.initial or 0
        self._host: dict[str, int] = {"setup": self._hwm.initial or 0} if self._hwm.initial else {}
        self.first_step_wall = None  # time.time() when the first step began
        self._device_used, self.device_source = None, "no GPU"

    @classmethod
    def for_run(cls, cfg, rd, device: torch.device) -> MemoryMonitor:
        interval = cfg.log.memory_interval_s
        return cls(rd.file("memory.csv") if rd.is_main else None, device, interval_s=interval,
                   leak_steps=cfg.log.leak_steps, leak_bytes=cfg.log.leak_mib * MiB, enabled=interval > 0)

    # ---- lifecycle

    def start(self) -> MemoryMonitor:
        self._t0 = time.perf_counter()
        if self.cuda:
            self._device_used, self.device_source = _device_used_reader(self.device)
        if self.csv_path:
            earlier = _continue_csv(self.csv_path)  # a resumed run: its timeline goes on after the earlier ones
            if earlier is not None:
                self._t0 -= earlier
            self._fh = open(self.csv_path, "a", newline="", buffering=1)
            self._writer = csv.writer(self._fh)
            if earlier is None:
                self._writer.writerow(CSV_COLUMNS)
            self.sample()
            # the thread holds only a weak reference: if the run fails before its `finally` stops the
            # monitor, the thread ends once the monitor is gone instead of sampling forever
            self._thread = threading.Thread(target=_sampler, args=(weakref.ref(self), self._stop, self.interval_s),
                                            name="vramfit-memory-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (idempotent); the run's overall peaks stay readable."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
            self._thread = None
        if self.enabled:
            self._close_phase("done")
        self.unwatch()
        if self._fh is not None:
            try:
                self.sample()
                self._fh.close()
            except OSError as e:  # a full disk: the loop reports it; the timeline so far is on disk
                logger.warning(f"memory.csv: the last sample was not written ({e})")
            self._fh = self._writer = None

    # ---- sampling (the thread)

    def _tree_rss(self, rss: int) -> int:
        now = time.perf_counter()
        if now - self._children_at > CHILDREN_REFRESH_S:
            try:
                self._children = self._proc.children(recursive=True)
            except psutil.Error:
                self._children = []
            self._children_at = now
        total = rss
        for c in self._children:
            try:
                total += c.memory_info().rss
            except psutil.Error:  # exited since the last listing
                pass
        return total

    def sample(self) -> dict:
        row = dict.fromkeys(CSV_COLUMNS)
        row["time_s"] = round(time.perf_counter() - self._t0, 3)
        row["step"], row["phase"] = self.step, self.phase
        if self.cuda:
            row["gpu_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            row["gpu_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
            if self._device_used is not None:
                row["gpu_device_used_bytes"], row["gpu_device_total_bytes"] = self._device_used()
        rss = self._proc.memory_info().rss
        row["cpu_rss_bytes"] = rss
        row["cpu_tree_rss_bytes"] = self._tree_rss(rss)
        row["ram_available_bytes"] = psutil.virtual_memory().available
        for k in self._max_sample:
            if row[k] is not None:
                self._max_sample[k] = max(self._max_sample[k], row[k])
        if self._writer is not None:
            self._writer.writerow(["" if row[k] is None else row[k] for k in CSV_COLUMNS])
        self.samples += 1
        return row

    # ---- phases (the loop and the model hooks)

    def _close_phase(self, new: str, rss: bool = True) -> None:
        """Read the peak of the phase that ends, reset the counters, enter ``new``. ``rss=False`` (the
        model hooks) leaves the RSS high-water mark running: the forward and backward of all micro-batches
        are one RSS segment."""
        old = self.phase
        if self.cuda:
            a = torch.cuda.max_memory_allocated(self.device)
            self._overall["gpu"] = max(self._overall["gpu"], a)
            self._overall["gpu_reserved"] = max(self._overall["gpu_reserved"], torch.cuda.max_memory_reserved(self.device))
            if old in PHASES:
                self._peaks[f"gpu:{old}"] = max(self._peaks.get(f"gpu:{old}", 0), a)
            torch.cuda.reset_peak_memory_stats(self.device)
        if rss:
            h = self._hwm.read()
            if h is not None:
                self._overall["rss"] = max(self._overall["rss"], h)
                if self._hwm.resettable or old == "setup":
                    hp = old if old in HOST_PHASES else "train"
                    self._host[hp] = max(self._host.get(hp, 0), h)
                seg = {"forward": "forward_backward", "backward": "forward_backward", "step": "step"}.get(old)
                if seg and self._hwm.resettable:
                    self._peaks[f"rss:{seg}"] = max(self._peaks.get(f"rss:{seg}", 0), h)
                self._hwm.reset()
        self.phase = new

    def mark(self, name: str, engine=None) -> None:
        """The loop enters ``name`` ('forward' before the micro-batches, 'step' before ``engine.step``).
        With ``engine``, its model gets the hooks that split forward from backward (again after the OOM
        ladder builds a new model)."""
        if self.first_step_wall is None:
            self.first_step_wall = time.time()
        if not self.enabled:
            if self.phase == "setup":  # the host phases are kept without the timeline too: one read here
                self._close_phase(name)
            return
        if engine is not None and self._watched is not engine.module():
            self.watch(engine.module())
        if self.loop_start_s is None:
            self.loop_start_s = time.perf_counter() - self._t0
        if self.phase != name:
            self._close_phase(name)

    def unwatch(self) -> None:
        """Drop the hooks and the reference to the watched model (before the OOM ladder replaces it)."""
        for h in self._handles:
            h.remove()
        self._handles, self._watched = [], None

    def watch(self, module: torch.nn.Module) -> None:
        self.unwatch()

        def pre(_m, _args):
            if torch.is_grad_enabled() and self.phase != "forward":
                self._close_phase("forward", rss=False)

        def post(_m, _args, _out):
            if torch.is_grad_enabled() and self.phase == "forward":
                self._close_phase("backward", rss=False)

        self._handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        self._watched = module

    def end_step(self, step: int, mem: dict) -> dict:
        """Close the step: its per-phase peaks (for the metrics row) and the leak check on ``mem``."""
        if not self.enabled:
            return {}
        self._close_phase("other")
        self.step = step
        out = {}
        for ph in PHASES:
            out[f"peak_{ph}_bytes"] = self._peaks.get(f"gpu:{ph}") if self.cuda else None
        for seg in RSS_PHASES:
            out[f"peak_{seg}_rss_bytes"] = self._peaks.get(f"rss:{seg}")
        self._peaks = {}
        if step % self._stride == 0:
            self.step_peaks.append((time.perf_counter() - self._t0, step, out))
            if len(self.step_peaks) > 4000:  # a long run: keep every other point
                self.step_peaks, self._stride = self.step_peaks[::2], self._stride * 2
        if self.leak_steps >= 2:
            self._check_leak(step, mem)
        return out

    def _check_leak(self, step: int, mem: dict) -> None:
        for key, what in (("gpu_allocated_bytes", "GPU memory allocated"), ("cpu_rss_bytes", "CPU RSS")):
            v = mem.get(key)
            if v is None:
                continue
            series = self._series[key]
            series.append(v)
            if key in self._warned or step < 2 * self.leak_steps:  # the first leak_steps steps are warm-up
                continue
            growth = detect_leak(series, self.leak_steps, self.leak_bytes)
            if growth is not None:
                self._warned.add(key)
                msg = (f"{what} grew by {growth / MiB:.0f} MiB over steps {step - self.leak_steps + 1}-{step} and "
                       f"never fell: a leak? (tensors kept across steps, e.g. a loss kept without .item()); "
                       f"now {v / GiB:.2f} GiB")
                self.warnings.append({"kind": key, "step": step, "growth_bytes": int(growth),
                                      "window_steps": self.leak_steps, "message": msg})
                logger.warning(msg)

    @contextlib.contextmanager
    def host_phase(self, name: str):
        """Within: the host phase ``name`` ('checkpoint', 'final'), its RSS high-water mark kept apart from the
        steps' (with or without the timeline, also after :meth:`stop`)."""
        before = self.phase
        self._close_phase(name)
        try:
            yield
        finally:
            self._close_phase(before if before not in ("setup", "done") else "other")

    def host_peaks(self) -> dict[str, int | None]:
        """Each host phase's RSS high-water mark (None where the run had none, or the kernel does not let the mark
        be reset: then only the set-up's and the overall peak are known)."""
        return {p: self._host.get(p) for p in HOST_PHASES}

    # ---- results

    def peak_gpu_bytes(self) -> int | None:
        """``max_memory_allocated`` over the whole run, across the per-phase resets (None without a GPU)."""
        if not self.cuda:
            return None
        return max(self._overall["gpu"], torch.cuda.max_memory_allocated(self.device))

    def peak_gpu_reserved_bytes(self) -> int | None:
        if not self.cuda:
            return None
        return max(self._overall["gpu_reserved"], torch.cuda.max_memory_reserved(self.device))

    def peak_rss_bytes(self) -> int | None:
        """This process's RSS high-water mark over the run (Linux), across the per-phase resets."""
        h = self._hwm.read()
        return max(self._overall["rss"], h) if h is not None else None

    def summary(self) -> dict:
        return {"memory_warnings": list(self.warnings), "peak_cpu_rss_hwm_bytes": self.peak_rss_bytes(),
                "peak_cpu_tree_rss_bytes": self._max_sample["cpu_tree_rss_bytes"] or None,
                "peak_gpu_device_used_bytes": self._max_sample["gpu_device_used_bytes"] or None,
                "peak_rss_by_phase": self.host_peaks(),
                "memory_samples": self.samples, "gpu_device_memory_source": self.device_source,
                "memory_loop_start_s": None if self.loop_start_s is None else round(self.loop_start_s, 3)}


def _sampler(ref, stop: threading.Event, interval_s: float) -> None:
    while not stop.wait(interval_s):
        mon = ref()
        if mon is None:
            return
        try:
            mon.sample()
        except Exception as e:  # a monitor must never take the run down; say so once and stop sampling
            logger.warning(f"memory monitor stopped sampling: {type(e).__name__}: {e}")
            return
        finally:
            del mon


def _continue_csv(path: str) -> float | None:
    """Before appending to an existing memory.csv (a resumed run): cut a last row that a kill or a full
    disk left without its newline, and return its last time_s (None: no file yet, write the header)."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    with open(path, "rb+") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - 65536))
        tail = fh.read()
        if not tail.endswith(b"\n"):
            cut = tail.rfind(b"\n") + 1
            fh.truncate(size - len(tail) + cut)
            tail = tail[:cut]
    lines = tail.decode(errors="replace").splitlines()
    try:
        return float(lines[-1].split(",", 1)[0]) if lines else 0.0
    except ValueError:  # only the header so far
        return 0.0


def read_csv(path: str) -> dict[str, list]:
    cols: dict[str, list] = {k: [] for k in CSV_COLUMNS}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            for k in CSV_COLUMNS:
                v = row.get(k, "")
                cols[k].append(v if k == "phase" else (float(v) if v not in ("", None) else None))
    return cols
