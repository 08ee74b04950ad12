"""The evaluation's per-instruction figures (a task each on Meta-World's MT10): what each
instruction's episodes gave, counted as an independent run of the same starts counts them."""

from collections import Counter

import numpy as np

from flashrt_gym.env import FlashRTVectorEnv
from flashrt_gym.evaluation import evaluate
from flashrt_gym.splits import eval_seed


def counted_by_instruction(env: FlashRTVectorEnv, seed: int, shift: int = 0) -> tuple[Counter, Counter]:
    """Successes and episodes per instruction text of one episode a slot from ``seed``'s starts,
    the unsteered policy; ``shift`` credits each slot to another slot's instruction (the mutation)."""
    _, info = env.reset(seed=seed)
    texts = [env.instructions[i] for i in np.roll(info["instruction"], shift)]
    zeros = np.zeros((env.num_envs, *env.single_action_space.shape), np.float32)
    alive, won = np.ones(env.num_envs, bool), np.zeros(env.num_envs, bool)
    while alive.any():
        _, _, term, trunc, _ = env.step(zeros)
        won |= term & alive
        alive &= ~(term | trunc)
    return Counter(t for t, w in zip(texts, won, strict=True) if w), Counter(texts)


def test_each_instructions_successes_and_episodes_are_counted_as_its_episodes_gave_them():
    """Two batches of 16 validation episodes: per instruction, ``evaluate``'s successes and
    episodes are those of an independent run of the same starts, they add up to its totals, and
    each rate is their ratio. Mutation: successes credited to the neighbouring slot's instruction
    disagree."""
    env = FlashRTVectorEnv(16, device="cpu", action_mode="residual", autoreset=False, max_episode_steps=12)
    zeros = np.zeros((16, *env.single_action_space.shape), np.float32)
    res = evaluate(env, lambda _: zeros, "validation", 32)
    first = eval_seed("validation", 32)

    def independent(shift: int = 0) -> dict[str, tuple[int, int]]:
        won, begun = Counter(), Counter()
        for start in (first, first + 16):
            w, b = counted_by_instruction(env, start, shift)
            won, begun = won + w, begun + b
        return {t: (won[t], begun[t]) for t in env.instructions if begun[t]}

    assert res.by_instruction == independent()
    assert sum(n for _, n in res.by_instruction.values()) == 32
    assert sum(w for w, _ in res.by_instruction.values()) == round(res.success * 32) > 0
    assert len(res.by_instruction) > 1 and list(res.by_instruction) == [
        t for t in env.instructions if t in res.by_instruction
    ]
    assert res.success_by_instruction() == {t: w / n for t, (w, n) in res.by_instruction.items()}
    assert independent(shift=1) != res.by_instruction
