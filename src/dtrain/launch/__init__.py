"""`dtrain run`: start the workers of a job on top of PyTorch's elastic agent."""
