"""A word-level instruction tokenizer (saved beside the weights)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

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
