"""The env's machine: one simulator and one policy over one buffer set, the programs an env step
runs, and the one owner of their capture and replay.

An :class:`Engine` places the simulator's state (``sim.*``), the policy's (``policy.*``), the
episode counters (``env.episode.*``) and the step's inputs and outputs (``env.in.*``,
``env.out.*``, ``env.obs.*``, ``env.final.*``) in one :class:`flashrt.runtime.BufferSet`, and
defines its programs over them:

- :meth:`Engine.start` and :meth:`Engine.restart`: new episodes (simulator draw, instruction
  keys/values from the :class:`~flashrt.policies.InstructionTable`, the first frame encoded);
- the step (captured once as a guarded graph variant, replayed by :meth:`Engine.launch`): the
  agent's action -> the policy's chunk -> ``n_action_steps`` simulator ticks -> episode flags ->
  (with autoreset) the finished slots' final observations and their next episodes -> render ->
  encode -> observations. A finished slot's next episode is drawn inside the step, from its own
  RNG stream, and its first frame is encoded in the step's one batched encode: an autoreset costs
  the step no extra encode and no host work, whenever it happens. The plan is chosen once: one
  captured program (an in-graph simulator), two graphs around the host's ticks (an external
  one, through its :class:`~flashrt_gym.engine.host_link.Mirror`), or two graphs around the
  simulator's own physics graph (a :class:`~flashrt_gym.simulator.SplitTicks` one).

Capsule verbs (:meth:`Engine.snapshot`, :meth:`Engine.restore`, :meth:`Engine.fork`) are byte
copies of the buffer set; a capsule from elsewhere is validated (its index-valued and flag
buffers) before its first byte is copied.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flashrt import runtime
from flashrt.kernels import rng
from flashrt.policies import FlowPolicy, InstructionTable, PolicyConfig, PolicyPipeline, deployment_digest, policy_specs
from flashrt.runtime import BufferSpec, Capsule, Graph, scratch, slot
from flashrt.runtime.views import bind_views
from flashrt_gym.engine.host_link import NO_HOST_LINK, HostLink, Mirror
from flashrt_gym.env_config import EnvConfig
from flashrt_gym.simulator import ExternalSimulator, Simulator, check_simulator, is_external, splits_ticks


@dataclass(frozen=True)
class EpisodeState:
    """Per-slot episode state (``env.episode.*``): env steps (chunks) into the episode."""

    steps: torch.Tensor


@dataclass(frozen=True)
class StepInputs:
    """What a step reads (``env.in.*``, scratch): the agent's actions as given, the guard's flag
    (every action in bounds), the chunk the simulator executes, and room for the reward the
    step does not return."""

    action: torch.Tensor
    action_ok: torch.Tensor
    chunk: torch.Tensor
    other_reward: torch.Tensor


@dataclass(frozen=True)
class StepOutputs:
    """What a step returns (``env.out.*``, scratch), declared back to back with the observations
    so that one copy reads everything out."""

    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    done: torch.Tensor | None = None


@dataclass(frozen=True)
class Observations:
    """The observation forms a step writes (``env.obs.*``, and ``env.final.*`` for the last
    observation of the episodes that ended in the step); forms not asked for are None."""

    state: torch.Tensor | None = None
    features: torch.Tensor | None = None
    rgb: torch.Tensor | None = None


class Engine:
    """A simulator and a policy over one buffer set of ``num_slots`` slots, and their programs.

    Args:
        sim: the simulator (unbound: the engine binds it to its buffer set).
        model: the policy weights, on the device the engine runs on.
        weights_id: identifies the weights (a file hash) for the deployment digest.
        num_slots: parallel episodes.
        cfg: the env's step options (they shape the buffers and the captured programs).
        autoreset: finished slots start their next episode inside the same step.
        backend: graph backend (``"auto"``: CUDA graphs on a GPU, eager on the CPU).
    """

    def __init__(
        self,
        sim: Simulator | ExternalSimulator,
        model: FlowPolicy,
        weights_id: str,
        num_slots: int,
        cfg: EnvConfig,
        *,
        autoreset: bool = True,
        backend: runtime.graphs.Backend = "auto",
    ) -> None:
        c = model.cfg
        check_simulator(sim)
        self.mirror = Mirror(sim) if is_external(sim) else None
        """The external simulator's device mirror, or None for an in-graph simulator."""
        self.link: HostLink = self.mirror or NO_HOST_LINK
        """Where each verb hands off to the simulator's host side (nothing for an in-graph one)."""
        sim = self.mirror or sim
        _check_fit(sim, c, cfg)
        self.sim, self.cfg, self.autoreset = sim, cfg, autoreset
        device = next(model.parameters()).device
        identity = f"{sim.identity()}|n_action_steps={cfg.n_action_steps}|max_episode_steps={cfg.max_episode_steps}"
        digest = deployment_digest(model, weights_id + identity)
        episode = [slot("env.episode.steps", (), torch.int64)]
        pending = self.mirror.scratch_specs(num_slots) if self.mirror else []
        specs = [*sim.specs(), *policy_specs(model), *episode, *pending, *self._io_specs(c, num_slots)]
        self.bufs = runtime.BufferSet(specs, num_slots, device, deployment=digest)
        sim.bind(self.bufs)
        self.policy = PolicyPipeline(model, self.bufs)
        self.instructions = InstructionTable(model, sim.instructions)
        self.episode = bind_views(EpisodeState, self.bufs, "env.episode")
        self.inputs = bind_views(StepInputs, self.bufs, "env.in")
        self.outputs = bind_views(StepOutputs, self.bufs, "env.out")
        self.obs = bind_views(Observations, self.bufs, "env.obs")
        self.final = bind_views(Observations, self.bufs, "env.final")
        first = self.bufs.names("scratch").index("env.out.reward")
        names = self.bufs.names("scratch")[first:]  # back to back: one copy reads them out
        lo = self.bufs.placements[names[0]].offset
        hi = max(self.bufs.placements[n].offset + self.bufs.placements[n].spec.nbytes for n in names)
        self.output_span = self.bufs.scratch_arena[lo:hi]
        """The bytes of every output and observation a step writes, one span of the scratch arena."""
        self.output_layout = {n: (self.bufs.placements[n].offset - lo, self.bufs.placements[n].spec) for n in names}
        """Where each output lies in :attr:`output_span`: byte offset and spec."""
        self.graph = Graph("env.step", backend=backend, max_variants=2).bind(self.bufs)
        # the step plan, chosen once: one captured program, two around the host's ticks, or two
        # around the simulator's own physics graph
        if self.mirror is not None:
            self._launch, self._guarded = functools.partial(self._launch_with_host, self.mirror), "act"
        elif splits_ticks(sim):
            self._launch, self._guarded = self._launch_split, "act"
        else:
            self._launch, self._guarded = self._launch_in_graph, "step"

    def _io_specs(self, c: PolicyConfig, n: int) -> list[BufferSpec]:
        """The step's scratch buffers, outputs last and back to back."""
        cfg = self.cfg
        agent_dim = c.action_dim if cfg.repeat_over_horizon else c.horizon * c.action_dim
        shapes = {
            "state": ((self.sim.observation_dim,), torch.float32),
            "features": ((c.width + self.sim.proprio_dim,), torch.float32),
            "rgb": ((c.image_size, c.image_size, 3), torch.uint8),
        }
        prefixes = ("obs", "final") if self.autoreset else ("obs",)
        return [
            scratch("env.in.action", (n, agent_dim)),
            scratch("env.in.action_ok", (1,), torch.bool),
            scratch("env.in.chunk", (n, cfg.n_action_steps, self.sim.action_dim)),
            scratch("env.in.other_reward", (n,)),
            scratch("env.out.reward", (n,)),
            scratch("env.out.terminated", (n,), torch.bool),
            scratch("env.out.truncated", (n,), torch.bool),
            *([scratch("env.out.done", (n,), torch.bool)] if self.autoreset else []),
            *(
                scratch(f"env.{p}.{form}", (n, *shapes[form][0]), shapes[form][1])
                for p in prefixes
                for form in cfg.obs_forms
            ),
        ]

    @property
    def num_slots(self) -> int:
        return self.bufs.num_slots

    @property
    def device(self) -> torch.device:
        return self.bufs.device

    def close(self) -> None:
        """Release the simulator's own resources where it has a ``close()`` (the worker processes
        of :class:`~flashrt_gym.sims.processes.Processes`): the external one behind the mirror,
        or the in-graph one."""
        close = getattr(self.sim if self.mirror is None else self.mirror.host, "close", None)
        if callable(close):
            close()

    # -- programs (plain callables over the buffers) ------------------------------------------
    def _inputs(self, image: torch.Tensor, proprio: torch.Tensor) -> None:
        """The simulator's camera images and proprioception into the policy's inputs (its state
        input keeps zeros beyond the simulator's ``proprio_dim``)."""
        self.sim.render(out=image)
        self.sim.proprio(out=proprio[:, : self.sim.proprio_dim])

    def _observe(self) -> None:
        """Render every slot and encode it as its newest frame."""
        p = self.policy.state
        self._inputs(p.image, p.proprio)
        self.policy.encode_observation()

    def _write(self, out: Observations) -> None:
        """The observation forms of the current state into ``out``."""
        p = self.policy.state
        if out.state is not None:
            self.sim.observation(out=out.state)
        if out.features is not None:
            out.features[:, : p.features.shape[1]].copy_(p.features)
            out.features[:, p.features.shape[1] :].copy_(p.proprio[:, : self.sim.proprio_dim])
        if out.rgb is not None:
            out.rgb.copy_(p.image[:, 0])

    def _restart(self, mask: torch.Tensor | None) -> None:
        """Draw the next episode of every slot in ``mask`` (all if None): simulator, frame
        history, instruction, episode counters (not the encode: the caller observes)."""
        self.sim.reset(mask)
        self.policy.begin_episode(mask)
        self.policy.set_text(self.instructions, self.sim.instruction, mask)
        if mask is None:
            self.episode.steps.zero_()
        else:
            self.episode.steps.masked_fill_(mask, 0)

    def _guard(self) -> torch.Tensor:
        """The step's guard: whether every action lies in [-1, 1] (NaN fails it)."""
        ok = self.inputs.action_ok
        torch.le(torch.linalg.vector_norm(self.inputs.action, float("inf")), 1.0 + 1e-6, out=ok[0])
        return ok

    def _act(self) -> None:
        """The agent's action -> the policy's chunk -> ``env.in.chunk``, what the simulator runs."""
        cfg, sim, p = self.cfg, self.sim, self.policy.state
        n, horizon, dim = p.noise.shape
        a = self.inputs.action.view(n, -1, dim).expand(n, horizon, dim)
        if cfg.action_mode == "noise":
            torch.mul(a, cfg.noise_bound, out=p.noise)
            self.policy.denoise()
            chunk = p.actions
        else:
            self.policy.draw_noise()
            self.policy.denoise()
            chunk = (p.actions + a * cfg.residual_scale).clamp(-1.0, 1.0)
        self.inputs.chunk.copy_(chunk[:, : cfg.n_action_steps, : sim.action_dim])

    def _rewards(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the simulator's (dense, sparse) rewards go: the returned one into ``env.out``."""
        out, other = self.outputs.reward, self.inputs.other_reward
        return (out, other) if self.cfg.reward_mode == "dense" else (other, out)

    def _finish(self) -> None:
        """After the ticks: episode counters and flags, the finished slots' final observations
        and next episodes (with autoreset), render and encode, observations."""
        cfg, sim, p, out = self.cfg, self.sim, self.policy.state, self.outputs
        self.episode.steps.add_(1)
        out.terminated.copy_(sim.success)
        torch.bitwise_and(self.episode.steps >= cfg.max_episode_steps, ~sim.success, out=out.truncated)
        if self.autoreset:
            torch.logical_or(out.terminated, out.truncated, out=out.done)
            final = self.final
            if final.features is not None or final.rgb is not None:  # the last frame, rendered
                self._inputs(p.image, p.proprio)
            if final.features is not None:
                width = p.features.shape[1]
                self.policy.features_of_next(p.image, p.proprio, out=final.features[:, :width])
                final.features[:, width:].copy_(p.proprio[:, : sim.proprio_dim])
            if final.state is not None:
                sim.observation(out=final.state)
            if final.rgb is not None:
                final.rgb.copy_(p.image[:, 0])
            self._restart(out.done)
        self._observe()
        self._write(self.obs)

    def program(self) -> None:
        """One action chunk for every slot, on the actions in ``env.in.action``: the step
        program :meth:`launch` captures and replays for an in-graph simulator (call it directly
        to run it eagerly, e.g. to count or profile its kernels)."""
        self._act()
        self.sim.run_ticks(self.inputs.chunk, *self._rewards())
        self._finish()

    # -- the verbs the env calls ---------------------------------------------------------------
    def start(self, seeds: torch.Tensor | None, mask: torch.Tensor | None = None) -> None:
        """New episodes in every slot of ``mask`` (all if None); the other slots are left byte
        for byte as they were. With int64 ``seeds`` (slots,) the slots' simulator and policy
        RNG streams first restart from their seeds (a cold start: the episode is a function of
        the seed alone); without, each slot draws the next episode of its stream. Then the
        episode is drawn, its instruction set, its first frame encoded, observations written."""
        saved = None if mask is None else self.bufs.slot_arena.clone()
        self.link.host_start(seeds, mask)
        if seeds is not None:
            self.sim.seed(seeds)
            p = self.policy.state
            p.rng_key.copy_(rng.slot_key(seeds))
            p.rng_counter.zero_()
        self._restart(None)
        self._observe()
        if saved is not None:  # every slot was encoded: put the others back
            runtime.masked_restore(self.bufs.slot_arena, saved, ~mask)
        self._write(self.obs)

    def launch(self, actions: torch.Tensor) -> None:
        """Copy ``actions`` in and run the step: one replay of the captured program (captured on
        first use); for an external simulator, the act graph, the host hand-off and the finish
        graph. The step runs only where every action is in bounds: :meth:`held` says whether it
        did."""
        self.inputs.action.copy_(actions, non_blocking=True)  # from a device tensor or page-locked staging
        self._launch()

    def _launch_in_graph(self) -> None:
        """An in-graph simulator's step: one replay of the captured program."""
        if "step" not in self.graph:
            self.graph.capture("step", self.program, guard=self._guard)
        self.graph.replay("step")

    def _act_and_begin_ticks(self) -> None:
        """A split step's first graph: the policy's chunk, then the simulator's ticks loaded."""
        self._act()
        self.sim.begin_ticks(self.inputs.chunk, *self._rewards())

    def _end_ticks_and_finish(self) -> None:
        """A split step's second graph: the ticks' results stored, then the rest of the step."""
        self.sim.end_ticks(*self._rewards())
        self._finish()

    def _launch_split(self) -> None:
        """A :class:`~flashrt_gym.simulator.SplitTicks` simulator's step: the act graph, the
        simulator's own physics graph, the finish graph, on one stream with no host wait. Both
        graphs are guarded by the same check of the same actions, so a refused step runs
        neither body (the physics then works on scratch alone)."""
        if "act" not in self.graph:
            self.graph.capture("act", self._act_and_begin_ticks, guard=self._guard)
            self.graph.capture("finish", self._end_ticks_and_finish, guard=self._guard)
        self.graph.replay("act")
        self.sim.physics(self.cfg.n_action_steps)
        self.graph.replay("finish")

    def _launch_with_host(self, mirror: Mirror) -> None:
        """An external simulator's step: the act graph, the host's ticks (through ``mirror``), the
        finish graph."""
        if "act" not in self.graph:
            self.graph.capture("act", self._act, guard=self._guard)
            self.graph.capture("finish", self._finish)
        self.graph.replay("act")
        if not self.held():
            return
        cfg = self.cfg
        rewards = mirror.host_step(self.inputs.chunk, self.episode.steps, cfg.max_episode_steps, self.autoreset)
        for dst, src in zip(self._rewards(), rewards, strict=True):
            dst.copy_(torch.from_numpy(np.ascontiguousarray(src, dtype=np.float32)))
        self.graph.replay("finish")

    def replay(self) -> None:
        """Replay the captured step on the actions already in ``env.in.action`` (no copies, no
        checks): how benchmarks time the step program alone. Call :meth:`launch` once first."""
        if self.mirror is not None:
            raise ValueError("an external simulator's step is two graphs and a host hand-off: time launch()")
        self._launch()  # the plan's replays (captured by the first launch)

    def held(self) -> bool:
        """Whether the last launch's actions were in bounds (its step ran); waits for the guard."""
        return self.graph.held(self._guarded)

    def read_outputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Copies of the step's outputs and observations, made by one copy of :attr:`output_span`
        queued behind the step (on ``device``, default the engine's)."""
        return self.unpack(self.output_span.to(device or self.device, copy=True))

    def unpack(self, span: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of each output in ``span``, a copy of :attr:`output_span`."""
        return {
            n: span[off : off + spec.nbytes].view(spec.dtype).view(spec.shape)
            for n, (off, spec) in self.output_layout.items()
        }

    def write_observation(self) -> None:
        """The current state's observation forms into ``env.obs.*`` (after a restore or fork)."""
        self._write(self.obs)

    def set_instruction(self, index: int, slots: torch.Tensor | None) -> None:
        """Give ``slots`` (all if None) the instruction ``index`` and its keys/values."""
        instr = self.sim.instruction
        self.link.host_set_instruction(index, slots)  # the host refuses a bad index before anything changes
        if slots is None:
            instr.fill_(index)
        else:
            instr[slots] = index
        self.policy.set_text(self.instructions, instr)
        self._write(self.obs)

    # -- capsules ------------------------------------------------------------------------------
    def snapshot(self, slots: Sequence[int] | None = None) -> Capsule:
        """The state of all slots (or of ``slots``) at this boundary."""
        return runtime.snapshot(self.bufs, slots)

    def check(self, capsule: Capsule) -> None:
        """Raise before anything is copied if ``capsule`` cannot be restored here: another
        deployment or layout, or values the simulator, the policy or the episode counters cannot
        run from (index-valued and flag buffers, NaN)."""
        runtime.capsule.check(self.bufs, capsule)
        views = {e.name: capsule.tensor(e.name) for e in capsule.descriptor.entries}
        try:
            self.sim.validate({k: v for k, v in views.items() if k.startswith("sim.")})
            self.policy.validate({k: v for k, v in views.items() if k.startswith("policy.")})
            steps = views.get("env.episode.steps")
            if steps is not None and steps.numel() and int(steps.min()) < 0:
                raise ValueError("env.episode.steps holds negative values")
        except (ValueError, KeyError) as e:
            raise runtime.CapsuleError(f"the capsule holds a state this env cannot run from: {e}") from e

    def restore(self, capsule: Capsule, slots: Sequence[int] | None = None, *, check: bool = True) -> None:
        """Restore ``capsule`` (all-or-nothing: :meth:`check` first, unless the caller made the
        capsule itself and skips it); observations written."""
        if check:
            self.check(capsule)
        self.link.host_restore(capsule.slots if slots is None else slots, capsule)  # the host first: it refuses
        runtime.restore(self.bufs, capsule, slots)
        self._write(self.obs)

    def rollback(self, capsule: Capsule) -> None:
        """Return to an earlier boundary of this same buffer set; observations written."""
        if capsule.origin != self.bufs.uid:
            runtime.rollback(self.bufs, capsule)  # refuses it, naming the mistake
        self.link.host_restore(capsule.slots, capsule)
        runtime.rollback(self.bufs, capsule)
        self._write(self.obs)

    def fork(self, src: int, dst: Sequence[int], reseed: bool = False) -> None:
        """Copy slot ``src``'s boundary into ``dst``; with ``reseed`` each destination gets its
        own random streams (policy noise, later episodes). Observations written."""
        runtime.fork(self.bufs, src, dst)
        self.link.host_fork(src, dst)
        if reseed:
            idx = torch.tensor(list(dst), device=self.device)
            for key in (self.policy.state.rng_key, self.sim.rng_key):
                key[idx] = rng.reseed(key[idx], idx)
            self.link.host_reseed(idx, dst)
        self._write(self.obs)


def _check_fit(sim: Simulator, c: PolicyConfig, cfg: EnvConfig) -> None:
    """Refuse a policy, simulator and step that cannot run together, naming the mismatch (the
    config's own values were checked when it was made)."""
    if not 1 <= cfg.n_action_steps <= c.horizon:
        raise ValueError(f"n_action_steps must be in [1, horizon={c.horizon}], got {cfg.n_action_steps}")
    wants = {
        "num_cameras": (c.num_cameras, sim.num_cameras, "equal"),
        "image_size": (c.image_size, sim.image_size, "equal"),
        "action_dim": (c.action_dim, sim.action_dim, "at least"),
        "proprio_dim": (c.proprio_dim, sim.proprio_dim, "at least"),
    }
    for name, (policy, simulator, rule) in wants.items():
        if policy < simulator or (rule == "equal" and policy != simulator):
            raise ValueError(
                f"the policy does not fit the simulator: its {name} is {policy}, the simulator's {simulator} "
                f"(the policy's must be {rule} the simulator's); use a policy made for this simulator"
            )
