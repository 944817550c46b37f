"""vramfit: fit mixed-precision fine-tuning of Hugging Face models into one small GPU."""

__version__ = "0.1.0"
