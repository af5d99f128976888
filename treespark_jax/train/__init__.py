"""Training: prompt sets, rollouts, losses, the train step and checkpoints (DESIGN.md §1.4)."""
