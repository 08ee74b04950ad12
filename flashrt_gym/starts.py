"""Seeded episode starts kept as capsules: a repeated ``reset(seed=s)`` is a byte copy.

``reset(seed=s)`` runs the cold start of every slot (simulator draw, instruction, first encode)
once; :class:`StartCache` keeps the resulting boundary in a :class:`flashrt.runtime.CapsuleRegistry`
under an explicit byte budget on the env's device, so the next reset to the same seed (an
evaluation's fixed starts, a training run's restart) restores it instead. Starts beyond the budget
are evicted least recently used first; a budget smaller than one set of starts keeps none.
"""

from __future__ import annotations

import os

import torch

from flashrt.runtime import Capsule, CapsuleRegistry


def default_budget(device: torch.device, state_nbytes: int) -> int:
    """The start cache's default budget: one set of starts where that is at most 1/16 of the
    device's memory (the host's on the CPU), else none.

    Args:
        device: the env's device. state_nbytes: the bytes of one set of starts (the slot state).

    Returns:
        ``state_nbytes`` or 0.
    """
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return state_nbytes if state_nbytes <= total // 16 else 0


class StartCache:
    """Episode-start capsules by seed, within ``budget_bytes`` of the env's device memory.

    Args:
        budget_bytes: bytes of starts kept (0 keeps none).
    """

    def __init__(self, budget_bytes: int) -> None:
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 0:
            raise ValueError(f"start_cache_bytes must be an int >= 0, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._registry = CapsuleRegistry(gpu_bytes=budget_bytes, host_bytes=0)

    @staticmethod
    def _name(seed: int) -> str:
        return f"start-{seed}"

    def get(self, seed: int) -> Capsule | None:
        """The starts of ``seed``, if kept."""
        name = self._name(seed)
        return self._registry.get(name) if name in self._registry else None

    def put(self, seed: int, capsule: Capsule) -> None:
        """Keep ``capsule`` as the starts of ``seed`` if it fits the budget at all."""
        if capsule.nbytes <= self.budget_bytes:
            self._registry.put(self._name(seed), capsule)

    def __len__(self) -> int:
        return len(self._registry)

    @property
    def nbytes(self) -> int:
        """Bytes of starts kept now."""
        return self._registry.used("gpu")
