"""A registry of named capsules under explicit tier budgets.

Rules, all of them:

1. Each tier (``gpu``, ``host``, ``disk``) has a byte budget the caller chose (``None``:
   unbounded; ``disk`` is off unless the registry has a ``root`` folder).
2. A pinned capsule never moves and is never evicted; pinning more than a tier's budget is
   refused.
3. When a tier is over budget, its least recently used unpinned capsule moves one tier down
   (``gpu`` -> ``host`` -> ``disk``); one pushed out of the last tier is evicted.
4. :meth:`CapsuleRegistry.put` enters an unpinned capsule in the highest tier, from its own
   down, whose budget less its pinned bytes can hold it; :meth:`CapsuleRegistry.get` marks it
   used and promotes it the same way (the only step that is not a device copy). A capsule too
   big for a tier never flushes that tier.

Every verb is a transaction: the moves a rule asks for are prepared first (files written, bytes
read or copied) while every entry still holds its old bytes, then committed together. If
anything fails (a full or read-only disk, a file corrupted since it was written) nothing has
changed and a :class:`~flashrt.runtime.CapsuleError` names the path.

Entries are the registry's own :class:`~flashrt.runtime.Capsule` objects over the caller's
bytes (capsule bytes are never written in place, so sharing them costs nothing and copies
nothing): moving an entry never touches the caller's object, and the same capsule can sit
under two names. The disk tier's files are the registry's own, uniquely named in its root
(``<name>.flashrt-<host>-<pid>-<random>.safetensors``); a user's file there is never written.
They live as long as their entry (and the registry: they are removed when it is collected or
the process exits); files of a registry whose process died are removed when another registry
opens the root.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from flashrt.runtime.capsule import TIERS, Capsule, CapsuleError, Tier
from flashrt.runtime.files import HOST, clean_stale

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
FILE_PATTERN = re.compile(
    r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\.flashrt-(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)-[0-9a-f]{12}\.safetensors"
)
"""Names of the disk tier's files (only those are ever removed from a root)."""


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
    capsule: Capsule  # the registry's own object
    pinned: bool
    owned: Path | None = None  # the disk-tier file this registry wrote for it


class CapsuleRegistry:
    """Named capsules with per-tier byte budgets, pinning, LRU demotion and promotion on use.

    Every budget is the caller's choice (nothing here grows past a bound the caller did not
    pick): ``gpu_bytes`` and ``host_bytes`` are required, and a ``root`` needs ``disk_bytes``.
    A budget counts the capsules' state bytes (:attr:`Capsule.nbytes`).

    Args:
        root: folder for the disk tier (None: no disk tier; demotion past host evicts).
        gpu_bytes, host_bytes: budgets of the memory tiers, in bytes; None means unbounded
            (an explicit choice).
        disk_bytes: budget of the disk tier (with ``root`` only); None means unbounded.

    Example:
        >>> reg = CapsuleRegistry("capsules/", gpu_bytes=1 << 30, host_bytes=8 << 30, disk_bytes=64 << 30)
        >>> reg.put("episode-start", snapshot(bufs), pin=True)
        >>> restore(bufs, reg.get("episode-start"))
    """

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        *,
        gpu_bytes: int | None,
        host_bytes: int | None,
        disk_bytes: int | None = 0,
    ) -> None:
        self.root = Path(root) if root is not None else None
        self.budgets: dict[Tier, int | None] = {"gpu": gpu_bytes, "host": host_bytes, "disk": disk_bytes}
        for tier, b in self.budgets.items():
            if b is not None and (type(b) is not int or b < 0):
                raise ValueError(f"{tier}_bytes must be an int >= 0, or None for no bound, got {b!r}")
        if self.root is None and disk_bytes != 0:
            raise ValueError(f"disk_bytes={disk_bytes} needs a disk tier: pass root=<folder>, or leave disk_bytes out")
        if self.root is not None and disk_bytes == 0:
            raise ValueError(
                f"a root folder ({self.root}) makes a disk tier: give it a budget, disk_bytes=<bytes> "
                "(None for no bound)"
            )
        if self.root is not None:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise CapsuleError(
                    f"the registry root {self.root} cannot be made a folder ({e}); pass a writable folder, or "
                    "root=None for no disk tier"
                ) from None
            clean_stale(self.root)
            clean_stale(self.root, FILE_PATTERN)
        self._items: OrderedDict[str, _Item] = OrderedDict()  # least recently used first
        self._stats = RegistryStats()
        self._files: set[Path] = set()  # every file this registry owns now
        self._finalizer = weakref.finalize(self, _remove, self._files)

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
        """Add (or replace) ``name``. The registry keeps its own capsule object over ``capsule``'s
        bytes (no copy); ``capsule`` itself is never moved. The entry goes in its tier or the
        first one below with room (its own tier if pinned), as the most recently used;
        over-budget tiers then demote their LRU unpinned capsules. Returns a new capsule object
        over the entry, as :meth:`get` does."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"capsule name {name!r} must match {_NAME.pattern}: letters, digits, '_', '.', '-', no path separators"
            )
        if not isinstance(capsule, Capsule):
            raise TypeError(f"put takes a Capsule (from snapshot() or Capsule.load), got {type(capsule).__name__}")
        if capsule.nbytes == 0:
            raise CapsuleError(
                f"capsule {name!r} holds no state bytes, so no budget would bound how many such entries are kept; "
                "snapshot at least one buffer"
            )
        if pin:
            self._check_pin_fits(name, capsule.tier, capsule.nbytes)
        old = self._items.get(name)

        def freed(tier: Tier) -> int:  # pinned bytes a replacement gives back
            return old.capsule.nbytes if old is not None and old.pinned and old.capsule.tier == tier else 0

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
        entry = _Item(capsule.moved(capsule.tier), pin)
        self._apply(self._plan(name, (target, capsule.nbytes, pin)), {name: entry}, dropped=old)
        return entry.capsule.moved(entry.capsule.tier)

    def get(self, name: str) -> Capsule:
        """The capsule ``name``, marked used and promoted as far up as its size allows.

        Returns a new capsule object over the entry's bytes: moving it does not move the entry.
        A capsule that stays on disk (no room above) reads the registry's file, which lives
        only as long as the entry stays on disk."""
        if name not in self._items:
            self._stats.misses += 1
        it = self._item(name)
        moves: dict[str, Tier | None] = {}
        if not it.pinned:
            up = [t for t in TIERS[: TIERS.index(it.capsule.tier)] if self._room(t) >= it.capsule.nbytes]
            if up:
                moves = self._plan(name, (up[0], it.capsule.nbytes, False))
        self._apply(moves, {})
        self._stats.hits += 1
        self._items.move_to_end(name)
        return it.capsule.moved(it.capsule.tier)

    def pin(self, name: str) -> None:
        """Pin ``name`` where it is now (refused if the tier's pinned bytes would pass its budget)."""
        it = self._item(name)
        if not it.pinned:
            self._check_pin_fits(name, it.capsule.tier, it.capsule.nbytes)
            it.pinned = True

    def unpin(self, name: str) -> None:
        """Make ``name`` movable again; it may be demoted now if its tier is over budget."""
        it = self._item(name)
        state = self._state()
        state[name] = (it.capsule.tier, it.capsule.nbytes, False)
        self._apply(self._settle(list(self._items), state), {})
        it.pinned = False

    def evict(self, name: str) -> Capsule:
        """Remove ``name`` (pinned or not) and delete its disk file if the registry wrote it (a
        disk-tier capsule returned then has no file any more)."""
        it = self._item(name)
        self._apply({name: None}, {})
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

    def _state(self) -> dict[str, tuple[Tier, int, bool]]:
        return {n: (it.capsule.tier, it.capsule.nbytes, it.pinned) for n, it in self._items.items()}

    def _plan(self, name: str, record: tuple[Tier, int, bool]) -> dict[str, Tier | None]:
        """The moves that enter ``name`` as the most recently used capsule in ``record``'s tier
        and then settle every tier (``name``'s own move included)."""
        state = self._state()
        state[name] = record
        moves = self._settle([n for n in self._items if n != name] + [name], state)
        moves.setdefault(name, record[0])
        return moves

    def _settle(self, order: list[str], state: dict[str, tuple[Tier, int, bool]]) -> dict[str, Tier | None]:
        """The moves (new tier, or None: evicted) that bring every tier within budget, for
        entries in LRU ``order`` with ``state[name] = (tier, nbytes, pinned)``."""
        tier_of = {n: s[0] for n, s in state.items()}
        used = dict.fromkeys(TIERS, 0)
        for t, nbytes, _ in state.values():
            used[t] += nbytes
        moves: dict[str, Tier | None] = {}
        for rank, tier in enumerate(TIERS):
            budget = self.budgets[tier]
            for n in order:  # victims in LRU order; pinned bytes never pass the budget
                if budget is None or used[tier] <= budget:
                    break
                if tier_of[n] != tier or state[n][2]:
                    continue
                used[tier] -= state[n][1]
                if rank + 1 == len(TIERS) or (tier == "host" and self.root is None):
                    moves[n] = tier_of[n] = None
                else:
                    moves[n] = tier_of[n] = TIERS[rank + 1]
                    used[TIERS[rank + 1]] += state[n][1]
        return moves

    def _apply(self, moves: dict[str, Tier | None], new: dict[str, _Item], dropped: _Item | None = None) -> None:
        """Carry out ``moves`` (and enter ``new`` items, replacing ``dropped``) all-or-nothing:
        every file is written and every byte read or copied before any entry changes."""
        items = {**self._items, **new}
        prepared: dict[str, Capsule] = {}
        written: list[Path] = []
        try:
            for n, tier in moves.items():
                if tier is None or tier == items[n].capsule.tier:
                    continue
                path = self._new_file(n) if tier == "disk" else None
                try:
                    prepared[n] = items[n].capsule.moved(tier, path=path)
                except OSError as e:
                    raise CapsuleError(
                        f"could not move capsule {n!r} to the {tier} tier at {path}: {e}; give the registry a "
                        "writable root folder with room for disk_bytes"
                    ) from e
                if path is not None:
                    written.append(path)
        except BaseException:
            for p in written:
                p.unlink(missing_ok=True)
            raise
        # -- commit: nothing below can fail but the removal of files no entry needs any more --
        stale = [dropped.owned] if dropped is not None and dropped.owned is not None else []
        for n, it in new.items():
            self._items.pop(n, None)
            self._items[n] = it
        for n, tier in moves.items():
            it = self._items[n]
            if tier is None:
                del self._items[n]
                stale.append(it.owned)
                self._stats.evictions += 1
                continue
            if n not in prepared:
                continue
            rank = TIERS.index(tier) - TIERS.index(it.capsule.tier)
            if n not in new:
                self._stats.demotions += rank > 0
                self._stats.promotions += rank < 0
            if it.owned is not None:  # the file was only a tier
                stale.append(it.owned)
                prepared[n].path = None
            it.capsule, it.owned = prepared[n], prepared[n].path if tier == "disk" else None
            if it.owned is not None:
                self._files.add(it.owned)
        for p in stale:
            if p is not None:
                self._files.discard(p)
                _unlink(p)

    def _new_file(self, name: str) -> Path:
        assert self.root is not None
        while True:
            path = self.root / f"{name}.flashrt-{HOST}-{os.getpid()}-{secrets.token_hex(6)}.safetensors"
            if not path.exists():
                return path


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        warnings.warn(f"capsule registry: could not remove {path} ({e}); remove it by hand", stacklevel=3)


def _remove(files: set[Path]) -> None:
    for p in list(files):
        with contextlib.suppress(OSError):
            p.unlink(missing_ok=True)
    files.clear()
