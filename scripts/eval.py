"""Evaluate a trained agent, or the unsteered base policy (``flashrt-eval`` from a checkout).

    python scripts/eval.py +checkpoint=outputs/<run>/checkpoints/last.safetensors   # FastSAC
    python scripts/eval.py agent=sac +checkpoint=outputs/<run>/checkpoints/last.zip # an SB3 agent
    python scripts/eval.py                                   # the base policy alone
    python scripts/eval.py +split=test +video=videos/        # the test starts; two episodes as videos
    python scripts/eval.py +checkpoint=<...> +video=videos/  # base beside steered, and strip.png

The job is :func:`flashrt_gym.cli.eval.main`; see there.
"""

from flashrt_gym.cli.eval import main

if __name__ == "__main__":
    main()
