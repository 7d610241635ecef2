"""The test suite. A package so that test modules import their folder's shared helpers explicitly (``from .conftest
import Case`` in tests/kernels) instead of editing sys.path; folders without an ``__init__.py`` import their helper
modules by name, from the folder pytest puts first on sys.path for them."""
