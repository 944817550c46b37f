"""``model.name`` -> its transformers config: a preset, a local model directory or a hub id (one set of errors).

Both the planner (which builds the model on the meta device) and the loop (which loads the weights) read
the config through :func:`load`, so a bad name fails the same way before anything is planned or loaded.
"""

from __future__ import annotations

import os

from launcher.config import ConfigError
from launcher.presets import PRESETS, preset_config


def is_local(name: str) -> bool:
    return os.path.isdir(os.path.expanduser(name))


def load(name: str, trust_remote_code: bool = False):
    """The transformers config of ``name`` (no weights), or a ConfigError saying what is wrong."""
    if name in PRESETS:
        return preset_config(name)
    path = os.path.expanduser(name)
    if not is_local(name) and (name.startswith((".", "/", "~")) or os.sep in name and name.count("/") > 1):
        raise ConfigError([f"model.name: {name!r} is not a directory; rule: a preset ({', '.join(PRESETS)}), a "
                           "local model directory, or a hub id; fix: check the path"])
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError([f"model.name: {name!r} has no loadable config ({str(e).splitlines()[0]}); rule: a preset "
                           f"({', '.join(PRESETS)}), a local model directory with config.json, or a hub id "
                           "reachable from here; fix: pass a local directory or a preset"]) from None
