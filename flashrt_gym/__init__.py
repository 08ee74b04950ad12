"""FlashRT-Gym: tasks (batched torch simulators) and, composed with the policy, the vector env."""
