"""The unit one env step captures: the tabletop task and the VLA policy over one BufferSet.

An :class:`Engine` composes :class:`~flashrt_gym.tasks.Tabletop` and
:class:`~flashrt.policies.PolicyPipeline` into one closed set of static buffers (``sim.*``, ``policy.*``
and the step outputs ``env.*``) and defines two programs over it:

- :meth:`Engine.start` (the cold path, every slot): draw episodes, look up and encode the
  instructions, render, encode the first observation;
- :meth:`Engine.step` (one action chunk, capturable): denoise the chunk from ``policy.noise``
  (written by the agent, or drawn from the per-slot RNG), execute ``n_action_steps`` actions in
  the simulator summing rewards, render, encode the next observation, set the episode flags.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from flashrt.policies import FlowPolicy, PolicyPipeline, deployment_digest, policy_specs, tokenizer_for
from flashrt.runtime import BufferSet, BufferSpec, Graph, slot
from flashrt_gym.tasks import Tabletop

ENV_SPECS = [
    slot("env.reward_dense", ()),
    slot("env.reward_sparse", ()),
    slot("env.steps", (), torch.int64),  # env steps (chunks) into the episode
    slot("env.terminated", (), torch.bool),
    slot("env.truncated", (), torch.bool),
]


class Engine:
    """Task + policy over one buffer set for ``num_slots`` parallel episodes.

    Args:
        task: the simulator.
        model: the policy weights, on ``device``.
        weights_id: identifies the weights (a file hash) for the deployment digest.
        num_slots: parallel episodes.
        n_action_steps: actions of each denoised chunk executed per step (<= horizon).
        max_episode_steps: steps (chunks) after which an episode is truncated.
        backend: graph backend (``"auto"``: CUDA graphs on a GPU, eager on the CPU).
        extra_specs: more buffers for the owner (an env's inputs and outputs) in the same set.
    """

    def __init__(
        self,
        task: Tabletop,
        model: FlowPolicy,
        weights_id: str,
        num_slots: int,
        *,
        n_action_steps: int = 4,
        max_episode_steps: int = 40,
        backend: str = "auto",
        extra_specs: Sequence[BufferSpec] = (),
    ) -> None:
        c = model.cfg
        if not 1 <= n_action_steps <= c.horizon:
            raise ValueError(f"n_action_steps must be in [1, horizon={c.horizon}], got {n_action_steps}")
        if max_episode_steps < 1:
            raise ValueError(f"max_episode_steps must be >= 1, got {max_episode_steps}")
        if (c.num_cameras, c.image_size, c.action_dim, c.proprio_dim) != (1, task.cfg.image_size, 2, 2):
            raise ValueError(
                "the policy does not fit the task: it needs 1 camera, image_size "
                f"{task.cfg.image_size}, action_dim 2 and proprio_dim 2; got {c.num_cameras}, {c.image_size}, "
                f"{c.action_dim}, {c.proprio_dim}"
            )
        self.task, self.model = task, model
        self.n_action_steps, self.max_episode_steps = n_action_steps, max_episode_steps
        device = next(model.parameters()).device
        task_id = repr(task.cfg) + f"|n_action_steps={n_action_steps}|max_episode_steps={max_episode_steps}"
        digest = deployment_digest(model, weights_id + "|" + task_id)
        specs = [*task.specs(), *policy_specs(model), *ENV_SPECS, *extra_specs]
        self.bufs = BufferSet(specs, num_slots, device, deployment=digest)
        self.policy = PolicyPipeline(model, self.bufs, backend=backend)
        ids, mask = tokenizer_for(c).encode(task.instructions)
        self.text_ids, self.text_mask = ids.to(device), mask.to(device)
        self.graph = Graph("engine.step", backend=backend).bind(self.bufs)

    @property
    def num_slots(self) -> int:
        return self.bufs.num_slots

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.bufs[name]

    # -- programs ------------------------------------------------------------------------------
    def observe(self) -> None:
        """Render every slot into the policy's image input and encode it as the newest frame."""
        self.task.render(self.bufs, out=self.bufs["policy.image"][:, 0])
        self.bufs["policy.proprio"].copy_(self.task.proprio(self.bufs))
        self.policy.encode_observation()

    def start(self, seeds: Sequence[int] | torch.Tensor, instructions: torch.Tensor | None = None) -> None:
        """Cold start of a new episode in every slot (simulator reset + render + instruction
        prefill + first encode). ``seeds`` (num_slots,) fix each slot's draws; ``instructions``
        (num_slots,) forces instruction indices (-1 keeps the draw)."""
        b = self.bufs
        seeds = torch.as_tensor(seeds, dtype=torch.int64, device=b.device)
        if seeds.shape != (self.num_slots,):
            raise ValueError(f"start needs one seed per slot: shape ({self.num_slots},), got {tuple(seeds.shape)}")
        self.task.seed(b, seeds)
        self.task.reset(b, instruction=None if instructions is None else instructions.to(b.device))
        b["policy.rng_key"].copy_(seeds * 2654435761 + 1)
        b["policy.rng_counter"].zero_()
        self.set_text(b["sim.instruction"])
        self.policy.begin_episode()
        for name in ("env.reward_dense", "env.reward_sparse", "env.steps", "env.terminated", "env.truncated"):
            b[name].zero_()
        self.observe()

    def set_text(self, instruction: torch.Tensor) -> None:
        """Point every slot's instruction tokens at task instruction indices and re-encode them."""
        self.bufs["policy.text_ids"].copy_(self.text_ids[instruction])
        self.bufs["policy.text_mask"].copy_(self.text_mask[instruction])
        self.policy.encode_instruction()

    def step(self, draw_noise: bool = False, residual: torch.Tensor | None = None) -> None:
        """One action chunk for every slot (capturable). With ``draw_noise`` the base policy
        draws its own noise from the per-slot RNG; otherwise ``policy.noise`` is the input.
        ``residual`` (slots, horizon, action_dim) is added to the denoised chunk (then clipped)."""
        b, task = self.bufs, self.task
        if draw_noise:
            self.policy.draw_noise()
        self.policy.denoise()
        actions = b["policy.actions"]
        if residual is not None:
            actions = (actions + residual).clamp(-1.0, 1.0)
        task.run_ticks(b, actions[:, : self.n_action_steps], out=(b["env.reward_dense"], b["env.reward_sparse"]))
        b["env.steps"].add_(1)
        b["env.terminated"].copy_(b["sim.success"])
        torch.bitwise_and(b["env.steps"] >= self.max_episode_steps, ~b["sim.success"], out=b["env.truncated"])
        self.observe()

    def capture(self, draw_noise: bool = False) -> Callable[[], None]:
        """Record :meth:`step` as a graph variant and return a function that replays it."""
        key = (self.num_slots, "draw_noise" if draw_noise else "agent_noise")
        if key not in self.graph:
            self.graph.capture(key, lambda: self.step(draw_noise))
        return lambda: self.graph.replay(key)

    @torch.no_grad()
    def success_rate(self, seeds: Sequence[int] | torch.Tensor) -> float:
        """Closed-loop success of the unsteered policy (its own noise) from these starts."""
        self.start(seeds)
        replay = self.capture(draw_noise=True)
        for _ in range(self.max_episode_steps):
            replay()
        return self.bufs["sim.success"].float().mean().item()
