"""Training data: sources (:mod:`.sources`: files, folders, globs, hub ids) -> records (:mod:`.files`) -> token ids
and loss masks (:mod:`.formats`, through ``Dataset.map``) cached on disk (:mod:`.cache`) -> mixed (:mod:`.mix`) ->
samples and batches (:mod:`.tokens`, :mod:`.pack`); or the built-in task (:mod:`.synthetic`). :mod:`.order`
decides which samples each step and rank takes."""

from launcher.data.load import load_data, load_splits  # noqa: F401
from launcher.data.order import micro_batches  # noqa: F401
from launcher.data.sources import settle_formats  # noqa: F401
from launcher.data.tokens import Step, TokenData  # noqa: F401
