"""The Hydra configs, installed as the package ``flashrt_gym.configs`` (pyproject's package-dir
mapping) so that the entry points find them as ``pkg://flashrt_gym.configs`` without a checkout."""
