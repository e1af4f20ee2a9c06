"""runner: a declarative, Hydra-configured training runner for pipeline-parallel PyTorch."""

__version__ = "0.1.0"
