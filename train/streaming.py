"""The job's side of `data.stream` (data/produce/stream.py does the capturing): where a streamed
run's dataset comes from and goes to, and each rank's producer."""

from __future__ import annotations

from pathlib import Path

from eyas.train.config import ConfigError, DataConfig, TargetConfig


def stream_source(data: DataConfig, run_dir: Path | None) -> dict | None:
    """With data.stream and data.tokens: the `DatasetPaths` fields of a dataset to capture from
    those tokens into data.dataset (default run_dir/dataset); else None (the embedded default's
    tokens stream from its own stage)."""
    if data.stream.enabled and run_dir is None:
        raise ValueError("data.stream needs the run directory (run_dir)")
    if not (data.stream.enabled and data.tokens):
        return None
    tokens = Path(data.tokens).expanduser()
    if not (tokens / "manifest.json").is_file():
        raise FileNotFoundError(f"data.tokens={tokens}: no manifest.json there; write a token "
                                f"dataset with `eyas prepare`")
    train = Path(data.dataset).expanduser() if data.dataset else run_dir / "dataset"
    eval_dir = Path(data.eval_dataset).expanduser() if data.eval_dataset else None
    return dict(train=train, eval=eval_dir, tokens=tokens)


def settle(paths, data: DataConfig, run_dir: Path | None):
    """A complete dataset is read, nothing captured; keep=none spools in the run directory."""
    if (paths.train / "manifest.json").is_file():
        paths.tokens = None
    elif paths.tokens is not None and data.stream.keep == "none":
        paths.train = run_dir / "stream-spool"
    return paths


def open_stream(data_cfg: DataConfig, target: TargetConfig, datasets, *, rank: int,
                world_size: int, device, target_dtype):
    """This rank's producer over `datasets.tokens` (data/produce/stream.py)."""
    from eyas.data.produce.stream import open_stream as open_
    if data_cfg.capture == "vllm" and world_size > 1:
        raise ConfigError("data.stream with data.capture=vllm runs one engine in one process; "
                          "for several ranks start `vllm serve` (docs/engine.md) and stream with "
                          "data.capture=endpoint data.capture_endpoint=URL")
    kw = data_cfg.extract_kwargs()
    hf = dict(device=device, pad_batches=kw.pop("pad_batches"))
    return open_(datasets.tokens, target.name, datasets.train, **kw,
                 **(hf if data_cfg.capture == "hf" else {}),
                 keep=data_cfg.stream.keep.value, ahead=data_cfg.stream.ahead,
                 spool_bytes=data_cfg.stream.spool_bytes,
                 shard_tokens=data_cfg.stream.shard_tokens, rank=rank, world_size=world_size,
                 layers=None if target.aux_layer_ids is None else list(target.aux_layer_ids),
                 dtype=str(target_dtype).removeprefix("torch."))
