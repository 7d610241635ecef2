"""Fixtures for simulator tests."""
import numpy as np
import pytest


@pytest.fixture
def target(monkeypatch):
    """Select the simulated generation: ``target("trn1")``."""
    def set_target(name):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", name)
    return set_target


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
