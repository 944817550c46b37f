"""Per-step output of the loop: a tqdm bar on a terminal, plain log lines elsewhere.

``log.progress``: ``auto`` shows the bar when stdout is a terminal, ``on`` always, ``off`` never. The
bar shows the step, loss, loss scale, tokens/s, GPU and CPU memory and tqdm's ETA; the rows that plain
mode prints (every ``log.every_steps`` steps, the first and last step, skipped steps) are also written
above the bar, so the history stays in the scrollback. While the bar is up, other prints go through
``tqdm.write`` so they do not tear it. Only rank 0 shows anything.
"""

from __future__ import annotations

import contextlib
import os
import sys


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}G"


class Progress:
    def __init__(self, cfg, start_step: int, log, format_row):
        self.max_steps = cfg.train.max_steps
        self.every = cfg.log.every_steps
        self.log, self.format_row = log, format_row
        main = int(os.environ.get("RANK", "0")) == 0
        mode = cfg.log.progress
        self.bar = None
        self._redirect = None
        self._tps = None
        if main and (mode == "on" or (mode == "auto" and sys.stdout.isatty())):
            from tqdm import tqdm
            from tqdm.contrib import DummyTqdmFile

            self.bar = tqdm(total=self.max_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            file=sys.stdout, desc="train", smoothing=0.1)
            self._redirect = contextlib.redirect_stdout(DummyTqdmFile(sys.stdout))
            self._redirect.__enter__()

    def update(self, row: dict) -> None:
        step = row["step"]
        due = step % self.every == 0 or step == 1 or step == self.max_steps or row["skipped"]
        if self.bar is None:
            if due:
                self.log(self.format_row(row, self.max_steps))
            return
        tps = row["tokens_per_s"]
        self._tps = tps if self._tps is None else 0.9 * self._tps + 0.1 * tps
        scale = "-" if row.get("loss_scale") is None else f"{row['loss_scale']:.0f}"
        self.bar.set_postfix_str(f"loss {row['loss']:.4f} | scale {scale} | {self._tps:.0f} tok/s | "
                                 f"gpu {_gib(row.get('gpu_allocated_bytes'))} | rss {_gib(row.get('cpu_rss_bytes'))}",
                                 refresh=False)
        self.bar.update(step - self.bar.n)
        if due:
            self.log(self.format_row(row, self.max_steps))  # through tqdm.write while the bar is up

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self._redirect.__exit__(None, None, None)
            self.bar = self._redirect = None
