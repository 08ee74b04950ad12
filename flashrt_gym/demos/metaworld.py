"""Scripted-expert demonstrations of Meta-World tasks, in the shards of :mod:`flashrt_gym.demos`.

:func:`collect_batch` runs :class:`~flashrt_gym.sims.MetaWorld` (slot ``i`` of a batch runs task
``i % len(tasks)``) with Meta-World's scripted policies plus Gaussian action noise and returns its
successful episodes in the pipeline's shard layout (``image`` seen before acting, ``proprio``,
``action`` executed, ``instruction``, ``episode``, ``tick``), so that
:class:`flashrt_gym.demos.tabletop.Windows` and ``scripts/pretrain_policy.py`` train on them as they are.
Every episode starts from the demonstrations' seed block (:func:`flashrt_gym.splits.demo_seed`),
never from a training, validation or test start.

:func:`save_shard` writes :data:`flashrt_gym.demos.FORMAT` with the task's identity as metadata
(``simulator``, ``task``: the :class:`MetaWorldTask`, ``identity``: the simulator's
:meth:`~flashrt_gym.sims.MetaWorld.identity`: Meta-World's and MuJoCo's versions, the tasks, camera
and state layout); :func:`load_shards` reads a folder of them and refuses shards of another task
set, camera or Meta-World build. :func:`evaluate` is the closed-loop success of a policy per task.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save as save_bytes

from flashrt.runtime import atomic_write
from flashrt_gym.demos import FORMAT
from flashrt_gym.env import FlashRTVectorEnv
from flashrt_gym.evaluation import base_policy
from flashrt_gym.sims import metaworld
from flashrt_gym.sims.metaworld_cpu import MetaWorld
from flashrt_gym.sims.metaworld_tasks import INSTRUCTIONS, task_names
from flashrt_gym.sims.processes import Processes
from flashrt_gym.splits import demo_seed

SIMULATOR = "metaworld"
"""The ``simulator`` metadata of Meta-World shards."""


@dataclass(frozen=True)
class MetaWorldTask:
    """The Meta-World setting demonstrations are collected on and a policy is cloned for.

    Args:
        tasks: Meta-World task names (``"MT10"`` or a list; :func:`task_names`), the instruction indices.
        image_size: the camera's square resolution (the policy's ``image_size``).
        camera: :class:`~flashrt_gym.sims.MetaWorld`'s ``camera``.

    Raises:
        ValueError: an unknown task name.
    """

    tasks: tuple[str, ...] = task_names("MT10")
    image_size: int = 64
    camera: str = "overview"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", task_names(self.tasks))

    @property
    def instructions(self) -> list[str]:
        """The tasks' instructions, in their index order (the shards' ``instruction`` values)."""
        return [INSTRUCTIONS[n] for n in self.tasks]

    @property
    def vocabulary(self) -> list[str]:
        """Every word of the instructions (sorted): the policy's word vocabulary."""
        return sorted({w for text in self.instructions for w in text.split()})

    def simulator(self, num_slots: int, threads: int = 1, processes: int = 1) -> MetaWorld | Processes:
        """A simulator of this setting.

        Args:
            num_slots: parallel episodes (slot ``i`` runs task ``i % len(tasks)``).
            threads: CPU threads that step the slots (of each process).
            processes: worker processes that split the slots (:class:`~flashrt_gym.sims.processes.Processes`).

        Returns:
            A fresh :class:`~flashrt_gym.sims.MetaWorld`, or with ``processes`` > 1 its shards.
        """
        return metaworld(
            num_slots, self.tasks, threads=threads, image_size=self.image_size, camera=self.camera, processes=processes
        )

    def to_json(self) -> str:
        """The setting as JSON (the shards' ``task`` metadata; ``MetaWorldTask(**json.loads(text))`` reads it)."""
        return json.dumps({**asdict(self), "tasks": list(self.tasks)}, sort_keys=True)


@functools.cache
def identity(task: MetaWorldTask) -> str:
    """The identity of ``task``'s simulator as it builds in this process, worked out once (a build
    discovers each task's state layout, seconds for MT10).

    Args:
        task: the setting.

    Returns:
        :meth:`flashrt_gym.sims.MetaWorld.identity` of its simulator.
    """
    return task.simulator(1).identity()


def collect_batch(
    task: MetaWorldTask,
    batch: int,
    *,
    num_slots: int = 160,
    noise_std: float = 0.2,
    max_ticks: int = 200,
    seed: int = 0,
    threads: int = 1,
) -> dict[str, torch.Tensor]:
    """The successful episodes of batch ``batch`` of a collection.

    Slot ``i`` runs task ``i % len(task.tasks)`` from :func:`flashrt_gym.splits.demo_seed`
    ``(seed, batch * num_slots + i)`` (its episode id), acting with the task's scripted policy plus
    Gaussian noise of ``noise_std`` (clipped to [-1, 1]; drawn from the batch's own generator, so
    batches can be collected in any order or in parallel), for at most ``max_ticks`` ticks.

    Args:
        task: the Meta-World setting.
        batch: the batch's index in the collection (>= 0).
        num_slots: episodes simulated together.
        noise_std: the action noise's standard deviation (>= 0).
        max_ticks: the episodes' tick limit (within Meta-World's ``max_path_length``).
        seed: the collection's seed (:func:`flashrt_gym.splits.demo_seed`).
        threads: CPU threads that step the slots.

    Returns:
        The kept episodes' ticks, concatenated in the layout of :mod:`flashrt_gym.demos`.

    Raises:
        ValueError: bad counts or noise, or ``max_ticks`` past Meta-World's episode limit.
    """
    if batch < 0 or num_slots < 1 or max_ticks < 1:
        raise ValueError(f"batch must be >= 0, num_slots and max_ticks >= 1; got {batch}, {num_slots}, {max_ticks}")
    if noise_std < 0:
        raise ValueError(f"noise_std must be >= 0, got {noise_std}")
    sim = task.simulator(num_slots, threads)
    limit = sim.envs[0].max_path_length
    if max_ticks > limit:
        raise ValueError(f"max_ticks must be <= Meta-World's max_path_length ({limit}), got {max_ticks}")
    g = np.random.default_rng([seed, batch])
    sim.seed(np.arange(num_slots) + demo_seed(seed, batch * num_slots))
    sim.reset()
    frames = []
    with warnings.catch_warnings():  # Meta-World's policies warn that their gains exceed the action box
        warnings.filterwarnings("ignore", "Constant", UserWarning)
        for _ in range(max_ticks):
            alive = ~sim.success()
            if not alive.any():
                break
            action = np.clip(sim.expert() + g.normal(size=(num_slots, sim.action_dim)) * noise_std, -1, 1)
            action = action.astype(np.float32)
            frames.append((sim.render()[:, 0], sim.proprio(), action, alive))
            sim.run_ticks(action[:, None])
    image, proprio, action, alive = (torch.from_numpy(np.stack(x, 1)) for x in zip(*frames, strict=True))
    keep = torch.from_numpy(sim.success()).nonzero().flatten()
    lengths, sel = alive[keep].sum(1), alive[keep]
    ids = keep + batch * num_slots
    return {
        "image": image[keep][sel],
        "proprio": proprio[keep][sel],
        "action": action[keep][sel],
        "instruction": torch.from_numpy(sim.instruction())[keep].repeat_interleave(lengths),
        "episode": ids.repeat_interleave(lengths),
        "tick": torch.cat([torch.arange(n) for n in lengths.tolist()]) if len(keep) else torch.zeros(0).long(),
    }


def save_shard(
    shard: dict[str, torch.Tensor], path: str | os.PathLike, task: MetaWorldTask, collection: dict | None = None
) -> Path:
    """Write a shard of :func:`collect_batch` atomically, in :data:`flashrt_gym.demos.FORMAT`.

    Args:
        shard: the episodes' ticks.
        path: the ``.safetensors`` file.
        task: the setting they were collected on (its identity is written beside it).
        collection: how they were collected (noise, tick limit, seed), kept as metadata.

    Returns:
        The written path.
    """
    meta = {
        "format": FORMAT,
        "simulator": SIMULATOR,
        "task": task.to_json(),
        "identity": identity(task),
        "instructions": json.dumps(task.instructions),
        "collection": json.dumps(collection or {}, sort_keys=True),
    }
    tensors = {k: v.contiguous() for k, v in shard.items()}
    return atomic_write(path, lambda f: f.write(save_bytes(tensors, metadata=meta)))


def load_shards(folder: str | os.PathLike) -> tuple[dict[str, torch.Tensor], MetaWorldTask]:
    """Concatenate the Meta-World shards in ``folder``.

    Args:
        folder: a folder of ``*.safetensors`` shards of :func:`save_shard`.

    Returns:
        The ticks of all shards and the setting they were collected on.

    Raises:
        FileNotFoundError: no shards.
        ValueError: a shard that is not a Meta-World demonstration, shards of different settings,
            or shards whose simulator identity differs from the one the setting builds here
            (another Meta-World or MuJoCo version, camera or state layout).
    """
    paths = sorted(Path(folder).glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(
            f"no demonstration shards (*.safetensors) in {folder}; run scripts/metaworld_pretrain.py"
        )
    parts, first = [], None
    for p in paths:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT or meta.get("simulator") != SIMULATOR:
                raise ValueError(
                    f"{p} holds no Meta-World demonstrations ({FORMAT} shards of simulator {SIMULATOR!r}); collect "
                    "them with scripts/metaworld_pretrain.py --collect-only"
                )
            if first is None:
                first = meta
            elif (meta["task"], meta["identity"]) != (first["task"], first["identity"]):
                raise ValueError(
                    f"{p} was collected on another Meta-World setting than {paths[0]} ({meta['task']} vs "
                    f"{first['task']}); keep one setting's shards per folder"
                )
            parts.append({k: f.get_tensor(k) for k in f.keys()})
    task = MetaWorldTask(**json.loads(first["task"]))
    here = identity(task)
    if first["identity"] != here:
        raise ValueError(
            f"the shards in {folder} were collected on a Meta-World simulator of identity {first['identity']!r}, "
            f"and it builds here as {here!r}: collect them again with this Meta-World, MuJoCo and camera"
        )
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}, task


def evaluate(
    weights: str | os.PathLike,
    task: MetaWorldTask,
    *,
    episodes: int,
    seed: int,
    n_action_steps: int,
    max_episode_steps: int,
    device: str = "cpu",
    threads: int = 1,
    processes: int = 1,
) -> dict[str, float]:
    """Success rate per task of the unsteered policy in ``weights`` (its own noise, no correction).

    ``episodes`` episodes of every task at once, slot ``i`` of task ``i % len(task.tasks)`` from
    the start of seed ``seed + i`` (pass :data:`flashrt_gym.splits.VALIDATION_SEED` to choose,
    :data:`~flashrt_gym.splits.TEST_SEED` to report).

    Args:
        weights: a policy folder of Meta-World's shapes.
        task: the setting (tasks, camera).
        episodes: episodes per task.
        seed: the first slot's seed.
        n_action_steps: ticks a chunk.
        max_episode_steps: chunks an episode (times ``n_action_steps`` within Meta-World's 500 ticks).
        device: the policy's device.
        threads: CPU threads that step the physics (of each process).
        processes: worker processes that split the slots (at most the slots; Meta-World's Python
            holds the GIL, so processes fill the cores where threads do not).

    Returns:
        ``{task name: success rate}`` and ``"mean"``, their average.
    """
    env = FlashRTVectorEnv(
        episodes * len(task.tasks),
        action_mode="residual",
        autoreset=False,
        simulator=functools.partial(task.simulator, threads=threads, processes=processes),
        weights=weights,
        device=device,
        n_action_steps=n_action_steps,
        max_episode_steps=max_episode_steps,
    )
    counts = base_policy(env, seed).by_instruction  # the instruction index of a slot is its task's
    env.close()
    rates = {name: counts[i][0] / counts[i][1] for i, name in enumerate(task.tasks)}
    return {**rates, "mean": float(np.mean(list(rates.values())))}


def first_episodes_per_task(shard: dict[str, torch.Tensor], room: Sequence[int]) -> dict[str, torch.Tensor]:
    """The ticks of the first episodes of each task in a shard, up to a quota per task.

    Args:
        shard: ticks of whole episodes (:func:`collect_batch`).
        room: episodes to keep of task ``t`` (its instruction index), per task.

    Returns:
        The kept episodes' ticks, in the shard's order.
    """
    starts = shard["tick"] == 0
    instr = shard["instruction"][starts]
    rank = torch.zeros(len(instr), dtype=torch.int64)  # each episode's place among its task's in the shard
    for t in instr.unique().tolist():
        rank[instr == t] = torch.arange(int((instr == t).sum()))
    keep = (rank < torch.as_tensor(room, dtype=torch.int64)[instr])[starts.cumsum(0) - 1]
    return {k: v[keep] for k, v in shard.items()}


def episodes_per_task(shard: dict[str, torch.Tensor], num_tasks: int) -> torch.Tensor:
    """How many episodes of each task a shard holds.

    Args:
        shard: ticks of whole episodes.
        num_tasks: the setting's task count.

    Returns:
        (num_tasks,) int64 episode counts, by instruction index.
    """
    return torch.bincount(shard["instruction"][shard["tick"] == 0], minlength=num_tasks)
