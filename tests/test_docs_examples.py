"""The example outputs in docs/ still have the shape of what their commands print today.

scripts/docs_examples.py writes them from real runs; here the same commands run again, shortened, priced with the
calibration the docs were written with (kept beside the transcripts), and every line is reduced to its shape:
numbers, quoted text and hashes masked, spacing collapsed. Today's shapes and the documented ones must be the same
set: a line that appeared, vanished or changed its wording means the docs show an output the command no longer
prints (run ``python scripts/docs_examples.py --out ...`` again).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("docs_examples", os.path.join(ROOT, "scripts", "docs_examples.py"))
docs_examples = importlib.util.module_from_spec(_spec)
sys.modules["docs_examples"] = docs_examples  # its dataclasses look their module up there
_spec.loader.exec_module(docs_examples)

# Lines whose wording follows the machine of the moment rather than the command: only their start is compared.
MACHINE_BOUND = ("[vramfit] threads:", "[vramfit] eval loss")


def shape(line: str) -> str:
    for start in MACHINE_BOUND:
        if line.startswith(start):
            return start
    line = re.sub(r"'(?:[^'\\]|\\.)*'", "'…'", line)  # quoted text: samples, file lines
    line = re.sub(r"\b[0-9a-f]{12,}\b", "#", line)  # cache keys
    line = re.sub(r"\d+(?:\.\d+)?(?:e[+-]?\d+)?", "#", line)
    return re.sub(r"\s+", " ", line).strip()


def shapes(text: str) -> set[str]:
    return {shape(x) for x in text.splitlines() if x.strip() and x.strip() not in ("...", "```console", "```")
            and not x.startswith("$ ")}


def calibration() -> dict:
    found = sorted(glob.glob(os.path.join(ROOT, "bench", "results", "*", "docs-examples", "calibration.json")))
    assert found, "no calibration.json beside the docs' transcripts: run scripts/docs_examples.py"
    with open(found[-1]) as f:
        return json.load(f)["machine"]


def check(name: str) -> None:
    documented = docs_examples.documented(name)
    assert documented.strip(), f"{docs_examples.EXAMPLES[name].page} has no example {name}"
    today = "\n".join(text for _, text, _ in docs_examples.transcript(name, calibration(), quick=True))
    new, gone = shapes(today) - shapes(documented), shapes(documented) - shapes(today)
    assert not new and not gone, (f"docs example {name} is stale: lines printed today that the docs do not show: "
                                  f"{sorted(new)}; shown but no longer printed: {sorted(gone)}; fix: python "
                                  "scripts/docs_examples.py --only " + name + " --out bench/results/DATE-MACHINE/docs-examples")


def test_shape_masks_what_changes_from_run_to_run():
    a = "[vramfit] step 10/200 | loss 4.3381 | lr 1.50e-03 | scale - | grad norm 2.93 |  17273 tok/s"
    b = "[vramfit] step 1/3 | loss 5.5 | lr 1e-04 | scale - | grad norm 1.98 | 9715 tok/s"
    assert shape(a) == shape(b)
    assert shape("[vramfit] sample: '1 2' -> 'x y z' (sample.txt)") == shape("[vramfit] sample: 'a' -> 'b' (sample.txt)")
    assert shape("[vramfit] engine amp, profile amp-fp32") != shape("[vramfit] engine deepspeed, profile zero2-fp32")
    assert shape("profile  fits") != shape("profile  fits  note")


@pytest.mark.slow  # whole runs of the documented commands: in CI's slow set, which runs on every CI run
@pytest.mark.parametrize("name", ["quickstart-demo", "planner-t4", "steptime-advice", "steptime-ties",
                                  pytest.param("preference", marks=pytest.mark.extended)])  # CI's time box
def test_documented_output_has_todays_shape(name):
    check(name)


@pytest.mark.slow
@pytest.mark.extended  # five whole runs of the walkthrough: by hand (CI's time box)
def test_the_fine_tuning_walkthrough_has_todays_shape():
    check("fine-tuning")
