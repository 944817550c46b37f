"""Training data: files -> records (:mod:`.files`) -> token samples (:mod:`.tokens`), or the built-in task
(:mod:`.synthetic`); :mod:`.order` decides which samples each step and rank takes."""

from launcher.data.load import load_data  # noqa: F401
from launcher.data.order import micro_batches  # noqa: F401
from launcher.data.tokens import TokenData  # noqa: F401
