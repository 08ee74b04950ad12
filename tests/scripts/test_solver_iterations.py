"""scripts/solver_iterations.py's loop length at B worlds: the expected maximum of B draws from
the observed iteration counts, against a brute-force simulation of that maximum."""

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from solver_iterations import expected_max  # noqa: E402


def test_the_expected_maximum_matches_sampled_maxima_and_grows_with_the_worlds():
    rng = np.random.default_rng(0)
    counts = rng.choice([0, 1, 2, 3, 9], size=5000, p=[0.1, 0.6, 0.2, 0.099, 0.001])
    assert expected_max(counts, 1) == pytest.approx(counts.mean())
    for worlds in (2, 64, 4096):
        sampled = rng.choice(counts, size=(4000, worlds)).max(axis=1).mean()
        assert expected_max(counts, worlds) == pytest.approx(sampled, abs=0.05 * 9)
    assert expected_max(counts, 4096) > 8.5 > 4 > expected_max(counts, 64)  # a rare hard step sets the loop
    assert expected_max(np.full(10, 4), 4096) == 4.0
