"""Where the samples come from: the built-in synthetic task or a data file."""

from __future__ import annotations

from launcher.config import Config, ConfigError
from launcher.data.files import load_file_data
from launcher.data.synthetic import synthetic_task
from launcher.data.tokens import TokenData


def load_data(cfg: Config, vocab_size: int, tokenizer=None) -> TokenData:
    """The run's samples: the synthetic task, or a data file read and tokenized (:mod:`.files`)."""
    if cfg.data.source == "synthetic":
        if cfg.data.vocab_size > vocab_size:
            raise ConfigError([f"data.vocab_size: got {cfg.data.vocab_size}; rule: the synthetic task's vocabulary "
                               f"must fit the model's ({vocab_size}); fix: data.vocab_size={min(256, vocab_size)}"])
        return synthetic_task(cfg.data.num_samples, cfg.data.seq_len, cfg.data.vocab_size, cfg.seed)
    return load_file_data(cfg, tokenizer, vocab_size)
