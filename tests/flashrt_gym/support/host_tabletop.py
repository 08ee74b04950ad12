"""The built-in tabletop run on the host as an external simulator (a test double): the same task
stepped through the external path must give what the in-graph path gives, byte for byte."""

from __future__ import annotations

import numpy as np
import torch

from flashrt.runtime import BufferSet
from flashrt_gym.sims.tabletop import Tabletop, TabletopConfig


class HostTabletop:
    """:class:`~flashrt_gym.simulator.ExternalSimulator` over a CPU tabletop; a state row is the
    slot's row of the tabletop's own arena, or, with ``drop``, that row with the named buffer's
    bytes left out (a deliberately incomplete state, for the ablation)."""

    num_cameras, action_dim, proprio_dim, observation_bound = 1, 2, 2, 1.0

    def __init__(self, num_slots: int, cfg: TabletopConfig | None = None, drop: str | None = None) -> None:
        self.sim = Tabletop(cfg or TabletopConfig())
        self.bufs = BufferSet(self.sim.specs(), num_slots, "cpu")
        self.sim.bind(self.bufs)
        self.instructions = self.sim.instructions
        self.image_size = self.sim.image_size
        self.observation_dim = self.sim.observation_dim
        self.state_nbytes = self.bufs.row_bytes
        self._keep = torch.ones(self.bufs.row_bytes, dtype=torch.bool)
        if drop is not None:
            place = self.bufs.placements[drop]
            self._keep[place.offset : place.offset + place.spec.nbytes] = False

    def identity(self) -> str:
        return f"host-{self.sim.identity()}"

    def _mask(self, mask: np.ndarray | None) -> torch.Tensor | None:
        return None if mask is None else torch.from_numpy(np.asarray(mask, dtype=bool))

    def seed(self, seeds: np.ndarray, slots: np.ndarray | None = None) -> None:
        s = self.sim.state
        idx = slice(None) if slots is None else torch.from_numpy(np.asarray(slots, dtype=np.int64))
        s.key[idx] = torch.from_numpy(np.asarray(seeds, dtype=np.int64))
        s.counter[idx] = 0

    def reset(self, mask: np.ndarray | None = None) -> None:
        self.sim.reset(self._mask(mask))

    def run_ticks(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = self.bufs.num_slots
        dense, sparse = torch.zeros(n), torch.zeros(n)
        self.sim.run_ticks(torch.from_numpy(actions), dense, sparse)
        return dense.numpy(), sparse.numpy()

    def set_instruction(self, index: int, slots: np.ndarray | None = None) -> None:
        idx = slice(None) if slots is None else torch.from_numpy(np.asarray(slots, dtype=np.int64))
        self.sim.instruction[idx] = index

    def success(self) -> np.ndarray:
        return self.sim.success.numpy().copy()

    def instruction(self) -> np.ndarray:
        return self.sim.instruction.numpy().copy()

    def render(self) -> np.ndarray:
        out = torch.empty(self.bufs.num_slots, 1, self.image_size, self.image_size, 3, dtype=torch.uint8)
        self.sim.render(out)
        return out.numpy()

    def proprio(self) -> np.ndarray:
        out = torch.empty(self.bufs.num_slots, 2)
        self.sim.proprio(out)
        return out.numpy()

    def observation(self) -> np.ndarray:
        out = torch.empty(self.bufs.num_slots, self.observation_dim)
        self.sim.observation(out)
        return out.numpy()

    def get_state(self, slots: np.ndarray | None = None) -> np.ndarray:
        rows = self.bufs.slot_arena if slots is None else self.bufs.slot_arena[torch.as_tensor(slots)]
        return (rows * self._keep).numpy().copy()

    def set_state(self, slots: np.ndarray | None, states: np.ndarray) -> None:
        rows = torch.from_numpy(np.asarray(states, dtype=np.uint8)).reshape(-1, self.state_nbytes)
        idx = torch.arange(self.bufs.num_slots) if slots is None else torch.as_tensor(np.asarray(slots))
        if len(idx) != len(rows) and len(rows) != 1:
            raise ValueError(f"set_state: {len(rows)} rows for {len(idx)} slots")
        kept = torch.where(self._keep, rows, self.bufs.slot_arena[idx])
        self.bufs.slot_arena[idx] = kept
