"""Stand-in for the sglang package root: only sglang.benchmark (from the wheel) and the stubs below are here."""
