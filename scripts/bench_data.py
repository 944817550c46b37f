"""Data at scale on the CPU: host RAM and start-up time against corpus size, and padding-free instruction batches.

    python scripts/bench_data.py [--out DIR] [--work DIR] [--repeats N] [--only scale|packing] [--smoke]

Everything is generated here, nothing is downloaded: the model and its BPE tokenizer come from
scripts/make_tiny_model.py, the corpora are random words from the vocabulary of examples/data.

scale: a 50M-token and a 1M-token text corpus, each in 20 parquet shards. For each, a first start (empty cache:
tokenizes) and a second start (the cache made by the first), as `python -m launcher train` processes. Measured
from outside: the training process's resident memory (psutil, every 50 ms; its tokenizing worker processes
apart), and the seconds from the process's start to its first finished step (its first metrics.jsonl line).
Targets: the 50M corpus within 300 MB of the 1M corpus; a second start at least 10x sooner than the first.

packing: Alpaca-like records (mean well under half of seq_len), the same run with data.packing=true and false:
tokens in the loss per second over the timed steps (after warm-up), and the loss curves step by step. Runs
alternate (packed, padded, packed, ...) so a busy machine slows both alike; the ratio is taken pair by pair.
Target: packed >= 1.8x padded, losses within 1e-5 relative per step (fp32).

Writes DIR/results.json, DIR/results.md and DIR/logs/ (each run's log); the machine's load average is
recorded before and after every run. --smoke: the packing part only, one pair of 6 steps at micro-batch 2 on 400
records, in seconds (too short to measure against the targets).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
SHARDS = 20
THREADS = 1  # torch threads per training process (--threads): one thread is least disturbed by other tenants
TRAIN = ["engine=amp", "precision=fp32", "device=cpu", "checkpoint.save=false", "sample_tokens=0", "log.progress=off",
         "log.every_steps=1000", "train.oom_fallback=false"]


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def words() -> list[str]:
    """The words of examples/data (the text the tiny tokenizer was trained on)."""
    out = set()
    for p in glob.glob(os.path.join(ROOT, "examples", "data", "*.jsonl")):
        for line in open(p):
            for w in json.dumps(json.loads(line)).replace("\\n", " ").split():
                w = "".join(c for c in w.lower() if c.isalnum())
                if w and not w.isdigit() and w not in ("role", "content", "instruction", "input", "output", "messages"):
                    out.add(w)
    return sorted(out)


def make_model(work: str) -> str:
    path = os.path.join(work, "model")
    if not os.path.isdir(path):
        subprocess.run([PY, os.path.join(ROOT, "scripts", "make_tiny_model.py"), path], check=True)
    return path


def tokens_per_word(model: str, vocab: list[str]) -> float:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rng = np.random.default_rng(1)
    texts = [" ".join(rng.choice(vocab, size=200)) for _ in range(200)]
    return sum(len(x) for x in tok(texts)["input_ids"]) / (200 * 200)


def text_corpus(work: str, name: str, tokens: int, vocab: list[str], tpw: float, seed: int) -> str:
    """About ``tokens`` tokens of random-word documents (50 to 400 words) in SHARDS parquet files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.path.join(work, name)
    if os.path.isdir(path) and len(glob.glob(os.path.join(path, "*.parquet"))) == SHARDS:
        return path
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    rng = np.random.default_rng(seed)
    per_shard = tokens / SHARDS
    arr = np.asarray(vocab)
    for s in range(SHARDS):
        docs, got = [], 0.0
        while got < per_shard:
            n = int(rng.integers(50, 400))
            docs.append(" ".join(arr[rng.integers(0, len(arr), n)]) + ".")
            got += n * tpw + 1
        pq.write_table(pa.table({"text": docs}), os.path.join(path, f"part-{s:05d}.parquet"))
    return path


def alpaca_corpus(work: str, vocab: list[str], n: int = 4000, seed: int = 2) -> str:
    path = os.path.join(work, "alpaca-like.jsonl" if n == 4000 else f"alpaca-like-{n}.jsonl")
    if os.path.exists(path):
        return path
    rng = np.random.default_rng(seed)
    arr = np.asarray(vocab)

    def sent(lo, hi):
        return " ".join(arr[rng.integers(0, len(arr), int(rng.integers(lo, hi)))])

    with open(path, "w") as fh:
        for _ in range(n):
            rec = {"instruction": sent(4, 30) + "?", "input": sent(0, 30) if rng.random() < 0.4 else "",
                   "output": sent(3, 60) + "."}
            fh.write(json.dumps(rec) + "\n")
    return path


def run(tag: str, overrides: list[str], work: str, logs: str) -> dict:
    """One `python -m launcher train` process, watched from outside."""
    import psutil

    run_dir = os.path.join(work, "runs", tag)
    shutil.rmtree(run_dir, ignore_errors=True)
    log_path = os.path.join(logs, f"{tag}.log")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(THREADS))
    before = load_avg()
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        p = subprocess.Popen([PY, "-m", "launcher", "train", *TRAIN, *overrides, f"output_dir={os.path.dirname(run_dir)}",
                              f"run_name={tag}"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        proc = psutil.Process(p.pid)
        peak_main = peak_tree = 0
        first_step = None
        metrics = os.path.join(run_dir, "metrics.jsonl")
        while p.poll() is None:
            try:
                rss = proc.memory_info().rss
                kids = sum(c.memory_info().rss for c in proc.children(recursive=True))
            except psutil.Error:
                rss, kids = 0, 0
            peak_main, peak_tree = max(peak_main, rss), max(peak_tree, rss + kids)
            if first_step is None and os.path.exists(metrics) and os.path.getsize(metrics) > 0:
                first_step = time.perf_counter() - t0
            time.sleep(0.05)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{tag} failed (exit {p.returncode}); see {log_path}")
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    rows = [json.loads(x) for x in open(metrics)]
    out = {"tag": tag, "wall_s": round(wall, 2), "first_step_s": round(first_step, 2) if first_step else None,
           "peak_rss_main_bytes": peak_main, "peak_rss_with_workers_bytes": peak_tree,
           "summary_peak_cpu_rss_bytes": summary["peak_cpu_rss_bytes"], "tokens_per_s": summary["tokens_per_s"],
           "tokens_in_loss_per_s": summary["tokens_in_loss_per_s"], "losses": [r["loss"] for r in rows],
           "rows": [{k: r[k] for k in ("step", "time_s", "tokens", "tokens_in_loss")} for r in rows],
           "load_before": before, "load_after": load_avg()}
    print(f"  {tag}: first step at {out['first_step_s']} s, wall {wall:.1f} s, peak RSS {peak_main / 2**20:.0f} MiB "
          f"(with workers {peak_tree / 2**20:.0f} MiB), load {before} -> {out['load_after']}", flush=True)
    return out


def cache_line(log_path: str) -> tuple[str, float | None]:
    """The run's cache log line, and the seconds it reports (tokenizing, or hashing and opening the cache)."""
    import re

    for line in open(log_path):
        if "data:" in line and ("tokenized" in line or "reusing" in line):
            m = re.search(r"(?:in|opened in) ([0-9.]+) s", line)
            return line.strip(), float(m.group(1)) if m else None
    return "", None


def part_scale(work: str, logs: str, model: str, repeats: int) -> dict:
    vocab = words()
    tpw = tokens_per_word(model, vocab)
    corpora = {"1M": text_corpus(work, "corpus-1M", 1_000_000, vocab, tpw, 10),
               "50M": text_corpus(work, "corpus-50M", 50_000_000, vocab, tpw, 11)}
    settings = [f"model.name={model}", "data.seq_len=256", "train.max_steps=10", "train.warmup_steps=1",
                "train.micro_batch_size=8", "train.global_batch_size=16"]
    runs = []
    for rep in range(repeats):
        for name in (("1M", "50M") if rep % 2 == 0 else ("50M", "1M")):
            cache = os.path.join(work, f"cache-{name}")
            shutil.rmtree(cache, ignore_errors=True)
            common = [*settings, f"data.source={corpora[name]}", f"data.cache_dir={cache}"]
            for start in ("first", "second"):
                tag = f"scale-{name}-{start}-{rep}"
                r = run(tag, common, work, logs)
                line, secs = cache_line(os.path.join(logs, f"{tag}.log"))
                r.update(corpus=name, start=start, repeat=rep, cache=line, data_s=secs)
                runs.append(r)
            shutil.rmtree(cache, ignore_errors=True)
    sizes = {n: sum(os.path.getsize(f) for f in glob.glob(os.path.join(p, "*.parquet"))) for n, p in corpora.items()}

    def med(name, start, key):
        return statistics.median(r[key] for r in runs if r["corpus"] == name and r["start"] == start)

    by_rep = {}
    for r in runs:
        by_rep.setdefault((r["repeat"], r["corpus"]), {})[r["start"]] = r
    speedups = [v["first"]["first_step_s"] / v["second"]["first_step_s"] for (_, c), v in by_rep.items() if c == "50M"]
    data_speedups = [v["first"]["data_s"] / v["second"]["data_s"] for (_, c), v in by_rep.items()
                     if c == "50M" and v["first"]["data_s"] and v["second"]["data_s"]]
    diffs = {start: [by_rep[(rep, "50M")][start]["peak_rss_main_bytes"] - by_rep[(rep, "1M")][start]["peak_rss_main_bytes"]
                     for rep in range(repeats)] for start in ("first", "second")}
    return {"tokens_per_word": tpw, "parquet_bytes": sizes, "settings": settings, "runs": runs,
            "rss_50M_minus_1M_bytes": {k: {"median": statistics.median(v), "all": v} for k, v in diffs.items()},
            "second_start_speedup_50M": {"median": statistics.median(speedups), "all": speedups},
            "data_phase_speedup_50M": {"median": statistics.median(data_speedups) if data_speedups else None,
                                       "all": data_speedups},
            "first_step_s": {f"{n}/{s}": med(n, s, "first_step_s") for n in corpora for s in ("first", "second")},
            "peak_rss_main_bytes": {f"{n}/{s}": med(n, s, "peak_rss_main_bytes") for n in corpora
                                    for s in ("first", "second")}}


def timed_rate(r: dict, warmup: int = 5) -> float:
    rows = r["rows"]
    a, b = rows[warmup - 1], rows[-1]
    return (b["tokens_in_loss"] - a["tokens_in_loss"]) / (b["time_s"] - a["time_s"])


def part_packing(work: str, logs: str, model: str, repeats: int, steps: int = 20, micro: int = 8,
                 records: int = 4000) -> dict:
    src = alpaca_corpus(work, words(), records)
    cache = os.path.join(work, "cache-alpaca")
    settings = [f"model.name={model}", f"data.source={src}", f"data.cache_dir={cache}", "data.seq_len=512",
                f"train.max_steps={steps}", "train.warmup_steps=3", f"train.micro_batch_size={micro}",
                f"train.global_batch_size={2 * micro}"]
    pairs = []
    for rep in range(repeats):
        pair = {}
        for mode in ("packed", "padded"):
            r = run(f"packing-{mode}-{rep}", [*settings, f"data.packing={'true' if mode == 'packed' else 'false'}"],
                    work, logs)
            r["timed_tokens_in_loss_per_s"] = timed_rate(r)
            pair[mode] = r
        pairs.append(pair)
    ratios = [p["packed"]["timed_tokens_in_loss_per_s"] / p["padded"]["timed_tokens_in_loss_per_s"] for p in pairs]
    a, b = pairs[0]["packed"]["losses"], pairs[0]["padded"]["losses"]
    rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
    same_tokens = all(p["packed"]["rows"][i]["tokens_in_loss"] == p["padded"]["rows"][i]["tokens_in_loss"]
                      for p in pairs for i in range(len(p["packed"]["rows"])))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    sys.path.insert(0, ROOT)
    from launcher.data.formats import ALPACA_NO_INPUT, ALPACA_WITH_INPUT

    lens = []
    for line in open(src):
        rec = json.loads(line)
        prompt = (ALPACA_WITH_INPUT if rec["input"] else ALPACA_NO_INPUT).format(**rec)
        lens.append(len(tok(prompt)["input_ids"]) + len(tok(rec["output"], add_special_tokens=False)["input_ids"]) + 1)
    return {"settings": settings, "records": len(lens), "mean_record_tokens": statistics.mean(lens),
            "max_record_tokens": max(lens), "seq_len": 512, "pairs": pairs,
            "ratio_tokens_in_loss_per_s": {"median": statistics.median(ratios), "all": ratios},
            "loss_max_rel_diff": max(rel), "loss_mean_rel_diff": sum(rel) / len(rel),
            "same_tokens_in_loss_every_step": same_tokens}


def mib(n) -> str:
    return f"{n / 2**20:.0f}"


def markdown(res: dict) -> str:
    lines = [f"# Data at scale, {res['date']}", "", f"Machine: {res['machine']}; `{res.get('command', '')}`; load "
             "average before/after each run is in results.json (the machine was shared).", ""]
    s = res.get("scale")
    if s:
        lines += ["## Corpus size: host RAM and start-up", "",
                  f"Text corpora of random words, 20 parquet shards each ({mib(s['parquet_bytes']['1M'])} MiB and "
                  f"{mib(s['parquet_bytes']['50M'])} MiB of parquet); `{' '.join(s['settings'][1:])}`, AMP fp32 on the "
                  "CPU. Medians over the repeats.", "",
                  "| corpus | start | first step after (s) | peak RSS, training process (MiB) |", "| --- | --- | --- | --- |"]
        for key, t in s["first_step_s"].items():
            lines.append(f"| {key.split('/')[0]} | {key.split('/')[1]} | {t:.1f} | {mib(s['peak_rss_main_bytes'][key])} |")
        d = s["rss_50M_minus_1M_bytes"]
        lines += ["", f"- peak RSS, 50M minus 1M: first start {d['first']['median'] / 1e6:+.0f} MB, second start "
                  f"{d['second']['median'] / 1e6:+.0f} MB (target: within 300 MB)",
                  f"- 50M corpus, first start / second start, time to the first step: "
                  f"{s['second_start_speedup_50M']['median']:.1f}x (target >= 10x; each repeat: "
                  f"{', '.join(f'{x:.1f}' for x in s['second_start_speedup_50M']['all'])})",
                  f"- the data phase alone (tokenizing, against hashing and opening the cache, as the log lines say): "
                  f"{s['data_phase_speedup_50M']['median']:.0f}x", ""]
        for r in s["runs"]:
            if r["corpus"] == "50M" and r["repeat"] == 0:
                lines.append(f"- {r['start']} start: `{r['cache'].split('] ', 1)[-1]}`")
        lines.append("")
    p = res.get("packing")
    if p:
        lines += ["## Padding-free instruction batches", "",
                  f"{p['records']} Alpaca-like records, mean {p['mean_record_tokens']:.0f} tokens (max "
                  f"{p['max_record_tokens']}), seq_len {p['seq_len']}; `{' '.join(p['settings'][3:])}`, AMP fp32 on "
                  f"the CPU, {res.get('torch_threads', '?')} torch thread(s); tokens in the loss per second over steps "
                  f"6-{len(p['pairs'][0]['packed']['rows'])}.", "",
                  "| pair | packed | padded | ratio |", "| --- | --- | --- | --- |"]
        for i, pair in enumerate(p["pairs"]):
            a, b = pair["packed"]["timed_tokens_in_loss_per_s"], pair["padded"]["timed_tokens_in_loss_per_s"]
            lines.append(f"| {i + 1} | {a:.0f} | {b:.0f} | {a / b:.2f} |")
        lines += ["", f"- ratio, median of pairs: {p['ratio_tokens_in_loss_per_s']['median']:.2f}x (target >= 1.8x)",
                  f"- loss curves, packed against padded: max relative difference {p['loss_max_rel_diff']:.2e}, mean "
                  f"{p['loss_mean_rel_diff']:.2e} over {len(p['pairs'][0]['packed']['losses'])} steps (bound 1e-5)",
                  f"- the same tokens in the loss at every step: {p['same_tokens_in_loss_every_step']}", ""]
    return "\n".join(lines)


def machine() -> str:
    cpu = "?"
    try:
        cpu = next(x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    return (f"{cpu}, {len(os.sched_getaffinity(0))} cores, {round(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30)} "
            f"GiB RAM, Python {platform.python_version()}, torch {torch.__version__}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "2026-11-30-cpu-epyc", "data"))
    ap.add_argument("--work", default="/tmp/vramfit-bench-data", help="corpora, caches, runs (about 2 GiB)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", choices=("scale", "packing"))
    ap.add_argument("--threads", type=int, default=THREADS, help="OMP_NUM_THREADS of the training processes")
    ap.add_argument("--smoke", action="store_true", help="the packing part only, one pair of 6 short steps")
    a = ap.parse_args()
    if a.smoke:
        a.only, a.repeats = "packing", 0
    globals()["THREADS"] = a.threads
    os.makedirs(a.work, exist_ok=True)
    logs = os.path.join(a.out, "logs")
    os.makedirs(logs, exist_ok=True)
    model = make_model(a.work)
    res_path = os.path.join(a.out, "results.json")
    res = json.load(open(res_path)) if os.path.exists(res_path) else {}
    res.update(date=time.strftime("%Y-%m-%d %H:%M"), machine=machine(), command=" ".join(sys.argv),
               torch_threads=a.threads)
    if a.only in (None, "packing"):
        print("packing:", flush=True)
        res["packing"] = part_packing(a.work, logs, model, a.repeats + 1, *((6, 2, 400) if a.smoke else ()))
    if a.only in (None, "scale"):
        print("scale:", flush=True)
        res["scale"] = part_scale(a.work, logs, model, a.repeats)
    json.dump(res, open(res_path, "w"), indent=1)
    md = markdown(res)
    open(os.path.join(a.out, "results.md"), "w").write(md + "\n")
    print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
