"""The tokenized-data cache: made once, memory-mapped and reused by later starts and resumes, keyed by the files'
contents, the settings and the tokenizer; never used when incomplete (a killed build, a full disk)."""

import errno
import glob
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT
from helpers.hf import make_model_dir, qa_records, write_jsonl
from launcher.config.load import load_config
from launcher.config.schema import ConfigError
from launcher.data import load_data
from launcher.model.build import load_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_hf")))


def load(model_dir, src, cache, *overrides):
    cfg = load_config(None, [f"model.name={model_dir}", f"data.source={src}", "data.seq_len=32",
                             f"data.cache_dir={cache}", *overrides])
    tok = load_tokenizer(cfg)
    return load_data(cfg, len(tok), tok)


def markers(cache) -> list[str]:
    return sorted(glob.glob(os.path.join(str(cache), "*", "*", "vramfit.json")))


def test_content_hash_is_remembered_until_the_file_changes(tmp_path):
    from launcher.data.cache import file_digest

    f = tmp_path / "d.jsonl"
    f.write_text("one\n")
    first = file_digest(str(f), str(tmp_path / "c"))
    assert len(glob.glob(str(tmp_path / "c" / "digests" / "*.json"))) == 1
    assert file_digest(str(f), str(tmp_path / "c")) == first
    st = os.stat(f)
    f.write_text("two\n")  # same size; restore the modification time: the change time still moves
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_digest(str(f), str(tmp_path / "c")) != first


def test_second_load_reuses_the_cache(model_dir, tmp_path, vramfit_log):
    src = write_jsonl(str(tmp_path / "d.jsonl"), qa_records(repeat=2))
    first = load(model_dir, src, tmp_path / "c")
    assert "d.jsonl: tokenized 256 tokens in 24 records" in vramfit_log.text
    vramfit_log.clear()
    second = load(model_dir, src, tmp_path / "c")
    assert "reusing the tokenized cache" in vramfit_log.text and ": tokenized " not in vramfit_log.text
    assert (first.input_ids == second.input_ids).all() and (first.labels == second.labels).all()
    assert len(markers(tmp_path / "c")) == 1
    # the same records under another name are the same cache (the key is the content)
    other = tmp_path / "copy.jsonl"
    other.write_bytes(open(src, "rb").read())
    vramfit_log.clear()
    load(model_dir, str(other), tmp_path / "c")
    assert "reusing the tokenized cache" in vramfit_log.text and len(markers(tmp_path / "c")) == 1


def test_changed_file_or_settings_make_a_new_cache(model_dir, tmp_path, vramfit_log):
    src = write_jsonl(str(tmp_path / "d.jsonl"), qa_records(repeat=2))
    load(model_dir, src, tmp_path / "c")
    write_jsonl(src, qa_records(repeat=3))  # edited in place
    vramfit_log.clear()
    assert len(load(model_dir, src, tmp_path / "c")) == 36
    assert "reusing" not in vramfit_log.text
    load(model_dir, src, tmp_path / "c", "data.train_on_prompt=true")
    assert len(markers(tmp_path / "c")) == 3
    load(model_dir, src, tmp_path / "c", "data.seq_len=64")  # cut at batch time: no new tokenization
    assert len(markers(tmp_path / "c")) == 3


def test_cache_of_another_tokenizer_is_rebuilt_with_a_log_line(model_dir, tmp_path, vramfit_log):
    src = write_jsonl(str(tmp_path / "d.jsonl"), qa_records(repeat=1))
    load(model_dir, src, tmp_path / "c")
    other = make_model_dir(str(tmp_path / "other"), pad=False)  # another tokenizer (no pad token)
    vramfit_log.clear()
    load(other, src, tmp_path / "c")
    assert "was made by another tokenizer" in vramfit_log.text and "tokenizing again" in vramfit_log.text
    assert len(markers(tmp_path / "c")) == 2  # the old cache is kept (and said so)


def test_full_disk_while_caching(model_dir, tmp_path, monkeypatch):
    """ENOSPC while the tokens are written: a clear error, and the partial cache removed, never used later."""
    import launcher.data.formats as formats

    src = write_jsonl(str(tmp_path / "d.jsonl"), qa_records(repeat=1))
    real = formats.tokenize_batch

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(formats, "tokenize_batch", full)
    monkeypatch.setattr("launcher.data.cache.tokenize_batch", full)
    with pytest.raises(ConfigError) as e:
        load(model_dir, src, tmp_path / "c")
    (p,) = e.value.problems
    assert "is full" in p and "MiB free" in p and "partial one was removed" in p and "data.cache_dir=" in p
    leftovers = [f for f in glob.glob(str(tmp_path / "c" / "*" / "*")) if not f.endswith(".lock") and "/digests/" not in f]
    assert leftovers == [] and markers(tmp_path / "c") == []
    monkeypatch.setattr("launcher.data.cache.tokenize_batch", real)
    assert len(load(model_dir, src, tmp_path / "c")) == 12  # the next start builds it whole


def test_too_little_space_is_said_before_tokenizing(model_dir, tmp_path, monkeypatch):
    import shutil

    src = write_jsonl(str(tmp_path / "d.jsonl"), qa_records(repeat=1))
    usage = shutil.disk_usage(str(tmp_path))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10))
    with pytest.raises(ConfigError, match="is full .*about 0 MiB needed"):
        load(model_dir, src, tmp_path / "c")


def test_a_killed_build_is_never_used(model_dir, tmp_path):
    """A build killed half-way leaves a temporary directory without its marker; the next start builds anew."""
    src = write_jsonl(str(tmp_path / "d.jsonl"), qa_records(repeat=1))
    code = (f"import os, sys; sys.path.insert(0, {os.path.join(ROOT, 'tests')!r}); sys.path.insert(0, {ROOT!r})\n"
            "import launcher.data.cache as c\n"
            "real = c.os.rename\n"
            "c.os.rename = lambda a, b: os._exit(9)  # killed just before the cache is renamed into place\n"
            "from launcher.config.load import load_config\nfrom launcher.model.build import load_tokenizer\n"
            "from launcher.data import load_data\n"
            f"cfg = load_config(None, ['model.name={model_dir}', 'data.source={src}', 'data.seq_len=32', "
            f"'data.cache_dir={tmp_path / 'c'}'])\n"
            "tok = load_tokenizer(cfg)\nload_data(cfg, len(tok), tok)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 9, r.stderr
    assert glob.glob(str(tmp_path / "c" / "*" / ".tmp-*")) and markers(tmp_path / "c") == []
    data = load(model_dir, src, tmp_path / "c")
    assert len(data) == 12 and len(markers(tmp_path / "c")) == 1


def test_batches_are_cut_from_the_memory_map(model_dir, tmp_path):
    """Token ids stay in the memory-mapped Arrow files: the samples hold views, not copies."""
    import pandas as pd

    src = str(tmp_path / "d.parquet")
    pd.DataFrame({"text": ["the cat sat on the mat ."] * 400}).to_parquet(src)
    data = load(model_dir, src, tmp_path / "c")
    store = data.samples.stores[0]
    assert not store.values[0].flags.owndata and store.values[0].base is not None  # a view of the Arrow buffer
    assert store.lengths.sum() == 400 * 9 and len(data) == 400 * 9 // 32
    b = data.batch([0, 5])
    assert b["input_ids"].shape == (2, 32) and b["input_ids"].dtype.is_floating_point is False
    stream = np.concatenate([store.ids(r) for r in range(4)])
    assert (b["input_ids"][0].numpy() == stream[:32]).all()


@pytest.mark.slow
def test_a_real_full_disk_while_caching(model_dir, tmp_path, monkeypatch):
    """The cache on a 512 KiB tmpfs that fills up mid-build (root only; skipped elsewhere)."""
    small = tmp_path / "small"
    small.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(small)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.decode().strip() or 'needs root'}")
    try:
        monkeypatch.setattr("launcher.data.cache._disk_need", lambda src: 0)  # past the check before the build
        src = write_jsonl(str(tmp_path / "d.jsonl"), qa_records(repeat=2000))  # 1.4 MiB: more than the disk holds
        with pytest.raises(ConfigError) as e:
            load(model_dir, src, small / "c")
        assert "is full" in e.value.problems[0] and "partial one was removed" in e.value.problems[0]
        assert markers(small / "c") == [] and not glob.glob(str(small / "c" / "*" / ".tmp-*"))
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_a_start_that_finds_its_cache_never_imports_datasets(model_dir, tmp_path):
    """Importing datasets costs seconds; a second start reads its cache with pyarrow alone."""
    import pandas as pd

    src = str(tmp_path / "d.parquet")
    pd.DataFrame({"text": ["the cat sat on the mat ."] * 100}).to_parquet(src)
    code = (f"import sys; sys.path.insert(0, {ROOT!r})\n"
            "from launcher.config.load import load_config\nfrom launcher.model.build import load_tokenizer\n"
            "from launcher.data import load_data, settle_formats\n"
            f"cfg = settle_formats(load_config(None, ['model.name={model_dir}', 'data.source={src}', "
            f"'data.seq_len=32', 'data.cache_dir={tmp_path / 'c'}']))\n"
            "tok = load_tokenizer(cfg)\nn = len(load_data(cfg, len(tok), tok))\n"
            "print(n, 'datasets' in sys.modules)\n")
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert first.stdout.split() == ["28", "True"], first.stderr  # tokenizing: datasets does it
    assert second.stdout.split() == ["28", "False"], second.stderr
