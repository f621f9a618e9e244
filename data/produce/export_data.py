"""`eyas export-data --format speculators DATASET OUT`: an eyas hidden-state dataset in the
layout vLLM speculators' offline trainer reads (speculators @ c05b95b3: `scripts/train.py
--data-path OUT`, whose `ArrowDataset` in speculators/train/data.py loads the rows with
`datasets.load_from_disk(OUT)` and hidden states from `OUT/hidden_states` by row index):

    OUT/data-*.arrow, dataset_info.json, state.json
        a Hugging Face `datasets` dataset (`save_to_disk`, torch format), row i = sample i:
        input_ids int64 [T], loss_mask int64 [T] (eyas's loss_mask: 1 on trained tokens, the
        assistant turns, as speculators' own preprocessing marks them), seq_len int64
    OUT/hidden_states/hs_<i>.safetensors
        token_ids int64 [T] (= row i's input_ids) and hidden_states bf16 [T, 4, tH]: eyas's
        three aux states in ascending layer order (speculators flattens [:, :3] to [T, 3*tH])
        and, last, the verifier's final hidden state BEFORE its final norm ([:, -1]: the
        trainer applies the verifier's norm and lm_head to it for its teacher)
    OUT/token_freq.pt   {token id: count} of the trained tokens (input_ids where loss_mask)
    OUT/d2t.npy, t2d.npy   with --vocab: int64 [Vd] offsets (target id = i + d2t[i]), bool [V]
    OUT/eyas_export.json   what was exported, from where

eyas stores the final state AFTER the target's final RMSNorm (`last`, teacher.last
"post_norm"). RMSNorm is scale-invariant, so `last / w` (w: the target's final norm weight,
read from its safetensors) is a pre-norm state that speculators' verifier norm maps back onto
`last` within bf16 rounding; a dataset imported with --keep-prenorm (teacher.last "pre_norm")
is copied as stored. A dataset without `last` (top-k teacher only) cannot be exported. OUT is
built in a temporary sibling and renamed into place when complete (`atomic_write_dir`).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.data.produce.outdir import WrongDirectory
from eyas.data.common.deps import MissingDependency
from eyas.data.common.lock import writes_directory
from eyas.data.common.options import option
from eyas.data.common.utils import (LogEvery, atomic_write_dir, atomic_write_json, progress,
                                    remove_leftover_dirs)
from eyas.data.store.format import DatasetError

log = logging.getLogger(__name__)

FORMATS = ("speculators",)
SPECULATORS_COMMIT = "c05b95b3"
RECORD = "eyas_export.json"
#: what an export writes into OUT: --overwrite replaces a directory holding only these
WRITES = ("data-*.arrow", "dataset_info.json", "state.json", "hidden_states", "token_freq.pt",
          "d2t.npy", "t2d.npy", RECORD)
FIELDS = ("input_ids", "loss_mask", "aux", "last")


def check_source(ds, root: Path) -> str:
    """How `last` is stored ("post_norm" or "pre_norm"); DatasetError naming `root` and the fix
    when speculators cannot train from the dataset."""
    fields = ds.fields
    if ds.kind != "hidden" or "aux" not in fields:
        raise DatasetError(f"a {ds.kind} dataset (fields {sorted(fields)}) has no hidden states; "
                           f"speculators trains from aux states and the target's last state. "
                           f"Fix: export the output of `eyas extract --teacher last` (or both)",
                           path=root)
    teacher = ds.manifest.get("teacher")
    teacher = teacher if isinstance(teacher, dict) else {"kind": teacher}
    if "last" not in fields:
        raise DatasetError(f"no 'last' field (teacher {teacher.get('kind')!r}): speculators "
                           f"computes its teacher from the target's final hidden state through "
                           f"its lm_head. Fix: re-extract with `eyas extract --teacher last` "
                           f"(or `--teacher both`) and export that dataset", path=root)
    tH = fields["last"]["shape"]
    if fields["aux"]["shape"] != [3, *tH] or len(tH) != 1:
        raise DatasetError(f"fields aux {fields['aux']['shape']} and last {tH} per token are not "
                           f"[3, tH] and [tH]; the dataset is not an eyas hidden-state dataset "
                           f"of format version 1", path=root)
    conv = teacher.get("last") or "post_norm"
    if conv not in ("post_norm", "pre_norm"):
        raise DatasetError(f"manifest teacher.last is {conv!r}; expected 'post_norm' or "
                           f"'pre_norm'", path=root)
    return conv


def inverse_norm_weight(target: str | None, hidden: int, root: Path) -> torch.Tensor:
    """float32 [tH]: 1 / the target's final norm weight (0 where the weight is 0), the factor
    that turns a post-norm state into one speculators' verifier norm maps back onto it."""
    from eyas.data.produce.importers import final_norm_weight
    if not target:
        raise DatasetError("the manifest names no target; the last state needs the target's "
                           "final norm weight. Fix: pass --target MODEL", path=root)
    try:
        w = final_norm_weight(target).float().flatten()
    except (OSError, ValueError, KeyError) as e:
        raise DatasetError(f"cannot read the final norm weight (model.norm.weight) of target "
                           f"{str(target)!r} ({' '.join(str(e).split())[:200]}). Fix: pass "
                           f"--target MODEL, the directory or hub id the dataset was extracted "
                           f"from", path=root) from None
    if w.numel() != hidden:
        raise DatasetError(f"target {str(target)!r} has a final norm of {w.numel()} channels but "
                           f"the dataset's states have {hidden}; wrong --target?", path=root)
    return torch.where(w == 0, torch.zeros_like(w), 1.0 / w)


def sample_tensors(s: dict[str, torch.Tensor], inv: torch.Tensor | None
                   ) -> dict[str, torch.Tensor]:
    """The hs_<i>.safetensors tensors of eyas sample `s` (`inv`: None keeps `last` as stored)."""
    last = s["last"] if inv is None else (s["last"].float() * inv).to(torch.bfloat16)
    states = torch.cat([s["aux"].to(torch.bfloat16), last.to(torch.bfloat16)[:, None]], dim=1)
    return {"token_ids": s["input_ids"].to(torch.int64).contiguous(),
            "hidden_states": states.contiguous()}


def check_prenorm(states: torch.Tensor, i: int, root: Path, target: str) -> None:
    """Raise unless the pre-norm states `last / w` of sample i have RMS 1 (what a post-norm
    state divided by its own norm's weight has): else `last` is not that target's norm output."""
    rms = states.float().pow(2).mean(-1).sqrt()
    bad = ((rms - 1).abs() > 2**-5).nonzero().flatten()
    if bad.numel():
        t = int(bad[0])
        raise DatasetError(f"token {t}: last / the final norm weight of target {target!r} has "
                           f"RMS {float(rms[t]):.3f}, expected 1: the stored last states are not "
                           f"that norm's output. Fix: pass --target MODEL, the target the "
                           f"dataset was extracted from", path=root, sample=i)


def _require_datasets():
    try:
        import datasets
    except Exception as e:       # absent, or a broken install
        first = " ".join(str(e).split())[:160]
        raise MissingDependency(
            f"--format speculators needs the datasets package, which cannot be imported "
            f"({type(e).__name__}: {first}): speculators' trainer reads its rows with "
            f"datasets.load_from_disk. Fix: pip install 'datasets>=4'") from None
    return datasets


def _rows(root: str, n: int) -> Iterator[dict[str, Any]]:
    """The rows of speculators' preprocessed dataset for the first n samples of `root`."""
    from eyas.data.store.dataset import open_dataset
    ds = open_dataset(root)
    for i in range(n):
        s = ds.sample(i, ("input_ids", "loss_mask"))
        yield {"input_ids": s["input_ids"].numpy(),
               "loss_mask": s["loss_mask"].to(torch.int64).numpy(),
               "seq_len": int(s["input_ids"].shape[0])}


def write_rows(tmp: Path, root: Path, n: int) -> None:
    """`tmp` = the rows as a `datasets` dataset in torch format, as speculators saves its own."""
    datasets = _require_datasets()
    seq = getattr(datasets, "List", None) or datasets.Sequence
    features = datasets.Features({"input_ids": seq(datasets.Value("int64")),
                                  "loss_mask": seq(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    cache = tmp / ".tmp-rows-cache"
    rows = datasets.Dataset.from_generator(_rows, features=features, cache_dir=str(cache),
                                           gen_kwargs={"root": str(root), "n": n})
    rows.set_format(type="torch")
    rows.save_to_disk(str(tmp))
    del rows
    shutil.rmtree(cache, ignore_errors=True)


def write_hidden_states(ds, tmp: Path, n: int, inv: torch.Tensor | None,
                        target: str = "") -> np.ndarray:
    """hidden_states/hs_<i>.safetensors for the first n samples (`inv`: see sample_tensors;
    `target` names it in errors); returns the int64 count of each trained token id."""
    from safetensors.torch import save_file
    out = tmp / "hidden_states"
    out.mkdir()
    counts = np.zeros(0, dtype=np.int64)
    every = LogEvery()
    for i in progress(range(n), desc="exporting hidden states", unit="sample"):
        s = ds.sample(i, FIELDS)
        tensors = sample_tensors(s, inv)
        if inv is not None:
            check_prenorm(tensors["hidden_states"][:, 3], i, ds.root, target)
        save_file(tensors, str(out / f"hs_{i}.safetensors"))
        found = np.bincount(s["input_ids"][s["loss_mask"]].numpy())
        if found.size > counts.size:
            counts = np.pad(counts, (0, found.size - counts.size))
        counts[:found.size] += found
        if every.due():
            log.info("export-data: %d of %d samples written (%.0f s)", i + 1, n, every.elapsed)
    return counts


def write_vocab(tmp: Path, vocab: str | os.PathLike, vocab_size: int | None) -> int:
    """d2t.npy / t2d.npy from an eyas vocab file (`eyas vocab --out`); returns Vd."""
    from eyas.data.produce.vocab import load_vocab
    d2t, t2d = load_vocab(vocab)
    if vocab_size and t2d.numel() != vocab_size:
        raise ValueError(f"--vocab {vocab}: t2d has {t2d.numel()} entries but the dataset's "
                         f"target vocabulary has {vocab_size}; pass the map built for this "
                         f"dataset's target (eyas vocab --data DATASET --out FILE)")
    np.save(tmp / "d2t.npy", d2t.to(torch.int64).numpy())
    np.save(tmp / "t2d.npy", t2d.to(torch.bool).numpy())
    return int(d2t.numel())


def check_out(out: Path, root: Path, overwrite: bool) -> str:
    """`atomic_write_dir`'s if_exists for OUT; WrongDirectory when OUT may not be replaced."""
    if not out.exists():
        return "error"
    if not out.is_dir():
        raise WrongDirectory(f"OUT {out} is a file; choose a new directory")
    if root.resolve() == out.resolve() or out.resolve() in root.resolve().parents:
        raise WrongDirectory(f"OUT {out} is (or holds) the dataset being exported ({root}); "
                             f"choose another OUT")
    entries = sorted(p.name for p in out.iterdir())
    if entries and not overwrite:
        raise WrongDirectory(f"OUT {out} is not empty ({len(entries)} entries); eyas export-data "
                             f"writes a new directory. Fix: choose another OUT, or pass "
                             f"--overwrite to replace an earlier export")
    foreign = [e for e in entries if not any(fnmatch.fnmatchcase(e, p) for p in WRITES)]
    if foreign:
        raise WrongDirectory(f"--overwrite would delete {out}, which holds entries an export "
                             f"does not write ({', '.join(foreign[:5])}). Fix: move them out of "
                             f"{out}, or choose another OUT")
    return "replace"


@writes_directory("out", what="speculators data export", sibling=True)
def export_speculators(dataset: str | os.PathLike, out: str | os.PathLike, *,
                       target: str | None = None, vocab: str | os.PathLike | None = None,
                       num_samples: int | None = None, overwrite: bool = False
                       ) -> dict[str, Any]:
    """Write the first `num_samples` (default: all) samples of the eyas hidden-state dataset
    `dataset` to `out` in speculators' offline training layout (module docstring). `target`:
    where the final norm weight is read (default: the manifest's target); `vocab`: an eyas
    d2t/t2d file, written as d2t.npy / t2d.npy. Returns the record written to eyas_export.json."""
    from eyas.data.store.dataset import open_dataset
    root, out = Path(dataset), Path(out)
    ds = open_dataset(root, verify="header")
    conv = check_source(ds, root)
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {num_samples}")
    n = len(ds) if num_samples is None else min(num_samples, len(ds))
    if_exists = check_out(out, root, overwrite)
    remove_leftover_dirs(out)
    _require_datasets()
    m, hidden = ds.manifest, int(ds.fields["last"]["shape"][0])
    inv = None if conv == "pre_norm" else inverse_norm_weight(target or m.get("target"),
                                                              hidden, root)
    tokens = int(ds.sample_lengths[:n].sum())
    record = {"format": "speculators", "speculators_commit": SPECULATORS_COMMIT,
              "source": str(root.resolve()), "target": str(target or m.get("target")),
              "n_samples": n, "n_tokens": tokens, "hidden_size": hidden,
              "aux_layer_ids": m.get("aux_layer_ids"), "convention": m.get("convention"),
              "verifier_last": "as stored (pre_norm)" if inv is None
              else "last / final norm weight (pre-norm equivalent)",
              "draft_vocab_size": None}

    def build(tmp: Path) -> None:
        write_rows(tmp, root, n)
        counts = write_hidden_states(ds, tmp, n, inv, record["target"])
        torch.save({int(t): int(counts[t]) for t in np.nonzero(counts)[0]},
                   tmp / "token_freq.pt")
        if vocab is not None:
            record["draft_vocab_size"] = write_vocab(tmp, vocab, m.get("vocab_size"))
        atomic_write_json(tmp / RECORD, record)

    log.info("export-data: %d samples (%d tokens) of %s -> %s", n, tokens, root, out)
    atomic_write_dir(out, build, if_exists=if_exists, need_bytes=tokens * (8 * hidden + 24))
    ids = " ".join(str(a) for a in m.get("aux_layer_ids") or [])
    log.info("train with speculators: python scripts/train.py --verifier-name-or-path %s "
             "--data-path %s --target-layer-ids %s --on-missing raise", record["target"],
             out, ids)
    return record


@dataclass(kw_only=True)
class ExportDataOptions:
    """Write an eyas hidden-state dataset in another trainer's on-disk layout (speculators: the
    preprocessed dataset, hidden_states/hs_<i>.safetensors, token_freq.pt, d2t.npy/t2d.npy)."""

    dataset: str = option(help="eyas hidden-state dataset directory", positional=True,
                          metavar="DATASET")
    out: str = option(help="new output directory (must not exist or be empty, unless "
                      "--overwrite)", positional=True, metavar="OUT")
    format: str = option("speculators", "the layout to write: speculators (vLLM speculators' "
                         "offline EAGLE-3 trainer, --data-path OUT)", choices=FORMATS)
    target: str | None = option(
        None, "where the target's final norm weight is read, to store the pre-norm last state "
        "speculators expects (directory, hub id or preset; default: the manifest's target)",
        metavar="MODEL")
    vocab: str | None = option(None, "also write this eyas draft vocabulary (eyas vocab --out "
                               "FILE) as d2t.npy / t2d.npy (default: none; speculators builds "
                               "its own from token_freq.pt)", metavar="FILE")
    num_samples: int | None = option(None, "export only the first N samples (default: all)",
                                     metavar="N")
    overwrite: bool = option(False, "replace an earlier export at OUT")


def main(args: ExportDataOptions) -> int:
    """`eyas export-data [--format speculators] DATASET OUT [--target MODEL] [--vocab FILE]`."""
    r = export_speculators(args.dataset, args.out, target=args.target, vocab=args.vocab,
                           num_samples=args.num_samples, overwrite=args.overwrite)
    print(f"exported {r['n_samples']} samples ({r['n_tokens']} tokens) to {args.out} "
          f"({args.format} layout)")
    return 0
