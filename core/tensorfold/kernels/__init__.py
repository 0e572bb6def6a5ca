"""Kernels, one folder per op: `naive.py` is the plain-torch reference (the CPU path), the fast version sits
beside it, and the op's `__init__.py` exports the public functions that pick one. Triton is imported lazily:
nothing here needs it on the CPU."""
