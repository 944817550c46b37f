"""Per-step output of the loop: a tqdm bar on a terminal, plain log lines elsewhere; and the end-of-run lines.

``log.progress``: ``auto`` shows the bar when stderr (where vramfit's lines go) is a terminal, ``on``
always, ``off`` never. The bar shows the step, loss, loss scale, tokens/s, GPU and CPU memory and tqdm's
ETA; the rows that plain mode prints (every ``log.every_steps`` steps, the first and last step, skipped
steps) are also logged above the bar, so the history stays in the scrollback (vramfit's log handler
writes through ``tqdm.write`` while a bar is up). Only rank 0 shows anything.
"""

from __future__ import annotations

import sys

from launcher.log import logger
from launcher.units import gib_short


def format_row(r: dict, max_steps: int) -> str:
    scale = "-" if r["loss_scale"] is None else f"{r['loss_scale']:.0f}"
    norm = "-" if r["grad_norm"] is None else f"{r['grad_norm']:.2f}"
    pref = (f" | accuracy {r['preference_accuracy']:.2f} | margin {r['reward_margin']:.3f}"
            if r.get("preference_accuracy") is not None else "")  # a preference task's
    return (f"step {r['step']}/{max_steps} | loss {r['loss']:.4f}{pref} | lr {r['lr']:.2e} | scale {scale}"
            f"{' (skipped)' if r['skipped'] else ''} | grad norm {norm} | {r['tokens_per_s']:.0f} tok/s | "
            f"gpu {gib_short(r['gpu_allocated_bytes'])} | rss {gib_short(r['cpu_rss_bytes'])}")


def summary_lines(s: dict) -> list[str]:
    """What a finished run says last: status, losses, speed, memory against the plan, where it all is."""
    def f(x, fmt="{:.4f}"):
        return "-" if x is None else fmt.format(x)

    lines = [f"{s['status']}: {s['steps']} steps on {s['device']} with {s['profile']} ({s['engine']}, {s['optimizer']})",
             f"loss {f(s['first_loss'])} -> {f(s['final_loss'])}"
             + (f" (eval {f(s['eval_loss'])})" if s.get("eval_loss") is not None else "")
             + f"; {s['tokens_per_s']:.0f} tokens/s; skipped steps {s['skipped_steps']}",
             f"peak memory: GPU {gib_short(s['peak_gpu_bytes'])} (planned {gib_short(s['predicted_gpu_bytes'])}), "
             f"CPU RSS {gib_short(s['peak_cpu_rss_bytes'])} (planned {gib_short(s['predicted_cpu_bytes'])})"]
    if s.get("final_preference_accuracy") is not None:
        lines.insert(2, f"{s['task']}: preference accuracy {s['final_preference_accuracy']:.2f}, reward margin "
                        f"{s['final_reward_margin']:.3f} (chosen {s['final_rewards_chosen']:.3f}, rejected "
                        f"{s['final_rewards_rejected']:.3f}) at the last step"
                        + (f"; reference {s['reference']}" if s.get("reference") not in (None, "none") else ""))
    if s.get("diagnosis"):
        lines.append(f"diagnosis: {s['diagnosis']}")
    lines.append(f"run directory: {s['run_dir']}")
    return lines


class Progress:
    def __init__(self, cfg, start_step: int, is_main: bool = True):
        self.max_steps = cfg.train.max_steps
        self.every = cfg.log.every_steps
        mode = cfg.log.progress
        self.bar = None
        self._tps = None
        if is_main and (mode == "on" or (mode == "auto" and sys.stderr.isatty())):
            from tqdm import tqdm

            self.bar = tqdm(total=self.max_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            file=sys.stderr, desc="train", smoothing=0.1)

    def update(self, row: dict) -> None:
        step = row["step"]
        due = step % self.every == 0 or step == 1 or step == self.max_steps or row["skipped"]
        if self.bar is not None:
            tps = row["tokens_per_s"]
            self._tps = tps if self._tps is None else 0.9 * self._tps + 0.1 * tps
            scale = "-" if row.get("loss_scale") is None else f"{row['loss_scale']:.0f}"
            self.bar.set_postfix_str(f"loss {row['loss']:.4f} | scale {scale} | {self._tps:.0f} tok/s | "
                                     f"gpu {gib_short(row.get('gpu_allocated_bytes'))} | "
                                     f"rss {gib_short(row.get('cpu_rss_bytes'))}", refresh=False)
            self.bar.update(step - self.bar.n)
        if due:
            logger.info(format_row(row, self.max_steps))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
