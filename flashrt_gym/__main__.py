"""``python -m flashrt_gym train|eval [Hydra overrides]``: the main job or an evaluation."""

from flashrt_gym.cli import main

if __name__ == "__main__":
    main()
