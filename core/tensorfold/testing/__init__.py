"""The conformance kit and helpers every family's own tests use (`tensorfold.testing.kit`)."""
