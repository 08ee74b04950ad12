"""Command-line entry points, installed with the wheel: ``flashrt-train`` (the main job),
``flashrt-eval`` (evaluation) and ``python -m flashrt_gym train|eval``.

Each job is a Hydra app over the packaged configs (``pkg://flashrt_gym.configs``: the checkout's
``configs/`` folder, mapped into the package), so an installed wheel trains with no checkout;
``scripts/train.py`` and ``scripts/eval.py`` are thin wrappers over the same functions.
"""

from __future__ import annotations

import importlib
import sys

CONFIGS = "pkg://flashrt_gym.configs"
JOBS = {
    "train": "train an agent that steers the VLA (the main job; Hydra overrides follow, e.g. experiment=quick)",
    "eval": "evaluate a checkpoint or the base policy (e.g. +checkpoint=<run>/checkpoints/last.safetensors)",
}
USAGE = "usage: python -m flashrt_gym {train,eval} [Hydra overrides ...]\n\n" + "\n".join(
    f"  {name:<6}{what}" for name, what in JOBS.items()
)


def main(argv: list[str] | None = None) -> None:
    """Run the job named by the first argument (``train`` or ``eval``) with the rest as its
    Hydra command line; ``--help`` after the job name prints that job's Hydra help.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Raises:
        SystemExit: with the usage text when no job or an unknown one is named (status 2), or
            after printing it for ``-h`` / ``--help`` (status 0).
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        raise SystemExit(0)
    if not args or args[0] not in JOBS:
        got = f"unknown job {args[0]!r}" if args else "no job named"
        print(f"{got}: name one of {sorted(JOBS)} first\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    sys.argv = [f"flashrt-{args[0]}", *args[1:]]  # Hydra reads its command line from sys.argv
    importlib.import_module(f"flashrt_gym.cli.{args[0]}").main()
