"""TensorFold: a serving engine for hybrid models that resumes conversations from kept states."""

__version__ = "0.1.0"
