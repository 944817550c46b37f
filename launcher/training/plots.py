"""The pictures: a run's memory timeline (``memory.png``) and a benchmark's results (``results.png``).

matplotlib's object API with the Agg canvas (no pyplot state, no display); every file is written under a
temporary name and renamed.
"""

from __future__ import annotations

import json
import os

from launcher.machine.files import atomic_path
from launcher.training.monitor import PHASES, RSS_PHASES, read_csv
from launcher.units import GiB


def plot_memory(csv_path: str, out: str, step_peaks=(), predicted_gpu_bytes=None, predicted_cpu_bytes=None,
                loop_start_s=None, title: str = "") -> str:
    """The timeline (GPU on top when there is one, CPU below), per-phase peaks and planned peaks, in GiB."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    c = read_csv(csv_path)
    t = c["time_s"]
    has_gpu = any(v is not None for v in c["gpu_allocated_bytes"])
    fig = Figure(figsize=(11, 7 if has_gpu else 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2 if has_gpu else 1, 1, sharex=True, squeeze=False)[:, 0]
    g = lambda xs: [None if x is None else x / GiB for x in xs]  # noqa: E731
    colors = {"forward": "tab:blue", "backward": "tab:orange", "step": "tab:green", "forward_backward": "tab:blue"}
    pt = [p[0] for p in step_peaks]

    def peaks(ax, fmt, phases):
        for ph in phases:
            ys = [p[2].get(fmt.format(ph)) for p in step_peaks]
            if any(y is not None for y in ys):
                ax.plot(pt, g(ys), ".-", ms=3, lw=0.6, color=colors[ph], alpha=0.8,
                        label=f"{ph.replace('_', ' + ')} peak (per step)")

    def finish(ax, predicted, what):
        if predicted:
            ax.axhline(predicted / GiB, color="tab:red", ls="--", lw=1, label=f"planned {what} peak")
        if loop_start_s is not None:
            ax.axvline(loop_start_s, color="gray", ls=":", lw=1, label="training loop starts")
        ax.set_ylabel("GiB")
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.05)
        ax.grid(alpha=0.3)

    if has_gpu:
        ax = axes[0]
        ax.plot(t, g(c["gpu_allocated_bytes"]), color="black", lw=1.2, label="allocated (this process)")
        ax.plot(t, g(c["gpu_reserved_bytes"]), color="dimgray", lw=1, label="reserved (this process)")
        if any(v is not None for v in c["gpu_device_used_bytes"]):
            ax.plot(t, g(c["gpu_device_used_bytes"]), color="tab:purple", lw=1, label="device used (all processes)")
        peaks(ax, "peak_{}_bytes", PHASES)
        finish(ax, predicted_gpu_bytes, "GPU")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
        ax.set_title("GPU memory")
    ax = axes[-1]
    ax.plot(t, g(c["cpu_rss_bytes"]), color="black", lw=1.2, label="RSS (this process)")
    if c["cpu_tree_rss_bytes"] != c["cpu_rss_bytes"]:
        ax.plot(t, g(c["cpu_tree_rss_bytes"]), color="dimgray", lw=1, label="RSS (process tree)")
    peaks(ax, "peak_{}_rss_bytes", RSS_PHASES)
    finish(ax, predicted_cpu_bytes, "CPU")
    ax.set_title("CPU memory")
    ax.set_xlabel("seconds since the run started")
    # other tenants show here: the host's available RAM, on its own scale
    twin = ax.twinx()
    avail = g(c["ram_available_bytes"])
    twin.plot(t, avail, color="tab:cyan", lw=0.8, alpha=0.7, label="system RAM available (right axis)")
    twin.set_ylabel("system RAM available, GiB", color="tab:cyan")
    twin.set_ylim(0, max([a for a in avail if a is not None] or [1]) * 1.3)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", bbox_to_anchor=(1.07, 1), fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    with atomic_path(out, suffix=".png") as tmp:  # savefig reads the format from the name
        fig.savefig(tmp, dpi=100)
    return out


def plot_run(run_dir: str) -> str:
    """Redraw a run's memory.png from its memory.csv, metrics.jsonl and summary.json (``vramfit plot RUN_DIR``)."""
    summary_path = os.path.join(run_dir, "summary.json")
    s = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    metrics = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(ln) for ln in open(metrics) if ln.strip()] if os.path.exists(metrics) else []
    # metrics time is from the loop start, the timeline's from the monitor start: align on the loop start
    offset = s.get("memory_loop_start_s") or 0.0
    step_peaks = [(offset + r["time_s"], r["step"], r) for r in rows]
    out = plot_memory(os.path.join(run_dir, "memory.csv"), os.path.join(run_dir, "memory.png"), step_peaks,
                      s.get("predicted_gpu_bytes"), s.get("predicted_cpu_bytes"), s.get("memory_loop_start_s"),
                      f"{s.get('profile', '')} {os.path.basename(os.path.normpath(run_dir))}")
    return out


def plot_bench(doc: dict, path: str) -> None:
    """``results.png`` of ``vramfit bench``: speed per profile, measured and planned memory."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rs = doc["results"]
    names = [r["profile"] for r in rs]
    x = list(range(len(rs)))
    fig = Figure(figsize=(max(6, 1.6 * len(rs) + 2), 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    speeds = [r.get("tokens_per_s") or 0 for r in rs]
    bars = ax1.bar(x, speeds, color=["tab:blue" if r.get("status") == "ok" else "lightgray" for r in rs])
    for b, r in zip(bars, rs):
        label = (f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else r.get("status", ""))
        if doc["settings"].get("find") and r.get("status") == "ok":
            key = "best_micro_batch" if doc["settings"]["find"] == "micro-batch" else "best_model"
            label += f"\n{'mb ' if key == 'best_micro_batch' else ''}{r.get(key)}"
        ax1.annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax1.set_ylabel("tokens/s (after warm-up)")
    ax1.set_title("speed" + (f" at the largest {doc['settings']['find']} that fits" if doc["settings"].get("find") else ""))
    ax1.set_ylim(0, max(speeds + [1]) * 1.25)
    series = [("peak_gpu_bytes", "GPU peak", "tab:red"), ("predicted_gpu_bytes", "GPU planned", "mistyrose"),
              ("peak_cpu_rss_bytes", "CPU RSS peak", "tab:green"), ("predicted_cpu_bytes", "CPU planned", "honeydew")]
    present = [(key, label, color, [(r.get(key) or 0) / GiB for r in rs]) for key, label, color in series]
    present = [p for p in present if any(p[3])]
    w = 0.8 / max(1, len(present))
    for k, (_key, label, color, vals) in enumerate(present):
        ax2.bar([i + (k - (len(present) - 1) / 2) * w for i in x], vals, w, label=label, color=color,
                edgecolor="gray", lw=0.5)
    ax2.set_ylabel("GiB")
    ax2.set_title("memory: measured peak and the planner's prediction")
    ax2.legend(fontsize=8)
    ax2.set_xticks(x)
    ax2.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    with atomic_path(path, suffix=".png") as tmp:  # savefig reads the format from the name
        fig.savefig(tmp, dpi=100)
