"""The built-in tabletop with its ticks split around a physics part that runs outside the step's
captured graphs (a test double of :class:`flashrt_gym.simulator.SplitTicks`, the plan MuJoCo Warp's
own graph takes): the same task through the split plan must give what the one-program plan gives,
byte for byte, and a refused step must leave every ``sim.*`` buffer as it was."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from flashrt.runtime import BufferSet
from flashrt_gym.engine import Engine
from flashrt_gym.sims.tabletop import Tabletop, TabletopConfig


def physics_first(engine: Engine) -> Callable[[], None]:
    """A wrong split step (the mutation): the physics launched before the act graph loads the
    ticks, so it steps what the previous step left in the scratch."""

    def launch() -> None:
        if "act" not in engine.graph:
            engine.graph.capture("act", engine._act_and_begin_ticks, guard=engine._guard)
            engine.graph.capture("finish", engine._end_ticks_and_finish, guard=engine._guard)
        engine.sim.physics(engine.cfg.n_action_steps)
        engine.graph.replay("act")
        engine.graph.replay("finish")

    return launch


class SplitTabletop(Tabletop):
    """:meth:`begin_ticks` loads the slots' state and the actions into scratch, :meth:`physics`
    steps the scratch (the tabletop's own ticks), :meth:`end_ticks` stores it back with the
    rewards; ``run_ticks`` is the inherited one-call tick, equal to the three in a row."""

    physics_outside_capture = True

    def __init__(self, num_slots: int, cfg: TabletopConfig | None = None) -> None:
        super().__init__(cfg)
        self.num_slots = num_slots

    def bind(self, bufs: BufferSet) -> SplitTabletop:
        super().bind(bufs)
        state = self.state
        copies = {f.name: getattr(state, f.name).clone() for f in dataclasses.fields(state)}
        self._scratch = dataclasses.replace(state, **copies)
        self._rewards = torch.zeros(2, bufs.num_slots, device=bufs.device)
        self._actions: torch.Tensor | None = None
        return self

    def begin_ticks(self, actions: torch.Tensor, dense: torch.Tensor, sparse: torch.Tensor) -> None:
        if self._actions is None or self._actions.shape != actions.shape:
            self._actions = torch.zeros_like(actions)  # first call: a warm-up run, before any capture
        self._actions.copy_(actions)
        for f in dataclasses.fields(self._scratch):
            getattr(self._scratch, f.name).copy_(getattr(self.state, f.name))

    def physics(self, ticks: int) -> None:
        if self._actions is None or self._actions.shape[1] != ticks:
            raise ValueError(f"physics({ticks}) without begin_ticks of {ticks} ticks")
        real, self._state = self._state, self._scratch
        try:
            Tabletop.run_ticks(self, self._actions, self._rewards[0], self._rewards[1])
        finally:
            self._state = real

    def end_ticks(self, dense: torch.Tensor, sparse: torch.Tensor) -> None:
        for f in dataclasses.fields(self._scratch):
            getattr(self.state, f.name).copy_(getattr(self._scratch, f.name))
        dense.copy_(self._rewards[0])
        sparse.copy_(self._rewards[1])
