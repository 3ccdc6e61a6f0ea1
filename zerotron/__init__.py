"""zerotron: train transformer language models on one CPU or thousands of GPUs with one config."""

__version__ = "0.1.0"
