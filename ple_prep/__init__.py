"""ple-prep: prepare the n-gram PLE table of Qwen3.8-Flash-Next for serving from fast storage."""

__version__ = "0.1.0"
