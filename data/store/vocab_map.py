"""The vocab map: which target id each draft (`lm_head`) row stands for, and its validator.

    d2t [Vd] int64   offsets: target_id = i + d2t[i]     (strictly increasing ids)
    t2d [V]  bool    t2d[v] == (v is selected);  t2d.sum() == Vd

(models/serving/CONTRACT.md §3). `VocabMap.from_d2t` derives t2d from d2t; `target_ids` (draft
row -> target id) and `t2d_index` (target id -> draft row) are built once per map;
`VocabMap.validate` checks every invariant and raises a ValueError naming the tensor, the entry
and the value that break it. Builders (data.vocab), the exporter, the importer, the doctor and
the drafter all go through this type.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


def _describe(t) -> str:
    return f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}"


@dataclass(frozen=True)
class VocabMap:
    """A draft vocabulary as the (d2t offsets, t2d mask) pair both engines and eyas use."""

    d2t: torch.Tensor   # [Vd] int64
    t2d: torch.Tensor   # [V] bool

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, vocab_size: int) -> VocabMap:
        """The map of offsets `d2t` over a target vocabulary of `vocab_size` ids: t2d marks the
        ids {i + d2t[i]} the draft vocabulary selects."""
        vocab = cls(d2t, torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device))
        ids = vocab.target_ids
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"i + d2t[i] leaves [0, {vocab_size}): d2t must hold offsets "
                             f"(target_id - i), not absolute ids or ids of another vocabulary")
        vocab.t2d[ids] = True
        return vocab

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    @property
    def vocab_size(self) -> int:
        return self.t2d.numel()

    @cached_property
    def target_ids(self) -> torch.Tensor:
        """[Vd] int64: the target id of each draft row, i + d2t[i]."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @cached_property
    def t2d_index(self) -> torch.Tensor:
        """[V] int64: the draft row of each target id, -1 for ids outside the draft vocabulary."""
        index = torch.full((self.t2d.numel(),), -1, dtype=torch.int64, device=self.d2t.device)
        index[self.target_ids] = torch.arange(self.d2t.numel(), device=self.d2t.device)
        return index

    def validate(self, *, target_vocab_size: int | None = None,
                 draft_vocab_size: int | None = None) -> VocabMap:
        """Check the invariants of models/serving/CONTRACT.md §3; raise ValueError saying what is
        wrong and how to fix it. Returns the map itself when the pair is consistent."""
        d2t, t2d = self.d2t, self.t2d
        if not isinstance(d2t, torch.Tensor) or d2t.dtype != torch.int64 or d2t.dim() != 1:
            raise ValueError(f"d2t must be an int64 tensor [Vd] of offsets, got {_describe(d2t)}")
        if not isinstance(t2d, torch.Tensor) or t2d.dtype != torch.bool or t2d.dim() != 1:
            raise ValueError(f"t2d must be a bool tensor [V], got {_describe(t2d)}")
        Vd, V = d2t.numel(), t2d.numel()
        if target_vocab_size is not None and V != target_vocab_size:
            raise ValueError(f"t2d has {V} entries but the target vocabulary has "
                             f"{target_vocab_size}")
        if draft_vocab_size is not None and Vd != draft_vocab_size:
            raise ValueError(f"d2t has {Vd} entries but draft_vocab_size is {draft_vocab_size}")
        if not 0 < Vd <= V:
            raise ValueError(f"draft vocabulary size {Vd} must be in [1, V={V}]")
        self._check_ids(torch.nonzero(t2d).flatten())
        return self

    def _check_ids(self, selected: torch.Tensor) -> None:
        d2t, Vd, V = self.d2t, self.d2t.numel(), self.t2d.numel()
        if Vd > 1 and torch.equal(d2t, selected) and d2t.any():
            raise ValueError("d2t holds absolute target ids (d2t == the ids t2d selects); eyas "
                             "and both engines expect offsets d2t[i] = id_i - i: use "
                             "d2t - arange(Vd)")
        ids = self.target_ids
        out = ((ids < 0) | (ids >= V)).nonzero().flatten()
        if out.numel():
            i = int(out[0])
            raise ValueError(f"d2t[{i}] = {int(d2t[i])} maps draft row {i} to target id "
                             f"{int(ids[i])}, outside [0, {V}); d2t must hold offsets id_i - i "
                             f"of ids in the target vocabulary")
        steps = (ids[1:] <= ids[:-1]).nonzero().flatten()
        if steps.numel():
            i = int(steps[0])
            raise ValueError(f"target ids i + d2t[i] are not strictly increasing: row {i} -> "
                             f"{int(ids[i])}, row {i + 1} -> {int(ids[i + 1])}; the draft "
                             f"vocabulary must be sorted ascending (d2t non-decreasing)")
        if int(selected.numel()) != Vd:
            raise ValueError(f"t2d selects {selected.numel()} ids but d2t has Vd = {Vd} rows; "
                             f"they must describe the same set")
        if not torch.equal(selected, ids):
            i = int((selected != ids).nonzero().flatten()[0])
            hint = (" (d2t is all zeros: an identity mapping that was never filled?)"
                    if not d2t.any() and Vd < V else "")
            raise ValueError(f"d2t and t2d disagree: draft row {i} maps to target id "
                             f"{int(ids[i])} but the {i}-th id selected by t2d is "
                             f"{int(selected[i])}{hint}")
