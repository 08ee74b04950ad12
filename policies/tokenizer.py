"""Instruction tokenizers, saved beside the weights: a word-level one for the built-in task, and
PaliGemma's SentencePiece tokenizer as LeRobot's pi0 / pi0.5 processors call it."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

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

    def prompt(self, text: str, state: np.ndarray | None = None) -> str:
        """The string LeRobot's processor tokenizes for a task (and, with ``state_prompt``, the
        normalised state of the dataset's dims)."""
        if not self.state_prompt:
            return text if text.endswith("\n") else f"{text}\n"
        if state is None:
            raise ValueError("a pi0.5 prompt holds the normalised state: pass states to encode()")
        bins = np.digitize(state, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
        clean = text.strip().replace("_", " ").replace("\n", " ")
        return f"Task: {clean}, State: {' '.join(map(str, bins))};\nAction: "

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
