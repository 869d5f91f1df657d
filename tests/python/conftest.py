"""pytest configuration for the Python tests of fastweight.

Run against a build tree:  PYTHONPATH=<build>/python python -m pytest tests/python -q
(or against an installed wheel: python -m pytest tests/python -q).
Tests marked `gpu` need a CUDA device; without one they are reported as skipped ("no CUDA device"),
never as passed. `-m gpu` selects only them, `-m "not gpu"` only the CPU tests.
"""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
