"""Stub: the bootstrap host the load client sends with --fake-prefill (never used here)."""

FAKE_BOOTSTRAP_HOST = "2.2.2.2"
