"""`dtrain run`: start the workers of a job on top of PyTorch's elastic agent."""

from dtrain.launch.runner import Target, launch

__all__ = ["Target", "launch"]
