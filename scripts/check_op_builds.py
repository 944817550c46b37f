#!/usr/bin/env python
"""Do DeepSpeed's JIT ops get rebuilt when vramfit is started in different ways? Counts the builds.

    python scripts/check_op_builds.py [--runs 10] [--json OUT]

Runs ``--runs`` short ZeRO-2 trainings of the demo on the CPU, cycling through the four entry points
(``vramfit train``, ``python -m launcher train``, ``deepspeed launcher/run.py``, ``vramfit bench``), each
started with the system's ``PATH`` (``/usr/local/bin:/usr/bin:/bin``: no activated environment, so a system
ninja is found first where one is installed). Before and after each run it reads the ``.ninja_log`` of every
op the profile loads in torch's extension cache: a log that changed is a build. The first run may build an
op that was never built; the target is no build after it. Exit 1 when a later run built something.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from launcher.engines.deepspeed import ops_loaded  # noqa: E402
from launcher.machine import deepspeed_ops  # noqa: E402


def ninja_logs() -> dict[str, str]:
    root = deepspeed_ops.op_cache_dir()
    out = {}
    for op in ops_loaded({}, torch.device("cpu")):
        path = os.path.join(root, op, ".ninja_log")
        out[op] = open(path).read() if os.path.exists(path) else ""
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                             "VIRTUAL_ENV")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    bindir = os.path.dirname(sys.executable)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        common = ["device=cpu", "profile=zero2-fp32", "train.max_steps=2", "data.seq_len=32", "train.micro_batch_size=2",
                  "train.global_batch_size=4", "sample_tokens=0", "checkpoint.save=false", "log.progress=off",
                  f"output_dir={tmp}"]
        for i in range(a.runs):
            kind = i % 4
            name = f"run{i}"
            cmd = [[os.path.join(bindir, "vramfit"), "train", *common, f"run_name={name}"],
                   [sys.executable, "-m", "launcher", "train", *common, f"run_name={name}"],
                   [os.path.join(bindir, "deepspeed"), "launcher/run.py", *common, f"run_name={name}"],
                   [os.path.join(bindir, "vramfit"), "bench", *common, "--profiles", "zero2-fp32", "--steps", "1",
                    "--warmup", "1", "--out", os.path.join(tmp, f"bench{i}")]][kind]
            before = ninja_logs()
            t = time.perf_counter()
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
            wall = time.perf_counter() - t
            after = ninja_logs()
            built = sorted(op for op in after if after[op] != before.get(op))
            row = {"run": i + 1, "entry": " ".join(os.path.basename(c) for c in cmd[:2]), "rc": p.returncode,
                   "wall_s": round(wall, 1), "built": built,
                   "announced": "building DeepSpeed op" in p.stderr}
            rows.append(row)
            print(f"run {i + 1:2d} {row['entry']:<28} rc {p.returncode}  {wall:5.1f} s  "
                  f"built: {', '.join(built) or 'nothing'}", flush=True)
            if p.returncode:
                print(p.stderr[-2000:], file=sys.stderr)
    later = [r for r in rows[1:] if r["built"]]
    failed = [r for r in rows if r["rc"]]
    print(f"\n{len(rows)} runs; builds after the first run: {len(later)}; failed runs: {len(failed)}; "
          f"ninja: {deepspeed_ops.ninja_report()}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"runs": rows, "builds_after_first": len(later), "torch": torch.__version__}, fh, indent=2)
    return 1 if later or failed else 0


if __name__ == "__main__":
    sys.exit(main())
