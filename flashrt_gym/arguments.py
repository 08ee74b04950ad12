"""Argument checks of the env (its constructor, slot lists, actions): each refuses a bad value with
an error that names the argument and what it accepts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def choose(name: str, value: Any, options: Sequence[Any]) -> Any:
    """``value`` if it is one of ``options``."""
    if value not in options:
        raise ValueError(f"{name} must be one of {list(options)}, got {value!r}")
    return value


def count(name: str, value: Any) -> int:
    """``value`` as an int >= 1 (no bools, no floats)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def positive(name: str, value: Any) -> float:
    """``value`` as a finite float > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not 0 < value < np.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def slot_list(slots: Any, num_envs: int, what: str) -> list[int]:
    """``slots`` as a non-empty list of distinct slot indices in range (no negatives, no bools)."""
    want = f"distinct integers in [0, {num_envs})"
    if isinstance(slots, (str, bytes)) or not isinstance(slots, (Sequence, range, np.ndarray, torch.Tensor)):
        raise TypeError(f"{what}: slots must be a sequence of {want}, got {type(slots).__name__}")
    items = slots.tolist() if isinstance(slots, (np.ndarray, torch.Tensor)) else list(slots)
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in items):
        raise TypeError(f"{what}: slots must be {want}, got {items!r:.80}")
    out = [int(s) for s in items]
    if not out:
        raise ValueError(f"{what}: empty list of slots; name at least one slot in [0, {num_envs})")
    if any(not 0 <= s < num_envs for s in out) or len(set(out)) != len(out):
        raise ValueError(f"{what}: slots must be {want}, got {out}")
    return out


SEED_MAX = 2**62
"""Seeds are ints in [0, SEED_MAX]: slot streams fold them with their index into 64 bits."""


def reset_seeds(seed: Any, num_envs: int) -> int | np.ndarray | None:
    """``reset``'s ``seed`` checked: None, an int (slot i uses ``seed + i``), or one int a slot, as
    Gymnasium's vector envs take it (a list of ``num_envs``, repeats allowed: slots that share a
    seed share their start).

    Returns:
        None, the int, or an int64 array (num_envs,).

    Raises:
        ValueError: another type, a list of another length, or a seed out of range.
    """
    if seed is None:
        return None
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        if not 0 <= int(seed) <= SEED_MAX - num_envs:
            raise ValueError(f"seed must be an int in [0, 2**62 - num_envs] (slot i uses seed + i), got {seed!r}")
        return int(seed)
    items = seed.tolist() if isinstance(seed, (np.ndarray, torch.Tensor)) else seed
    valid = isinstance(items, (list, tuple)) and len(items) == num_envs
    if not valid or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= SEED_MAX for s in items):
        raise ValueError(
            f"seed must be an int (slot i uses seed + i) or a list of {num_envs} ints in [0, 2**62] (one a slot), "
            f"got {seed!r:.80}"
        )
    return np.asarray(items, dtype=np.int64)


def check_actions(a: np.ndarray | torch.Tensor, want: tuple[int, ...], repeated: bool) -> None:
    """Actions of shape ``want`` (num_envs, action size) and a floating dtype."""
    if tuple(a.shape) != want:
        what = "action_dim, repeated over the horizon" if repeated else "horizon * action_dim"
        raise ValueError(f"actions must have shape {want} (num_envs, {what}), got {tuple(a.shape)}")
    if not (a.is_floating_point() if isinstance(a, torch.Tensor) else np.issubdtype(a.dtype, np.floating)):
        raise ValueError(f"actions must be floating point, got {a.dtype}")


def check_action_bounds(a: np.ndarray) -> None:
    """Every action in [-1, 1] (the action space is symmetric; NaN fails it)."""
    if not np.abs(a).max(initial=0.0) <= 1.0 + 1e-6:
        reject_actions(a)


def reject_actions(actions: np.ndarray | torch.Tensor) -> None:
    """Raise the error that names why ``actions`` are out of the action space."""
    finite = torch.isfinite(actions).all() if isinstance(actions, torch.Tensor) else np.isfinite(actions).all()
    if not finite:
        raise ValueError("actions contain NaN or infinity")
    raise ValueError("actions must lie in [-1.0, 1.0] (the action space); clip them first")


def host_actions(actions: Any, want: tuple[int, ...], repeated: bool) -> np.ndarray:
    """``actions`` (an array-like of the caller's) checked, as a contiguous float32 NumPy array."""
    if not isinstance(actions, (np.ndarray, list, tuple, torch.Tensor)):
        raise TypeError(f"actions must be an array of shape {want}, got {type(actions).__name__}")
    a = actions.numpy(force=True) if isinstance(actions, torch.Tensor) else np.asarray(actions)
    check_actions(a, want, repeated)
    check_action_bounds(a)
    return np.ascontiguousarray(a, dtype=np.float32)
