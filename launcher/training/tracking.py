"""Experiment trackers (``log.report_to``): the same numbers as metrics.jsonl, for a run watched from elsewhere.

TensorBoard is the default: event files in ``<run>/tensorboard/`` (``tensorboard --logdir runs``), written by
TensorBoard's own writer through ``torch.utils.tensorboard``, whose file writer queues events for a thread, so
a step pays for a queue put per value. W&B and MLflow are optional extras and start offline unless their
environment says otherwise (``WANDB_MODE``; ``MLFLOW_TRACKING_URI``, else ``<run>/mlruns``): nothing needs a
network. Only rank 0 writes. What is logged: each step's row (loss, lr, loss scale, grad norm, tokens/s,
memory and the per-phase peaks), eval metrics, and the plan as text.
"""

from __future__ import annotations

import contextlib
import math
import os

# metrics.jsonl keys that are counters or settings, not curves
NOT_CURVES = {"step", "tokens", "tokens_in_loss", "time_s", "skipped", "micro_batch"}


def _curves(row: dict) -> dict[str, float]:
    out = {}
    for k, v in row.items():
        if k in NOT_CURVES or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        group = "memory" if k.endswith("_bytes") else "eval" if k.startswith("eval_") else "train"
        out[f"{group}/{k.removeprefix('eval_')}"] = float(v)
    return out


class Trackers:
    """The trackers of one run (none on ranks other than 0). ``log(row, step)``, ``text(tag, text)``, ``close()``.

    A tracker never takes the run down: one whose start or write fails (a full disk under TensorBoard's writer
    thread, which re-raises its error at every later call; a W&B or MLflow error) is closed as far as it can be
    and switched off, with one warning through ``warn``; the run goes on (its own writes meet a full disk in the
    run directory's disk-full path). ``failures`` says what was switched off, for the summary.
    """

    def __init__(self, names: list, run_dir: str, run_name: str, config: dict, is_main: bool = True, warn=None,
                 folder: str = ""):
        """``folder``: where the trackers write (``log.tracker_dir``); empty: the run directory."""
        self.names = [n for n in names if n != "none"] if is_main else []
        self.failures: list[str] = []
        self._warn = warn or (lambda msg: None)
        self._on: dict = {}  # name -> the tracker's handle, while it works
        here = os.path.join(os.path.abspath(folder), run_name) if folder else run_dir
        for name in self.names:
            self._guard(name, lambda n=name: self._on.__setitem__(n, _START[n](here, run_name, config, bool(folder))),
                        "start")

    def _guard(self, name: str, call, what: str) -> None:
        try:
            call()
        except Exception as e:  # noqa: BLE001 -- any tracker's error: the run's own state is not at stake
            handle = self._on.pop(name, None)
            if handle is not None:
                with contextlib.suppress(Exception):  # a writer whose thread failed raises again at close
                    _CLOSE[name](handle)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self.failures.append(f"{name}: {type(e).__name__}: {first}")
            self._warn(f"tracker {name} switched off: its {what} failed ({type(e).__name__}: {first}); the run goes on, "
                       "metrics.jsonl has every step")

    def log(self, row: dict, step: int) -> None:
        if not self._on:
            return
        curves = _curves(row)
        for name in list(self._on):
            self._guard(name, lambda n=name: _LOG[n](self._on[n], curves, step), "write")

    def text(self, tag: str, text: str) -> None:
        for name in list(self._on):
            self._guard(name, lambda n=name: _TEXT[n](self._on[n], tag, text), "write")

    def close(self) -> None:
        for name in list(self._on):
            self._guard(name, lambda n=name: _CLOSE[n](self._on.pop(n)), "close")


# Each tracker as four plain functions: start(folder, run_name, config, shared_folder) -> handle, log, text, close.
def _tb_start(folder, run_name, config, shared):
    import threading

    from torch.utils.tensorboard import SummaryWriter

    if threading.excepthook is not _tb_thread_error:
        _tb_thread_error.previous = threading.excepthook
        threading.excepthook = _tb_thread_error

    # in a shared folder each run has its own subfolder (what `tensorboard --logdir FOLDER` lists as runs)
    return SummaryWriter(log_dir=folder if shared else os.path.join(folder, "tensorboard"), flush_secs=30)


def _tb_thread_error(args) -> None:
    """threading.excepthook: an error of TensorBoard's writer thread is kept by the thread and raised again at the
    writer's next call (where :class:`Trackers` reports it once), so its thread's traceback on stderr is left out;
    any other thread's goes to the hook that was there before."""
    if type(args.thread).__name__ != "_AsyncWriterThread":
        _tb_thread_error.previous(args)


def _tb_log(tb, curves, step):
    for k, v in curves.items():
        tb.add_scalar(k, v, step)


def _wandb_start(folder, run_name, config, shared):
    import wandb

    os.makedirs(folder, exist_ok=True)
    return wandb.init(project=os.environ.get("WANDB_PROJECT", "vramfit"), name=run_name, dir=folder, config=config,
                      mode=os.environ.get("WANDB_MODE", "offline"), resume="allow", id=run_name)


def _mlflow_start(folder, run_name, config, shared):
    import mlflow

    if not os.environ.get("MLFLOW_TRACKING_URI"):
        root = os.path.dirname(folder) if shared else folder  # one mlruns store for all runs of a shared folder
        mlflow.set_tracking_uri("file:" + os.path.join(os.path.abspath(root), "mlruns"))
    mlflow.start_run(run_name=run_name)
    mlflow.log_params({k: v for k, v in _flatten(config).items() if len(str(v)) < 500})
    return mlflow


_START = {"tensorboard": _tb_start, "wandb": _wandb_start, "mlflow": _mlflow_start}
_LOG = {"tensorboard": _tb_log,
        "wandb": lambda run, curves, step: run.log(curves, step=step),
        "mlflow": lambda mlflow, curves, step: mlflow.log_metrics({k.replace("/", "."): v for k, v in curves.items()},
                                                                  step=step)}
_TEXT = {"tensorboard": lambda tb, tag, text: tb.add_text(tag, "    " + text.replace("\n", "\n    "), 0),  # as code
         "wandb": lambda run, tag, text: run.summary.__setitem__(tag, text),
         "mlflow": lambda mlflow, tag, text: mlflow.log_text(text, f"{tag}.txt")}
_CLOSE = {"tensorboard": lambda tb: tb.close(), "wandb": lambda run: run.finish(), "mlflow": lambda mlflow: mlflow.end_run()}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
