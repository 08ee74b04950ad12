"""A registry of named capsules under explicit tier budgets.

Rules, all of them:

1. Each tier (``gpu``, ``host``, ``disk``) has a byte budget (``None``: unbounded; ``disk`` is
   off unless the registry has a ``root`` folder).
2. A pinned capsule never moves and is never evicted; pinning more than a tier's budget is
   refused.
3. When a tier is over budget, its least recently used unpinned capsule moves one tier down
   (``gpu`` -> ``host`` -> ``disk``); one pushed out of the last tier is evicted.
4. :meth:`CapsuleRegistry.put` enters an unpinned capsule in the highest tier, from its own
   down, whose budget less its pinned bytes can hold it; :meth:`CapsuleRegistry.get` marks it
   used and promotes it the same way (the only step that is not a device copy). A capsule too
   big for a tier never flushes that tier.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from flashrt.runtime.capsule import TIERS, Capsule, CapsuleError, Tier

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


@dataclass
class RegistryStats:
    """Counters since the registry was made, and bytes held per tier now."""

    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    count: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))


@dataclass
class _Item:
    capsule: Capsule
    pinned: bool
    owns_file: bool = False


class CapsuleRegistry:
    """Named capsules with per-tier byte budgets, pinning, LRU demotion and promotion on use.

    Args:
        root: folder for the disk tier (None: no disk tier; demotion past host evicts).
        gpu_bytes, host_bytes, disk_bytes: budgets per tier; None means unbounded.

    Example:
        >>> reg = CapsuleRegistry("capsules/", gpu_bytes=1 << 30, host_bytes=8 << 30)
        >>> reg.put("episode-start", snapshot(bufs), pin=True)
        >>> restore(bufs, reg.get("episode-start"))
    """

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        *,
        gpu_bytes: int | None = None,
        host_bytes: int | None = None,
        disk_bytes: int | None = None,
    ) -> None:
        self.root = Path(root) if root is not None else None
        self.budgets: dict[Tier, int | None] = {
            "gpu": gpu_bytes,
            "host": host_bytes,
            "disk": disk_bytes if self.root is not None else 0,
        }
        for tier, b in self.budgets.items():
            if b is not None and b < 0:
                raise ValueError(f"{tier}_bytes must be >= 0 or None, got {b}")
        self._items: OrderedDict[str, _Item] = OrderedDict()  # least recently used first
        self._stats = RegistryStats()

    # -- queries -------------------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> list[str]:
        """Names held, least recently used first."""
        return list(self._items)

    def tier_of(self, name: str) -> Tier:
        return self._item(name).capsule.tier

    def is_pinned(self, name: str) -> bool:
        return self._item(name).pinned

    def used(self, tier: Tier, *, pinned_only: bool = False) -> int:
        """Bytes held in ``tier`` (only pinned capsules' with ``pinned_only``)."""
        return sum(
            it.capsule.nbytes
            for it in self._items.values()
            if it.capsule.tier == tier and (it.pinned or not pinned_only)
        )

    @property
    def stats(self) -> RegistryStats:
        s = self._stats
        s.bytes = {t: self.used(t) for t in TIERS}
        s.count = {t: sum(it.capsule.tier == t for it in self._items.values()) for t in TIERS}
        return s

    def _item(self, name: str) -> _Item:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"no capsule named {name!r}; the registry holds {self.names()}") from None

    # -- verbs ---------------------------------------------------------------------------------
    def put(self, name: str, capsule: Capsule, *, pin: bool = False) -> Capsule:
        """Add (or replace) ``name``. The capsule enters in its current tier, as the most
        recently used; over-budget tiers then demote their LRU unpinned capsules."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"capsule name {name!r} must match {_NAME.pattern}")
        if not isinstance(capsule, Capsule):
            raise TypeError(f"put takes a Capsule, got {type(capsule).__name__}")
        if pin:
            self._check_pin_fits(name, capsule.tier, capsule.nbytes)
        old = self._items.get(name)

        def freed(tier: Tier) -> int:  # pinned bytes a replacement gives back
            return old.capsule.nbytes if old is not None and old.pinned and old.capsule.tier == tier else 0

        entered_on_disk = capsule.tier == "disk"
        target = capsule.tier
        if not pin:
            start = TIERS.index(capsule.tier)
            fits = [t for t in TIERS[start:] if self._room(t) + freed(t) >= capsule.nbytes]
            if not fits:
                raise CapsuleError(
                    f"capsule {name!r} ({capsule.nbytes} B) is larger than the free budget of every tier "
                    f"from {capsule.tier} down ({self.budgets}); raise a budget or give the registry a root folder"
                )
            target = fits[0]
        if old is not None:
            self._drop(name)  # a replacement, not an eviction
        self._move(capsule, target, name)
        self._items[name] = _Item(capsule, pin, owns_file=capsule.tier == "disk" and not entered_on_disk)
        self._settle()
        return capsule

    def get(self, name: str) -> Capsule:
        """The capsule ``name``, marked used and promoted as far up as its size allows."""
        if name not in self._items:
            self._stats.misses += 1
        it = self._item(name)
        self._stats.hits += 1
        self._items.move_to_end(name)
        if not it.pinned:
            up = [t for t in TIERS[: TIERS.index(it.capsule.tier)] if self._room(t) >= it.capsule.nbytes]
            if up:
                it.capsule.to(up[0])
                if it.owns_file and it.capsule.path is not None:  # the file was only a tier
                    it.capsule.path.unlink(missing_ok=True)
                    it.capsule.path, it.owns_file = None, False
                self._stats.promotions += 1
                self._settle()
        return it.capsule

    def pin(self, name: str) -> None:
        """Pin ``name`` where it is now (refused if the tier's pinned bytes would pass its budget)."""
        it = self._item(name)
        if not it.pinned:
            self._check_pin_fits(name, it.capsule.tier, it.capsule.nbytes)
            it.pinned = True

    def unpin(self, name: str) -> None:
        """Make ``name`` movable again; it may be demoted at the next settle."""
        self._item(name).pinned = False
        self._settle()

    def evict(self, name: str) -> Capsule:
        """Remove ``name`` (pinned or not) and delete its disk file if the registry wrote it."""
        capsule = self._drop(name)
        self._stats.evictions += 1
        return capsule

    def _drop(self, name: str) -> Capsule:
        self._item(name)
        it = self._items.pop(name)
        if it.owns_file and it.capsule.path is not None:
            it.capsule.path.unlink(missing_ok=True)
        return it.capsule

    # -- policy --------------------------------------------------------------------------------
    def _check_pin_fits(self, name: str, tier: Tier, nbytes: int) -> None:
        budget = self.budgets[tier]
        pinned = self.used(tier, pinned_only=True)
        if name in self._items and self._items[name].pinned and self._items[name].capsule.tier == tier:
            pinned -= self._items[name].capsule.nbytes
        if budget is not None and pinned + nbytes > budget:
            raise CapsuleError(
                f"cannot pin {name!r} ({nbytes} B) in the {tier} tier: pinned capsules there would "
                f"hold {pinned + nbytes} B over its budget of {budget} B; raise {tier}_bytes or unpin others"
            )

    def _room(self, tier: Tier) -> float:
        """Bytes an unpinned capsule may take in ``tier``: its budget less its pinned bytes."""
        budget = self.budgets[tier]
        return float("inf") if budget is None else budget - self.used(tier, pinned_only=True)

    def _move(self, capsule: Capsule, tier: Tier, name: str) -> None:
        if tier == capsule.tier:
            return
        if tier == "disk":
            capsule.to("disk", path=self.root / f"{name}.safetensors")  # type: ignore[operator]
        else:
            capsule.to(tier)

    def _settle(self) -> None:
        for rank, tier in enumerate(TIERS):
            budget = self.budgets[tier]
            while budget is not None and self.used(tier) > budget:
                victim = next(
                    n for n, it in self._items.items() if it.capsule.tier == tier and not it.pinned
                )  # exists: pinned bytes never pass the budget
                it = self._items[victim]
                if rank + 1 == len(TIERS) or (tier == "host" and self.root is None):
                    self.evict(victim)
                    continue
                self._move(it.capsule, TIERS[rank + 1], victim)
                it.owns_file |= it.capsule.tier == "disk"
                self._stats.demotions += 1
