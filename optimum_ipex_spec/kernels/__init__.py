"""Kernels: the C++ sources (``csrc/``, real files built at their first use with ``torch.utils.cpp_extension``) and
the Python that builds, loads and registers them. Imports only the base modules (compat, facts, utils)."""

from pathlib import Path

#: the folder of the C++ sources
CSRC = Path(__file__).parent / "csrc"
