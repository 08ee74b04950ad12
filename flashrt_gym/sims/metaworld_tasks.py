"""Meta-World's tasks by name: the MT10 set and one plain-words instruction per task.

Importing this module imports neither MuJoCo nor Meta-World (the env ids are registered from it).
"""

from collections.abc import Sequence

EPISODE_STEPS = 50
"""Chunks of a Meta-World episode (200 ticks at 4 a chunk, within Meta-World's 500): the noisy
experts took 35-140 ticks, and the shipped MT10 policy was chosen and measured on episodes this long."""

MT10 = (
    "reach-v3",
    "push-v3",
    "pick-place-v3",
    "door-open-v3",
    "drawer-open-v3",
    "drawer-close-v3",
    "button-press-topdown-v3",
    "peg-insert-side-v3",
    "window-open-v3",
    "window-close-v3",
)
"""Meta-World's MT10 tasks, in its order (``metaworld.env_dict.MT10_V3``)."""

INSTRUCTIONS = {
    "assembly-v3": "put the ring on the peg",
    "basketball-v3": "dunk the ball into the basket",
    "bin-picking-v3": "move the puck into the other bin",
    "box-close-v3": "put the lid on the box",
    "button-press-topdown-v3": "press the button from the top",
    "button-press-topdown-wall-v3": "press the button from the top behind the wall",
    "button-press-v3": "press the button",
    "button-press-wall-v3": "press the button behind the wall",
    "coffee-button-v3": "press the button on the coffee machine",
    "coffee-pull-v3": "pull the mug away from the coffee machine",
    "coffee-push-v3": "push the mug under the coffee machine",
    "dial-turn-v3": "turn the dial",
    "disassemble-v3": "take the ring off the peg",
    "door-close-v3": "close the door",
    "door-lock-v3": "lock the door",
    "door-open-v3": "open the door",
    "door-unlock-v3": "unlock the door",
    "hand-insert-v3": "put the hand in the hole",
    "drawer-close-v3": "close the drawer",
    "drawer-open-v3": "open the drawer",
    "faucet-open-v3": "turn the faucet on",
    "faucet-close-v3": "turn the faucet off",
    "hammer-v3": "hammer the nail in",
    "handle-press-side-v3": "press the handle down from the side",
    "handle-press-v3": "press the handle down",
    "handle-pull-side-v3": "pull the handle up from the side",
    "handle-pull-v3": "pull the handle up",
    "lever-pull-v3": "pull the lever up",
    "pick-place-wall-v3": "pick up the puck and place it behind the wall",
    "pick-out-of-hole-v3": "pick the puck out of the hole",
    "pick-place-v3": "pick up the puck and place it at the goal",
    "plate-slide-v3": "slide the plate into the cabinet",
    "plate-slide-side-v3": "slide the plate into the cabinet from the side",
    "plate-slide-back-v3": "slide the plate out of the cabinet",
    "plate-slide-back-side-v3": "slide the plate out of the cabinet to the side",
    "peg-insert-side-v3": "insert the peg into the hole from the side",
    "peg-unplug-side-v3": "unplug the peg to the side",
    "soccer-v3": "kick the ball into the goal",
    "stick-push-v3": "push the bottle with the stick",
    "stick-pull-v3": "pull the bottle with the stick",
    "push-v3": "push the puck to the goal",
    "push-wall-v3": "push the puck to the goal behind the wall",
    "push-back-v3": "push the puck back to the goal",
    "reach-v3": "reach the goal",
    "reach-wall-v3": "reach the goal behind the wall",
    "shelf-place-v3": "place the puck on the shelf",
    "sweep-into-v3": "sweep the puck into the hole",
    "sweep-v3": "sweep the puck off the table",
    "window-open-v3": "slide the window open",
    "window-close-v3": "slide the window closed",
}
"""One plain-words instruction per Meta-World task (all 50), the policy's language input."""


def task_names(tasks: str | Sequence[str]) -> tuple[str, ...]:
    """Meta-World task names of ``tasks``: ``"MT10"``, one task name (``"drawer-open-v3"``) or a list.

    Raises:
        ValueError: an unknown task name.
    """
    names = MT10 if tasks == "MT10" else (tasks,) if isinstance(tasks, str) else tuple(tasks)
    unknown = [n for n in names if n not in INSTRUCTIONS]
    if unknown or not names:
        raise ValueError(
            f"unknown Meta-World tasks {unknown or names!r}; choose 'MT10' or names of {list(INSTRUCTIONS)}"
        )
    return names
