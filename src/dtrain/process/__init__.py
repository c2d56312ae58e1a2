"""What a training process is and needs before any model: its place in the job (topology,
process-group initialisation), the few host-side collectives, its random generators and
their seeding, its logs, its orderly end (teardown), and the check that the installed torch
is recent enough.

A foundation: it imports the leaves and `dtrain.config`, and torch.
"""
