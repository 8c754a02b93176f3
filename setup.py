"""The optional compiled helper (ple_prep/core/_native.c): built when a C compiler is there,
skipped (numpy fallback, same results) when not. Everything else is in pyproject.toml."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("ple_prep.core._native", ["ple_prep/core/_native.c"],
                             extra_compile_args=["-O2"], optional=True)])
