"""The reuse gate's parts: HTTP, the keep policy written out again, scenarios, runs and checks."""
