"""Fixtures and markers only (the run helpers live in tests/helpers)."""

from __future__ import annotations

import logging

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def private_cache(tmp_path_factory):
    """Tests never read or write the user's cache folder (a calibration there would change the plans the
    tests expect): XDG_CACHE_HOME points at a temporary folder, for this process and the CLI runs it starts."""
    import os

    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    # `vramfit plan` forks trace workers; a test process may hold threads of earlier tests (a fork copies none of
    # them, and a lock one held stays held), so plans run in-process here trace in-process. The workers have
    # their own test (tests/test_trace_cache.py).
    os.environ.setdefault("VRAMFIT_TRACE_WORKERS", "0")
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip themselves without CUDA (``pytest -m gpu`` selects them on a GPU host)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def vramfit_log(caplog):
    """caplog that sees vramfit's records (its logger does not propagate to the root logger)."""
    logger = logging.getLogger("vramfit")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="vramfit")
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


@pytest.fixture
def no_deepspeed_path(tmp_path):
    """A directory that, put first on PYTHONPATH, makes DeepSpeed unimportable as if it were not installed:
    its sitecustomize sets sys.modules['deepspeed'] = None, so `import deepspeed` raises ModuleNotFoundError
    and importlib.util.find_spec('deepspeed') (what transformers and accelerate ask) returns None."""
    d = tmp_path / "no_ds"
    d.mkdir()
    (d / "sitecustomize.py").write_text("import sys\nsys.modules['deepspeed'] = None\n")
    return str(d)
