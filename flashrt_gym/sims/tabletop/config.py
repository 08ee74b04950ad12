"""The tabletop task's configuration: objects, goals, instruction splits, sizes and colours.

Static values only (they shape the simulator's buffers and its captured graph); the simulator
itself is :class:`flashrt_gym.sims.tabletop.Tabletop`.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Literal

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (215, 45, 45),
    "green": (45, 165, 65),
    "blue": (45, 85, 215),
    "yellow": (225, 190, 30),
    "purple": (140, 60, 185),
    "orange": (235, 120, 25),
}
SHAPES = ("square", "circle", "triangle", "diamond")
GOALS: dict[str, tuple[float, float]] = {
    "left": (-0.72, 0.0),
    "right": (0.72, 0.0),
    "top": (0.0, 0.72),
    "bottom": (0.0, -0.72),
}
BACKGROUND = (128, 128, 128)
GOAL_COLOR = (170, 185, 170)
EE_COLOR = (30, 30, 30)
TEMPLATE = "push the {object} to the {goal} goal"

Split = Literal["train", "heldout", "all"]


@dataclass(frozen=True)
class TabletopConfig:
    """The task's parameters (all static: they shape the buffers and the captured graph).

    Args:
        objects: ``"colour shape"`` names, distinct colours and shapes (colours from
            :data:`COLORS`, shapes from :data:`SHAPES`).
        goals: goal names from :data:`GOALS`.
        split: which (object, goal) instructions episodes draw from: ``"train"``, the
            ``"heldout"`` combinations kept for generalisation tests, or ``"all"``.
        image_size: side of the square RGB render.
        substeps, contact_iters: fixed iteration counts of the physics.
        ee_radius, obj_radius, goal_radius: sizes in table units (the table is 2 wide).
        max_speed: end-effector displacement per tick at ``|action| = 1``.
        friction: fraction of an object's displacement kept as velocity per substep.
        spawn: objects and end-effector start in ``[-spawn, spawn]^2``.
    """

    objects: tuple[str, ...] = ("red square", "green circle", "blue triangle")
    goals: tuple[str, ...] = ("left", "right", "top", "bottom")
    split: Split = "train"
    image_size: int = 64
    substeps: int = 2
    contact_iters: int = 3
    ee_radius: float = 0.08
    obj_radius: float = 0.12
    goal_radius: float = 0.24
    max_speed: float = 0.06
    friction: float = 0.3
    spawn: float = 0.4
    heldout: tuple[tuple[int, int], ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "objects", tuple(self.objects))
        object.__setattr__(self, "goals", tuple(self.goals))
        if not self.objects:
            raise ValueError("the task needs at least one object, e.g. objects=('red square',)")
        parsed = []
        for name in self.objects:
            parts = str(name).split()
            if len(parts) != 2 or parts[0] not in COLORS or parts[1] not in SHAPES:
                raise ValueError(
                    f"object {name!r} must be 'colour shape', a colour in {list(COLORS)}, a shape in {list(SHAPES)}"
                )
            parsed.append(parts)
        for i, what in ((0, "colour"), (1, "shape")):
            seen = [p[i] for p in parsed]
            if len(set(seen)) != len(seen):
                raise ValueError(f"objects must have distinct {what}s, got {list(self.objects)}")
        if not self.goals or any(g not in GOALS for g in self.goals) or len(set(self.goals)) != len(self.goals):
            raise ValueError(f"goals must be distinct names from {list(GOALS)}, got {list(self.goals)}")
        if self.split not in ("train", "heldout", "all"):
            raise ValueError(f"split must be 'train', 'heldout' or 'all', got {self.split!r}")
        if self.image_size < 16:
            raise ValueError(f"image_size must be >= 16, got {self.image_size}")
        for name in ("substeps", "contact_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("ee_radius", "obj_radius", "goal_radius", "max_speed", "spawn"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.friction < 1:
            raise ValueError(f"friction must be in [0, 1), got {self.friction}")
        # Held out: every (object, goal) with (object + goal) % 4 == 3, so that each object and
        # each goal still appears in training (with one object, nothing is held out).
        combos = itertools.product(range(len(self.objects)), range(len(self.goals)))
        held = tuple(c for c in combos if (c[0] + c[1]) % 4 == 3 and len(self.objects) > 1)
        object.__setattr__(self, "heldout", held)

    def combos(self, split: Split | None = None) -> list[tuple[int, int]]:
        """(object, goal) index pairs of a split (default: this config's split)."""
        split = split or self.split
        every = list(itertools.product(range(len(self.objects)), range(len(self.goals))))
        if split == "all":
            return every
        if split == "heldout":
            if not self.heldout:
                raise ValueError("this configuration holds no instructions out (it needs two or more objects)")
            return list(self.heldout)
        return [c for c in every if c not in self.heldout]

    def instruction(self, obj: int, goal: int) -> str:
        return TEMPLATE.format(object=self.objects[obj], goal=self.goals[goal])

    @property
    def vocabulary(self) -> list[str]:
        """Every word an instruction of this task can use (sorted)."""
        words = set(TEMPLATE.replace("{object}", "").replace("{goal}", "").split())
        for o in self.objects:
            words.update(o.split())
        words.update(self.goals)
        return sorted(words)

    def to_dict(self) -> dict:
        """The constructor's arguments (what a config file or a capsule's owner records)."""
        return {k: v for k, v in asdict(self).items() if k != "heldout"}


def as_tabletop_config(task: TabletopConfig | dict | None) -> TabletopConfig:
    """``task`` as a :class:`TabletopConfig`.

    Args:
        task: a config, a dict of its fields (what a Hydra ``task`` group holds), or None.

    Returns:
        ``task`` itself, the default for None, or the config built from the dict.

    Raises:
        TypeError: ``task`` is none of these.
    """
    if task is None or isinstance(task, TabletopConfig):
        return task or TabletopConfig()
    if not isinstance(task, dict):
        raise TypeError(f"task must be a TabletopConfig or a dict of its fields, got {type(task).__name__}")
    return TabletopConfig(**task)
