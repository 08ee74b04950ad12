"""Instruction tokenizers, saved beside the weights: a word-level one for the built-in task, and
PaliGemma's SentencePiece tokenizer as LeRobot's pi0 / pi0.5 processors call it."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

PAD, UNK = "<pad>", "<unk>"
_WORD = re.compile(r"[a-z0-9]+")


class WordTokenizer:
    """Lower-cases, splits on non-alphanumerics, maps words to ids; id 0 is padding.

    Words outside the vocabulary are an error (this policy has no way to read them): the
    message lists them and the vocabulary.
    """

    def __init__(self, vocab: Sequence[str], max_len: int) -> None:
        words = [w for w in vocab if w not in (PAD, UNK)]
        self.itos = [PAD, UNK, *sorted(set(words))]
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        self.max_len = max_len

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, texts: Sequence[str] | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, max_len) int64 ids and (n, max_len) bool mask of real tokens."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        ids = torch.zeros(len(texts), self.max_len, dtype=torch.int64)
        for i, text in enumerate(texts):
            words = _WORD.findall(str(text).lower())
            unknown = sorted({w for w in words if w not in self.stoi})
            if unknown:
                raise ValueError(f"instruction {text!r} uses words {unknown} outside the vocabulary {self.itos[2:]}")
            if not words:
                raise ValueError("an instruction needs at least one word")
            if len(words) > self.max_len:
                raise ValueError(
                    f"instruction {text!r} has {len(words)} words; this policy reads at most {self.max_len}"
                )
            ids[i, : len(words)] = torch.tensor([self.stoi[w] for w in words])
        return ids, ids != 0

    def decode(self, ids: torch.Tensor) -> list[str]:
        return [" ".join(self.itos[i] for i in row if i != 0) for row in ids.tolist()]

    def to_json(self) -> str:
        return json.dumps({"vocab": self.itos, "max_len": self.max_len})

    @classmethod
    def from_json(cls, text: str) -> WordTokenizer:
        d = json.loads(text)
        return cls(d["vocab"], d["max_len"])


class PaliGemmaTokenizer:
    """PaliGemma's SentencePiece tokenizer with LeRobot's pi0 / pi0.5 prompts, read from a local
    ``tokenizer.model`` (no network).

    Encoding is what LeRobot's processors do before the model: pi0 appends a newline to the task
    (``Pi0NewLineProcessor``); pi0.5 (``state_prompt``) writes
    ``"Task: {task}, State: {bins};\\nAction: "`` with the normalised state discretised into 256 bins over [-1, 1]
    (``Pi05PrepareStateTokenizerProcessorStep``). Then, as transformers' Gemma tokenizer does with
    PaliGemma's ``add_bos_token``: BOS, the SentencePiece ids, truncation to ``max_len``, right
    padding with ``<pad>`` (id 0); the mask marks real tokens.
    """

    def __init__(self, model_proto: bytes, max_len: int, state_prompt: bool = False) -> None:
        try:
            import sentencepiece
        except ImportError as e:
            raise ImportError(
                "a pi0 / pi0.5 policy reads PaliGemma's SentencePiece tokenizer: pip install sentencepiece"
            ) from e
        self.sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        self.model_proto = model_proto
        self.max_len, self.state_prompt = max_len, state_prompt
        self.bos, self.pad = self.sp.bos_id(), self.sp.pad_id()
        if self.bos < 0 or self.pad < 0:
            raise ValueError("the SentencePiece model defines no <bos> or <pad> piece: it is not PaliGemma's tokenizer")

    @classmethod
    def from_file(cls, path, max_len: int, state_prompt: bool = False) -> PaliGemmaTokenizer:
        """Read ``path`` (a SentencePiece ``tokenizer.model``); a missing file is named in the error."""
        from pathlib import Path

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"no SentencePiece tokenizer at {path}: pi0 / pi0.5 use PaliGemma's (the tokenizer.model "
                "of google/paligemma-3b-pt-224, which LeRobot downloads at run time); put a copy there"
            )
        return cls(path.read_bytes(), max_len, state_prompt)

    def __len__(self) -> int:
        return self.sp.get_piece_size()

    def prompt_heads(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """pi0.5 prompts' instruction part, ``BOS + "Task: {task}, State:"``: ids and mask (n, L)."""
        heads = [[self.bos, *self.sp.encode(f"Task: {self._clean(t)}, State:")] for t in texts]
        if max(map(len, heads)) > self.max_len:
            raise ValueError(f"an instruction's prompt exceeds the {self.max_len} tokens the policy reads")
        ids = torch.full((len(texts), self.max_len), self.pad, dtype=torch.int64)
        for i, h in enumerate(heads):
            ids[i, : len(h)] = torch.tensor(h)
        mask = torch.arange(self.max_len) < torch.tensor([len(h) for h in heads])[:, None]
        return ids, mask

    def state_parts(self) -> StateParts:
        """pi0.5 prompts' state part as a captured step assembles it on the device (see
        :func:`compose_prompt`): the ids of ``" {b}"`` for every bin b in [-1, 255] and of the
        tail ``";\\nAction: "``. SentencePiece never merges across a space or a digit
        (PaliGemma's model splits digits), so a prompt's ids are its parts' ids in order;
        :meth:`check_state_prompt` verifies that for given instructions."""
        bins = [self.sp.encode(f" {b}") for b in range(-1, 256)]
        table = torch.full((len(bins), max(map(len, bins))), self.pad, dtype=torch.int64)
        for i, b in enumerate(bins):
            table[i, : len(b)] = torch.tensor(b)
        tail = torch.tensor(self.sp.encode(";\nAction: "), dtype=torch.int64)
        return StateParts(table, torch.tensor([len(b) for b in bins]), tail)

    def check_state_prompt(self, texts: Sequence[str], dims: int) -> None:
        """Raise unless :func:`compose_prompt` reproduces this tokenizer's pi0.5 prompts for every
        instruction in ``texts`` and ``dims``-dim states that visit every bin."""
        probes = torch.linspace(-1.2, 1.2, 261)  # below -1 (bin -1), every bin, above 1
        both = torch.cat([probes, probes.flip(0)])
        states = both[: len(both) // dims * dims].view(-1, dims)
        heads, head_mask = self.prompt_heads(texts)
        parts = self.state_parts()
        for i, text in enumerate(texts):
            n = len(states)
            got = compose_prompt(heads[i].expand(n, -1), head_mask[i].expand(n, -1), states, parts)
            want = self.encode([text] * n, states)
            if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                raise ValueError(
                    f"this tokenizer does not split pi0.5's prompt for {text!r} at the state's spaces and digits, "
                    "so the prompt cannot be assembled inside a captured step"
                )

    @staticmethod
    def _clean(text: str) -> str:
        return text.strip().replace("_", " ").replace("\n", " ")

    def prompt(self, text: str, state: np.ndarray | None = None) -> str:
        """The string LeRobot's processor tokenizes for a task (and, with ``state_prompt``, the
        normalised state of the dataset's dims)."""
        if not self.state_prompt:
            return text if text.endswith("\n") else f"{text}\n"
        if state is None:
            raise ValueError("a pi0.5 prompt holds the normalised state: pass states to encode()")
        bins = np.digitize(state, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
        return f"Task: {self._clean(text)}, State: {' '.join(map(str, bins))};\nAction: "

    def encode(
        self, texts: Sequence[str] | str, states: torch.Tensor | np.ndarray | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, max_len) int64 ids and (n, max_len) bool mask; ``states`` (n, D) normalised (pi0.5)."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        if states is not None:
            states = np.asarray(states.detach().cpu() if isinstance(states, torch.Tensor) else states, np.float32)
            if states.ndim != 2 or len(states) != len(texts):
                raise ValueError(f"states must be (n={len(texts)}, D), got {states.shape}")
        ids = torch.full((len(texts), self.max_len), self.pad, dtype=torch.int64)
        mask = torch.zeros(len(texts), self.max_len, dtype=torch.bool)
        for i, text in enumerate(texts):
            row = [self.bos, *self.sp.encode(self.prompt(str(text), None if states is None else states[i]))]
            row = row[: self.max_len]  # truncated as LeRobot's processor does
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = True
        return ids, mask

    def decode(self, ids: torch.Tensor) -> list[str]:
        return [self.sp.decode([i for i in row if i != self.pad]) for row in ids.tolist()]


STATE_BINS = torch.linspace(-1, 1, 256 + 1, dtype=torch.float64)[:-1]
"""pi0.5's state discretisation: ``np.digitize(state, linspace(-1, 1, 257)[:-1]) - 1``."""


@dataclass
class StateParts:
    """The state part of pi0.5 prompts (:meth:`PaliGemmaTokenizer.state_parts`): ``bins`` (257, W)
    int64 and ``lens`` (257,), the ids of ``" {b}"`` for b = -1 .. 255, and ``tail`` (T,) int64."""

    bins: torch.Tensor
    lens: torch.Tensor
    tail: torch.Tensor
    edges: torch.Tensor = dataclasses.field(default_factory=lambda: STATE_BINS.clone())
    """The bins' lower edges (256,) float64, on the parts' device (no copy inside a capture)."""

    def to(self, device: torch.device | str) -> StateParts:
        return StateParts(*(getattr(self, f.name).to(device) for f in fields(self)))


def compose_prompt(
    heads: torch.Tensor, head_mask: torch.Tensor, states: torch.Tensor, parts: StateParts
) -> tuple[torch.Tensor, torch.Tensor]:
    """pi0.5 prompts from their heads (N, L) / mask and normalised states (N, D): ids and mask
    (N, L), truncated to L as LeRobot's processor does, padded with id 0 (PaliGemma's ``<pad>``).
    Static shapes, no host sync: capturable."""
    n, length = heads.shape
    bins = torch.bucketize(states.double(), parts.edges, right=True)  # the bin + 1, in [0, 256]
    ids, lens = parts.bins[bins], parts.lens[bins]  # (N, D, W), (N, D)
    start = head_mask.sum(1, keepdim=True) + lens.cumsum(1) - lens  # (N, D): where each bin's ids go
    w = torch.arange(ids.shape[2], device=heads.device)
    pos = torch.where(w < lens[..., None], start[..., None] + w, length).flatten(1)  # (N, D*W), length = dropped
    end = start[:, -1:] + lens[:, -1:]
    tail_pos = end + torch.arange(parts.tail.numel(), device=heads.device)
    out = torch.where(head_mask, heads, torch.zeros_like(heads))
    out = torch.cat([out, out.new_zeros(n, ids.shape[1] * ids.shape[2] + parts.tail.numel())], 1)  # room past L
    out.scatter_(1, pos.clamp(max=out.shape[1] - 1), ids.flatten(1))
    out.scatter_(1, tail_pos, parts.tail.expand(n, -1))
    mask = torch.arange(length, device=heads.device) < (end + parts.tail.numel())
    return torch.where(mask, out[:, :length], heads.new_zeros(())), mask
