"""Write the example outputs in docs/ from real runs of the commands they show.

Each example is a list of shell commands run one after another in a fresh folder (holding links to this
checkout's configs/ and examples/, so the documented relative paths work), with vramfit from this checkout.
Each example starts as a new user's first run does: an empty cache (no tokenized data, no kept traces), except for
this machine's calibration (``vramfit doctor --calibrate``), which is copied in and kept beside the transcripts
(``calibration.json``) so that the test prices the same choices with the same speeds on any machine. What a
command prints is kept as the docs show it (only vramfit's own lines, long step logs abridged), the fresh folder
is written as ``~/demo`` and the fresh cache as ``~/.cache/vramfit``, and the block goes into its page between
``<!-- example:NAME:start -->`` and ``<!-- example:NAME:end -->``. The full transcripts go to ``--out``.

    python scripts/docs_examples.py --out bench/results/DATE-MACHINE/docs-examples   # every example
    python scripts/docs_examples.py --only planner-t4 --out ...                       # one
    python scripts/docs_examples.py --only planner-t4 --calibration DIR/calibration.json --out DIR
                                    # one, priced with the calibration the others were written with

tests/test_docs_examples.py runs the same commands, shortened (:data:`QUICK`), and fails when a line of
today's output has a shape (numbers, paths and quoted text aside) that the documented block does not show,
or the other way round: a documented command whose output changed shape needs this script run again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHOWN_AS = "~/demo"  # the fresh folder, as the docs write it
BROKEN = '{"instruction": "Say hi.", "output": "Hi."}\n{"instruction": "Say bye." "output": "Bye."}\n'


@dataclass(frozen=True)
class Command:
    line: str  # as the docs show it after "$ "
    streams: str = "both"  # 'stdout' | 'stderr' | 'both' (in the order written)
    vramfit_only: bool = True  # drop library lines (DeepSpeed's, bitsandbytes') from stderr
    keep_steps: tuple = (1, 10, 20, 30)  # step lines kept (and the last); the others become one '...'


@dataclass(frozen=True)
class Example:
    page: str
    commands: tuple


EXAMPLES = {
    "quickstart-demo": Example("docs/quickstart.md", (Command("vramfit train", streams="stderr"),)),
    "planner-t4": Example("docs/planner.md", (Command(
        "vramfit plan --gpu T4 model.name=llama-7b data.seq_len=2048 lora.r=16 memory.cpu_budget=32",
        streams="stdout"),)),
    "fine-tuning": Example("docs/fine-tuning.md", (
        Command("python scripts/make_tiny_model.py models/tiny-hf", streams="stdout"),
        Command("vramfit train configs/lora-alpaca.yaml run_name=alpaca-lora", keep_steps=(1,)),
        Command("vramfit export runs/alpaca-lora --merge --out models/alpaca-merged"),
        Command("vramfit export runs/alpaca-lora --merge --out models/alpaca-merged"),
        Command("vramfit train configs/qlora-chat.yaml run_name=chat-qlora train.max_steps=30", keep_steps=(1,)),
        Command("vramfit train configs/lora-alpaca.yaml lora.target_modules=q_proj,qkv_proj"),
        Command("vramfit train configs/lora-alpaca.yaml data.source=broken.jsonl"),
        Command("vramfit train configs/lora-alpaca.yaml data.source=examples/data/alpaca.jsonl"),
    )),
    "preference": Example("docs/preference.md", (
        Command("vramfit train lora.r=8 data.seq_len=32 data.num_samples=512 train.max_steps=60 run_name=sft",
                keep_steps=(1, 30)),
        Command("vramfit train task=dpo model.adapter=runs/sft/final data.seq_len=32 data.num_samples=512 "
                "train.max_steps=40 run_name=dpo", keep_steps=(1, 10, 20)),
        Command("vramfit plan --gpu T4 model.name=examples/configs/llama-3.1-8b task=dpo lora.r=16 "
                "model.quantize=4bit data.seq_len=1024 memory.cpu_budget=32", streams="stdout"),
    )),
    "steptime-advice": Example("docs/steptime.md", (Command(
        "vramfit plan --gpu RTX3090 model.name=examples/configs/qwen2.5-14b lora.r=16 data.seq_len=2048 "
        "memory.cpu_budget=24 train.micro_batch_size=8", streams="stdout"),)),
    "steptime-ties": Example("docs/steptime.md", (
        Command("vramfit plan --gpu RTX3090 model.name=examples/configs/mistral-7b-v0.1 lora.r=16 data.seq_len=2048 "
                "memory.cpu_budget=32 train.micro_batch_size=8", streams="stdout"),
        Command("vramfit plan --gpu RTX3090 model.name=examples/configs/mistral-7b-v0.1 lora.r=16 data.seq_len=2048 "
                "memory.cpu_budget=32",
                streams="stdout"),
    )),
}

# The same commands made short for the test: the shape of their output, not its numbers, is what it checks.
QUICK = {
    "vramfit train": "vramfit train train.max_steps=12 log.every_steps=10",
    "run_name=alpaca-lora": "run_name=alpaca-lora train.max_steps=4 train.warmup_steps=1 train.eval_every=2",
    "train.max_steps=30": "train.max_steps=3 train.warmup_steps=1",
    "run_name=sft": "run_name=sft train.max_steps=4 train.warmup_steps=1",
    "run_name=dpo": "run_name=dpo train.max_steps=4 train.warmup_steps=1",
}

STEP = re.compile(r"^\[vramfit\] step (\d+)/(\d+) \|")
LIBRARY_LOG = re.compile(r"^\[\d{4}-\d\d-\d\d ")  # DeepSpeed's logger on stdout


def folder() -> tuple[str, str]:
    """(a fresh folder where the documented relative paths (configs/, examples/, scripts/) lead to this checkout,
    an empty cache folder beside it)."""
    d = tempfile.mkdtemp(prefix="vramfit-docs-")
    for name in ("configs", "examples", "scripts"):
        os.symlink(os.path.join(ROOT, name), os.path.join(d, name))
    with open(os.path.join(d, "broken.jsonl"), "w") as f:
        f.write(BROKEN)
    return d, tempfile.mkdtemp(prefix="vramfit-docs-cache-")


def seed_calibration(machine: dict, cache: str) -> None:
    """``machine`` (a calibration's ``Machine.to_dict()``) as this machine's calibration in ``cache``, at every
    thread count a run may take here (the cache is keyed by it)."""
    import torch

    from launcher.machine import speeds

    before = torch.get_num_threads()
    try:
        for n in range(1, max(before, os.cpu_count() or 1) + 1):
            torch.set_num_threads(n)
            speeds.write(speeds.Machine.from_dict(machine), cache)
    finally:
        torch.set_num_threads(before)


def run(cmd: Command, cwd: str, cache: str, quick: bool = False) -> tuple[str, str, float]:
    """(the command as shown, what it printed as the docs show it, seconds on the clock)."""
    line = cmd.line
    if quick:
        for key, short in QUICK.items():
            if line.endswith(key) or line == key:
                line = line[: len(line) - len(key)] + short
    bindir = os.path.dirname(sys.executable)  # this environment's vramfit and python first
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "PYTHONPATH": ROOT,
           "COLUMNS": "200", "TERM": "dumb", "VRAMFIT_CACHE": cache,
           "VRAMFIT_RECHECK": "off"}  # the calibration is the docs' machine's on purpose, whatever runs them
    t = time.perf_counter()
    p = subprocess.run(line, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - t
    lines = []
    if cmd.streams in ("stdout", "both"):
        lines += [x for x in p.stdout.splitlines() if x.strip() and not LIBRARY_LOG.match(x)]
    if cmd.streams in ("stderr", "both"):
        lines += [x for x in p.stderr.splitlines() if not cmd.vramfit_only or _vramfits(x)]
    text = "\n".join(lines)
    for path, shown in ((cache, "~/.cache/vramfit"), (cwd, SHOWN_AS)):
        text = text.replace(os.path.realpath(path), shown).replace(path, shown)
    return cmd.line, text, seconds


def _vramfits(line: str) -> bool:
    return line.startswith(("[vramfit]", "vramfit:", "  - ", "wrote ", "merged ")) and "[WARNING]" not in line


def abridge(text: str, keep: tuple) -> str:
    """Step lines kept at ``keep`` and the last; each run of the others becomes one '...'."""
    lines = text.splitlines()
    last = max((int(m.group(1)) for x in lines if (m := STEP.match(x))), default=0)
    out = []
    for x in lines:
        m = STEP.match(x)
        if m and int(m.group(1)) not in keep and int(m.group(1)) != last:
            if out and out[-1] != "...":
                out.append("...")
            continue
        out.append(x)
    return "\n".join(out)


def transcript(name: str, machine: dict, quick: bool = False) -> list[tuple[str, str, float]]:
    """[(command, output, seconds)] of one example, run now, in full, priced with ``machine``'s speeds."""
    cwd, cache = folder()
    try:
        seed_calibration(machine, cache)
        return [run(cmd, cwd, cache, quick) for cmd in EXAMPLES[name].commands]
    finally:
        shutil.rmtree(cwd, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)


def block(pairs: list[tuple[str, str]]) -> str:
    body = "\n\n".join(f"$ {line}\n{text}".rstrip() for line, text in pairs)
    return f"```console\n{body}\n```"


def render(page_text: str, name: str, content: str) -> str:
    pattern = re.compile(rf"(<!-- example:{name}:start -->\n)(?:.*?\n)?(<!-- example:{name}:end -->)", re.S)
    if not pattern.search(page_text):
        raise SystemExit(f"no <!-- example:{name}:start --> ... <!-- example:{name}:end --> markers")
    return pattern.sub(lambda m: m.group(1) + content + "\n" + m.group(2), page_text)


def documented(name: str) -> str:
    """The block between an example's markers in its page."""
    with open(os.path.join(ROOT, EXAMPLES[name].page)) as f:
        m = re.search(rf"<!-- example:{name}:start -->\n(.*?)<!-- example:{name}:end -->", f.read(), re.S)
    return m.group(1) if m else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", choices=sorted(EXAMPLES), help="this example only (repeatable)")
    ap.add_argument("--out", required=True, help="folder for the full transcripts (bench/results/DATE-MACHINE/...)")
    ap.add_argument("--calibration", help="price with this calibration.json (one this script wrote) instead of "
                    "this machine's, so that one example can be written again beside the others")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.calibration:
        with open(a.calibration) as f:
            kept = json.load(f)
        machine = kept["machine"]
    else:
        from launcher.machine import speeds

        found = speeds.read()
        if found.machine is None or found.problem:
            raise SystemExit(f"no calibration of this machine to use ({found.problem}); run `vramfit doctor --calibrate`")
        machine = found.machine.to_dict()
        kept = {"key": found.key, "created": found.created, "machine": machine}
    path = os.path.join(a.out, "calibration.json")
    if not (a.calibration and os.path.exists(path) and os.path.samefile(a.calibration, path)):
        with open(path, "w") as f:
            json.dump(kept, f, indent=1)
    for name in a.only or EXAMPLES:
        t = time.perf_counter()
        pairs = transcript(name, machine)
        with open(os.path.join(a.out, f"{name}.txt"), "w") as f:
            f.write(block([(f"{line}    # {s:.1f} s on the clock", out) for line, out, s in pairs]) + "\n")
        text = block([(line, abridge(out, cmd.keep_steps))
                      for (line, out, _), cmd in zip(pairs, EXAMPLES[name].commands)])
        path = os.path.join(ROOT, EXAMPLES[name].page)
        with open(path) as f:
            page = f.read()
        with open(path, "w") as f:
            f.write(render(page, name, text))
        print(f"{name}: {EXAMPLES[name].page} updated ({time.perf_counter() - t:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
