"""Fixtures every nemotron family test uses: its own working directory and one torch thread (tensorfold.testing)."""

from __future__ import annotations

from tensorfold.testing.fixtures import one_thread, own_cwd  # noqa: F401  (imported fixtures are active)
