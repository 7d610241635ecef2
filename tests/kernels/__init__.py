"""Kernel tests on the simulator; shared helpers (the Case builder, the accuracy criterion) are in conftest.py."""
