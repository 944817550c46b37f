"""vramfit: fit mixed-precision fine-tuning of Hugging Face models into one small GPU."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# DeepSpeed's JIT-built ops (CPU Adam, ...) are cached per Python environment, not in one folder shared
# by every venv: two environments sharing it rebuild each other's ops (minutes each) and wait on each
# other's build locks. Set TORCH_EXTENSIONS_DIR to choose another place.
_os.environ.setdefault("TORCH_EXTENSIONS_DIR", _os.path.join(_sys.prefix, "var", "torch_extensions"))
