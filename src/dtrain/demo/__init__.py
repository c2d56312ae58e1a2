"""`dtrain demo`, the main job: a bundled model trained on real data by an ordinary dtrain
script (`script.py`, run as ``python -m dtrain.demo``), its TRAINING flags (`flags.py`),
their checks before any process starts (`checks.py`, torch-free like the flags) and the
learning-rate rules (`lr.py`).

A command: it imports the core (the public API, models, data, observe, checkpoint) and the
launcher's TOPOLOGY flags; nothing imports it but `dtrain.cli`, and `dtrain plan` and
`dtrain bench`, which name the bundled model by its flags (`flags.add_expert_args`).
Importing the package imports no torch.
"""
