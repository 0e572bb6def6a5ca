"""Stub package (bench/sglang_stubs/README.md)."""
