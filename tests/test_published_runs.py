"""The table of GPU plans against published measurements (scripts/published_runs.py, results in
bench/results/2026-12-04-published-runs/): it parses, every row names its source and the settings it was planned with,
and the script's rows are the committed ones. No row is planned again here: one
plan takes 7-13 s on 2 cores with its traces kept, minutes without."""

from __future__ import annotations

import csv
import importlib.util
import json
import os

from helpers import ROOT

RESULTS = os.path.join(ROOT, "bench", "results", "2026-12-04-published-runs")
SETTINGS = ("gpu", "model", "method", "lora_r", "lora_targets", "seq_len", "micro_batch", "checkpointing", "precision",
            "alloc_measure")


def _script():
    spec = importlib.util.spec_from_file_location("published_runs", os.path.join(ROOT, "scripts", "published_runs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _doc() -> dict:
    with open(os.path.join(RESULTS, "results.json")) as f:
        return json.load(f)


def test_every_row_names_its_source_and_settings():
    doc = _doc()
    assert len(doc["rows"]) >= 8
    for r in doc["rows"]:
        assert r["url"].startswith("https://") and r["settings_url"] and r["quote"], r["id"]
        for key in SETTINGS:
            assert r[key] not in (None, "", []), (r["id"], key)
        assert r["published_alloc_bytes"] or r["published_smi_bytes"], r["id"]
        assert r["planned"] and r["planned"]["micro_batch"] == r["micro_batch"], r["id"]
        assert r["planned"]["checkpointing"] == r["checkpointing"], r["id"]
        assert os.path.isfile(os.path.join(ROOT, "examples", "configs", r["model"], "config.json")), r["model"]
    for d in doc["dropped"]:
        assert d["what"] and d["url"] and d["why"]
    assert all(doc["summary"].values())


def test_script_rows_match_the_committed_table():
    rows = _script().ROWS
    committed = {r["id"]: r for r in _doc()["rows"]}
    assert [r["id"] for r in rows] == list(committed)
    for r in rows:
        for key in SETTINGS + ("published_alloc_bytes", "published_smi_bytes", "published_tokens_per_s"):
            assert committed[r["id"]][key] == r[key], (r["id"], key)
    with open(os.path.join(RESULTS, "results.csv")) as f:
        assert [row["id"] for row in csv.DictReader(f)] == list(committed)

