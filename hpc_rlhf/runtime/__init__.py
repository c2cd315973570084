"""The run plumbing that every recipe shares: the start of a run (run.py), checkpoints and stopping
(checkpointing.py), the frozen reference model (reference.py), the one-model training loop (loop.py) and the
held-out evaluation by generation (evaluation.py). Imported by trainers/ (the one-model recipes) and rl/ (the RL
recipe); it imports neither."""
