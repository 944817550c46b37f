"""Sources: folders and globs of shards, every file format, weighted mixtures, a separate eval source, hub ids,
chat templates, train_on_prompt; and each bad input as one ConfigError naming the shard, the line, the rule and
the fix (issue 17, and the files part of issue 15)."""

import json
import logging
import os

import pytest

from helpers.hf import QA, make_model_dir, qa_records, write_jsonl
from launcher.config.load import load_config
from launcher.config.schema import ConfigError
from launcher.data import load_data, load_splits, settle_formats
from launcher.model.build import load_tokenizer


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMFIT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_hf")))


def load(model_dir, *overrides, splits=False):
    cfg = load_config(None, [f"model.name={model_dir}", "data.seq_len=32", "train.global_batch_size=2",
                             "train.micro_batch_size=1", *overrides])
    tok = load_tokenizer(cfg)
    return (load_splits if splits else load_data)(cfg, len(tok), tok), tok


def problem(model_dir, *overrides, splits=False) -> str:
    with pytest.raises(ConfigError) as e:
        load(model_dir, *overrides, splits=splits)
    assert len(e.value.problems) == 1, e.value.problems
    return e.value.problems[0]


def shards(tmp_path, n=3, per=8, kind="prompt_response", name="s"):
    d = tmp_path / name
    d.mkdir()
    recs = qa_records(kind, repeat=2)
    for i in range(n):
        write_jsonl(str(d / f"part-{i}.jsonl"), recs[i * per:(i + 1) * per])
    return d


# ---- where records come from


def test_folder_and_glob_of_shards_read_in_order(model_dir, tmp_path):
    d = shards(tmp_path)
    (d / "README.md").write_text("not data")  # left out, with a log line
    data, tok = load(model_dir, f"data.source={d}")
    g, _ = load(model_dir, f"data.source={d}/part-*.jsonl")
    assert len(data) == len(g) == 24
    first = tok.decode(data.example(0)[0].tolist(), skip_special_tokens=True)
    assert first.startswith("what is the color of the sky ?")  # record 1 of part-0
    assert tok.decode(data.example(8)[0].tolist(), skip_special_tokens=True).startswith(QA[8][0])  # part-1's first


@pytest.mark.parametrize("ext", ["csv", "parquet", "arrow", "txt", "json"])
def test_every_file_format(model_dir, tmp_path, ext):
    import datasets

    recs = [{"text": f"the cat sat on the mat . {i}"} for i in range(12)]
    path = str(tmp_path / f"d.{ext}")
    ds = datasets.Dataset.from_list(recs)
    if ext == "csv":
        ds.to_csv(path, index=False)
    elif ext == "parquet":
        ds.to_parquet(path)
    elif ext == "json":
        open(path, "w").write(json.dumps(recs))
    elif ext == "txt":
        open(path, "w").write("\n\n".join(r["text"] for r in recs) + "\n")
    else:  # datasets' own Arrow stream files (what save_to_disk writes)
        ds.save_to_disk(str(tmp_path / "saved"))
        os.rename(next(str(p) for p in (tmp_path / "saved").glob("*.arrow")), path)
    data, _ = load(model_dir, f"data.source={path}", "data.seq_len=16")
    assert "12 text records" in data.description and len(data) >= 2


def test_tokens_stored_in_the_smallest_type(model_dir, tmp_path):
    src = write_jsonl(str(tmp_path / "d.jsonl"), qa_records(repeat=1))
    data, tok = load(model_dir, f"data.source={src}")
    store = data.samples.stores[0]
    assert len(tok) <= 256 and store.values[0].dtype.name == "uint8"  # the test vocabulary: one byte per id
    assert store.marker["dtype"] == "uint8"


def test_weighted_mixture(model_dir, tmp_path, vramfit_log):
    a = write_jsonl(str(tmp_path / "a.jsonl"), qa_records("prompt_response", repeat=4))  # 48 records
    b = write_jsonl(str(tmp_path / "b.jsonl"), qa_records("alpaca", repeat=1))  # 12 records
    data, _ = load(model_dir, f"data.sources=[{{path: {a}, weight: 1}}, {{path: {b}, weight: 1}}]", "data.seq_len=96")
    src = data.samples.src
    assert (src == 0).sum() == 48 and 40 <= (src == 1).sum() <= 56  # b repeated to half of the mixture
    assert "data mixture:" in vramfit_log.text and "weight 1" in data.description
    again, _ = load(model_dir, f"data.sources=[{{path: {a}, weight: 1}}, {{path: {b}, weight: 1}}]", "data.seq_len=96")
    assert (again.samples.src == src).all() and (again.samples.rows == data.samples.rows).all()  # seeded
    only_a, _ = load(model_dir, f"data.sources=[{{path: {a}, weight: 1}}, {{path: {b}, weight: 0}}]", "data.seq_len=96")
    assert len(only_a) == 48


def test_eval_source(model_dir, tmp_path):
    tr = write_jsonl(str(tmp_path / "train.jsonl"), qa_records(repeat=2))
    ev = write_jsonl(str(tmp_path / "eval.jsonl"), qa_records(repeat=1)[:5])
    (train, evd), _ = load(model_dir, f"data.source={tr}", f"data.eval_source={ev}", splits=True)
    assert len(train) == 24 and len(evd) == 5 and "eval.jsonl" in evd.description


def test_hub_dataset_id(model_dir, monkeypatch):
    import datasets

    calls = []

    def fake(path, name=None, split=None, **kw):
        calls.append((path, name, split))
        if path != "org/qa":
            raise ConnectionError("could not reach the hub")
        return datasets.Dataset.from_list(qa_records(repeat=1))

    monkeypatch.setattr(datasets, "load_dataset", fake)
    data, _ = load(model_dir, "data.sources=[{path: org/qa, name: small, split: train}]")
    assert len(data) == 12 and ("org/qa", "small", "train") in calls
    p = problem(model_dir, "data.source=org/nothing")
    assert "could not reach the hub" in p and "not a local file or folder" in p and "fix:" in p


def test_chat_template_by_name_and_file(tmp_path, vramfit_log):
    d = make_model_dir(str(tmp_path / "m"), chat_template=False)
    src = write_jsonl(str(tmp_path / "d.jsonl"), qa_records("messages", repeat=1))
    data, tok = load(d, f"data.source={src}", "data.chat_template=zephyr")
    assert "built-in zephyr template" in vramfit_log.text
    text = tok.decode(data.example(0)[0].tolist())
    assert "sky ? <eos>" in text  # zephyr ends every turn with eos (its markers are unknown words to this tokenizer)
    assert tok.chat_template and "eos_token" in tok.chat_template  # saved with the final weights
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}say {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}say "
                 "{% endif %}")
    data, tok = load(d, f"data.source={src}", f"data.chat_template={f}")
    ids, labels = data.example(0)
    assert tok.decode(ids.tolist()) == "say what is the color of the sky ? say blue ."
    assert tok.decode(ids[labels != -100].tolist()) == "blue ."
    assert "chat_template" in problem(d, f"data.source={src}", "data.chat_template=chatm")


def test_train_on_prompt(model_dir, tmp_path):
    src = write_jsonl(str(tmp_path / "d.jsonl"), qa_records(repeat=1))
    masked, _ = load(model_dir, f"data.source={src}")
    both, _ = load(model_dir, f"data.source={src}", "data.train_on_prompt=true")
    ids, labels = both.example(0)
    assert (labels[1:] == ids[1:]).all() and (masked.example(0)[1] == -100).sum() > 1
    assert "in the loss too" in both.description


# ---- bad input, each named


def test_shard_with_a_bad_line_is_named(model_dir, tmp_path):
    d = shards(tmp_path)
    (d / "part-1.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a", "response": }\n')
    p = problem(model_dir, f"data.source={d}")
    assert "part-1.jsonl" in p and "line 2:" in p and "fix: correct that line" in p


def test_damaged_parquet_shard_is_named(model_dir, tmp_path):
    import pandas as pd

    d = tmp_path / "pq"
    d.mkdir()
    for i in range(3):
        pd.DataFrame(qa_records(repeat=1)).to_parquet(d / f"part-{i}.parquet")
    raw = (d / "part-2.parquet").read_bytes()
    (d / "part-2.parquet").write_bytes(raw[: len(raw) // 2])  # a copy cut short
    p = problem(model_dir, f"data.source={d}")
    assert "part-2.parquet" in p and "parquet" in p and "fix:" in p


def test_shard_with_other_fields_is_named(model_dir, tmp_path):
    d = shards(tmp_path)
    write_jsonl(str(d / "part-9.jsonl"), [{"question": "q", "answer": "a"}])
    p = problem(model_dir, f"data.source={d}")
    assert "part-9.jsonl" in p and "same fields" in p


def test_mixed_file_formats_in_one_source(model_dir, tmp_path):
    d = shards(tmp_path)
    (d / "extra.csv").write_text("prompt,response\na,b\n")
    p = problem(model_dir, f"data.source={d}")
    assert "mixes file formats" in p and "extra.csv" in p and "data.sources" in p


def test_sources_of_different_kinds(model_dir, tmp_path):
    a = write_jsonl(str(tmp_path / "a.jsonl"), qa_records("text", repeat=1))
    b = write_jsonl(str(tmp_path / "b.jsonl"), qa_records("alpaca", repeat=1))
    with pytest.raises(ConfigError) as e:
        settle_formats(load_config(None, [f"data.sources=[{{path: {a}}}, {{path: {b}}}]"]))
    assert "differs from" in str(e.value) and "one kind of sample" in str(e.value)


def test_weights_negative_or_all_zero(model_dir):
    with pytest.raises(ConfigError, match=r"data.sources\[1\].weight: got -1.0; rule: must be >= 0"):
        load_config(None, ["data.sources=[{path: a.jsonl}, {path: b.jsonl, weight: -1}]"])
    with pytest.raises(ConfigError, match="every weight is 0"):
        load_config(None, ["data.sources=[{path: a.jsonl, weight: 0}, {path: b.jsonl, weight: 0}]"])


def test_not_utf8_names_the_byte_and_the_fix(model_dir, tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_bytes(b'{"prompt": "what is the color of the sky ?", "response": "blue ."}\n'
                    + '{"prompt": "café ?", "response": "yes ."}\n'.encode("cp1252"))
    p = problem(model_dir, f"data.source={src}")
    assert "byte 0xE9 at line 2" in p and "not valid utf-8" in p and "data.encoding=cp1252" in p
    data, tok = load(model_dir, f"data.source={src}", "data.encoding=cp1252")
    assert len(data) == 2


def test_empty_file(model_dir, tmp_path):
    (tmp_path / "e.jsonl").write_text("")
    p = problem(model_dir, f"data.source={tmp_path / 'e.jsonl'}")
    assert "is empty (0 bytes)" in p and "StopIteration" not in p


def test_dropped_records_are_located(model_dir, tmp_path, vramfit_log):
    recs = qa_records(repeat=4)  # 48 records
    recs[4]["response"] = ""
    recs[30]["response"] = None
    src = write_jsonl(str(tmp_path / "d.jsonl"), recs)
    data, _ = load(model_dir, f"data.source={src}", "data.max_invalid_fraction=0.05")
    assert len(data) == 46
    warn = [r.getMessage() for r in vramfit_log.records if r.levelno == logging.WARNING]
    assert any("2 of 48 records dropped" in w and "d.jsonl line 5: response missing or empty" in w
               and "line 31" in w for w in warn), warn
    p = problem(model_dir, f"data.source={src}", "data.max_invalid_fraction=0.01")
    assert "2 of 48 records dropped" in p and "line 5" in p and "rule: at most data.max_invalid_fraction=0.01" in p
    assert "data.max_invalid_fraction=0.05 to train on the rest" in p


def test_fewer_samples_than_one_global_batch(model_dir, tmp_path):
    src = write_jsonl(str(tmp_path / "d.jsonl"), [{"prompt": "say hello .", "response": "hello ."}])
    p = problem(model_dir, f"data.source={src}", splits=True)
    assert "1 training samples" in p and "fewer than one global batch of 2" in p
    assert "train.global_batch_size=1" in p


# ---- from the command line


@pytest.mark.slow
def test_mixture_and_cache_from_the_command_line(model_dir, tmp_path):
    from helpers import run_cli

    a = write_jsonl(str(tmp_path / "a.jsonl"), qa_records("prompt_response", repeat=2))
    b = write_jsonl(str(tmp_path / "b.jsonl"), qa_records("messages", repeat=1))
    args = ["train", f"model.name={model_dir}", f"data.sources=[{{path: {a}, weight: 2}}, {{path: {b}, weight: 1}}]",
            "data.seq_len=64", "train.max_steps=2", "train.warmup_steps=0", "train.micro_batch_size=2",
            "train.global_batch_size=4", "device=cpu", "engine=amp", "sample_tokens=0", "checkpoint.save=false",
            f"output_dir={tmp_path / 'runs'}", "log.progress=off"]
    env = {"VRAMFIT_CACHE": str(tmp_path / "cache")}
    r = run_cli(*args, "run_name=one", env=env)
    assert r.returncode == 0, r.stderr
    assert "data mixture: a.jsonl" in r.stderr and r.stderr.count(": tokenized ") == 2
    s = json.load(open(tmp_path / "runs" / "one" / "summary.json"))
    assert s["tokens_in_loss_per_s"] > 0 and s["tokens_per_s"] > s["tokens_in_loss_per_s"]
    row = json.loads(open(tmp_path / "runs" / "one" / "metrics.jsonl").readline())
    assert row["tokens_in_loss"] > 0 and row["tokens_in_loss_per_s"] > 0
    r = run_cli(*args, "run_name=two", env=env)
    assert r.returncode == 0 and r.stderr.count("reusing the tokenized cache") == 2, r.stderr


@pytest.mark.slow
def test_plan_reads_the_data_format_from_the_command_line(model_dir, tmp_path):
    from helpers import run_cli

    src = write_jsonl(str(tmp_path / "a.jsonl"), qa_records("alpaca", repeat=1))
    base = ["plan", "--json", f"model.name={model_dir}", "device=cpu", "engine=amp"]
    r = run_cli(*base, f"data.source={src}")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["settings"]["packed"] is True
    r = run_cli(*base, f"data.source={tmp_path / 'elsewhere.jsonl'}")  # planning for another machine's files
    assert r.returncode == 0 and json.loads(r.stdout)["settings"]["packed"] is False
    assert "data not read here" in r.stderr
