"""The configuration schema: one dataclass per component, registered in Hydra's ConfigStore.

`conf/config.yaml` composes these with the preset files under `conf/<group>/`. Struct mode is
on, so an unknown key or a value of the wrong type fails at composition time; `check()` adds
the cross-field rules and names the override that fixes each problem. The entry point turns the
composed config into these dataclasses once (`load`); `train.resolve` then decides every "auto"
for the device (`Resolved`); components take their own group (`cfg.optim`, `cfg.loss`, …).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from eyas.data.common.settings import (EndpointSettings, ExtractionSettings, GenerationSettings,
                                       SeedSettings, StreamSettings, SynthesisSettings,
                                       TargetSettings, TokenizeSettings)
from eyas.data.common.targets import weights_error
from eyas.models.config import DrafterShape
from eyas.models.context import DEFAULT_EDGES
from eyas.models.fp8 import DEFAULT_FP8_LAYERS
from eyas.train.choices import (AttentionImpl, DistBackend,  # noqa: F401
                                ExportSelect, FP8Recipe, LossImpl, LossObjective, MuonAdjustLR,
                                Normalisation, OptimName, ParamDtype, Moments, Schedule, WandbMode)
from eyas.train.limits import (check_data, check_dist, check_drafter, check_eval, check_loop,
                               check_loss, check_optim, check_target, check_trackers,
                               run_name_message)


@dataclass
class TargetConfig(TargetSettings):
    """The target group (`data.common.settings.TargetSettings`: name, aux_layer_ids, dtype),
    shared with `eyas prepare`, `eyas extract` and `eyas import`."""


@dataclass
class DrafterConfig(DrafterShape):
    """The drafter group: its shape fields (`models.config.DrafterShape`: draft_vocab_size,
    ttt_steps, heads, head_dim, intermediate_size, max_position_embeddings) plus training
    choices."""

    attention: AttentionImpl = AttentionImpl.auto
    """flex (flex_attention, compiled on GPU), eager (dense reference; CPU training) or auto
    (flex on CUDA, eager elsewhere: torch's flex_attention has no CPU backward)."""
    compile: bool = True
    """torch.compile the drafter layer on GPU (ignored on CPU; refused under ZeRO-3, whose
    partitioned weights compiled graphs would bypass: dist=zero3 turns it off)."""
    checkpoint_mlp: bool = False
    """Recompute the MLP in backward: ~1.6 GiB less at the Llama-8B shape, ~20% slower."""
    embedding_qkv_once: bool = True
    """Project the embedding half of q/k/v once per TTT unroll for all K steps (step k reads
    rows shifted by k) instead of once per step: ~9 % fewer GEMM FLOPs at the Llama-8B shape,
    the same function up to bf16 rounding of the two halves' sum (`models.layer`). Refused
    under ZeRO-3, whose partitioning it would defeat (dist=zero3 turns it off)."""
    host_embedding: Optional[bool] = None
    """Keep the frozen target embedding in host memory and send each batch's rows with the
    batch (train.step.TrainingModule; the loader's threads gather them): ~1 GiB less GPU
    memory at Llama-8B, 2.2 GiB at Kimi, and no slower (benchmarks/README.md). null = on with
    CUDA, off elsewhere (the table is in host memory there anyway)."""
    fp8: FP8Recipe = FP8Recipe.off
    """FP8 GEMMs for the drafter's linear layers (torchao float8 training, `models.fp8`):
    off, tensorwise (fastest on H100/H200) or rowwise. Parameters and the export stay bf16."""
    fp8_layers: List[str] = field(default_factory=lambda: list(DEFAULT_FP8_LAYERS))
    """With drafter.fp8: which linear layers run FP8 GEMMs (the rest stay bf16), by name from
    fc, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj. Default: all but fc,
    which reads the target's raw states: within 0.2 % of bf16's held-out τ, at the speed of
    all eight (models/fp8.py)."""
    fp8_split_qkv: bool = False
    """With drafter.fp8 on q/k/v and embedding_qkv_once: project the embedding half of q/k/v
    in bf16 once per unroll and only the hidden half in FP8 each step (scales of that half
    alone), instead of the whole [T, 2H] input in FP8 every step (`models.fp8.fp8_linear`).
    Fewer FP8 GEMM FLOPs and casts; other numerics than the default FP8 path, whose quality
    is the one measured (benchmarks/README.md)."""
    init_lm_head_from_target: bool = True
    """Initialise draft lm_head row i from the target head row of token i + d2t[i]."""
    warm_start: Optional[str] = None
    """Exported/imported drafter directory to start from; its vocab map is kept."""


@dataclass
class DataConfig(EndpointSettings, ExtractionSettings, SynthesisSettings, GenerationSettings,
                 TokenizeSettings):
    """The data group: the settings it shares with `eyas prepare`, `eyas synthesize` and `eyas
    extract` (`data.common.settings`), the embedded default dataset (answers shorter than
    `eyas prepare --generate`'s, answer 0 greedy, the others sampled) and the loader."""

    max_new_tokens: int = 96
    """Length cap of generated assistant turns for the embedded default."""
    temperature: float = 0.7
    """Sampling temperature of answers 1.. (answer 0 is always greedy, what decoding serves)."""
    top_p: float = 0.95
    """Nucleus (top-p) cutoff of the sampled answers 1.. of the embedded default."""
    dataset: Optional[str] = None
    """Hidden-state dataset directory; null = build the embedded default (cached)."""
    eval_dataset: Optional[str] = None
    """Held-out hidden-state dataset; null = split eval_fraction off `dataset`."""
    prompts: Optional[str] = None
    """Prompts for the embedded default (messages JSONL); null = the shipped prompts."""
    tokens: Optional[str] = None
    """Token dataset (`eyas prepare`) a streamed run captures from (data.stream); null = the
    embedded default's."""
    stream: StreamSettings = field(default_factory=StreamSettings)
    """Capture and train at once (data/produce/stream.py); `data.stream=true` turns it on."""
    vocab_count: str = "auto"
    """Which tokens choose the draft vocabulary (data.vocab.count_tokens): auto (the target's
    argmax where the dataset stores it; a streamed run has none yet: next_token),
    target_argmax, next_token or masked_token."""
    endpoint: Optional[str] = None
    """OpenAI-compatible server (http://HOST:PORT/v1: vLLM, SGLang, transformers serve) that
    writes the embedded default's answers instead of transformers.generate (data.produce.served); the
    target is still loaded locally for extraction. null = the target answers locally."""
    endpoint_model: Optional[str] = None
    """Model name sent to data.endpoint; null = the first that its /v1/models lists."""
    endpoint_api_key_env: Optional[str] = None
    """Environment variable holding data.endpoint's API key; null = no key."""
    num_prompts: int = 96
    """How many shipped prompts the embedded default answers with the target."""
    samples_per_prompt: int = 1
    """Answers per prompt for the embedded default: answer 0 greedy, the others sampled."""
    synthetic_prompts: int = 0
    """Extra prompts the embedded default samples from the target itself (data.produce.synthesize),
    answered like the shipped ones; the held-out prompts are never among them. With
    synthetic_opener_words or synthetic_examples > 0 their openers or example lists come from
    the shipped prompts (data.prompts)."""
    cache_dir: str = "~/.cache/eyas"
    """Where targets and the embedded default dataset are cached."""
    token_budget: int = 2048
    """Tokens per packed micro-batch (per rank)."""
    eval_fraction: float = 0.05
    """Fraction of samples held out for evaluation when eval_dataset is null."""
    device_prefetch: Optional[bool] = None
    """Copy the next batch to the GPU on a side stream while the current step computes
    (`train.batches.DeviceBatches`): the ~170 MB transfer of a Llama-8B batch at T = 4096 leaves
    the compute stream, at the cost of one batch more in GPU memory. null = on with CUDA (on a
    CPU, true only holds the next batch: the same batches and resume points, no faster)."""
    num_workers: int = 2
    """Background prefetch threads of the packed loader. Two keep the first epoch's read
    checks (data.verify) off the critical path on the H200 benchmark (data wait ≤ 0.1 %, as with
    the checks off; tokens/s within noise); one left 3-9 % data wait there
    (benchmarks/README.md)."""
    vocab: Optional[str] = None
    """Existing vocab map file (d2t/t2d); null = build from the training set."""
    verify: bool = True
    """Check each sample's crc32 and NaN/inf the first time the loader reads it (`data.verify`:
    one integer pass over its bytes in the loader threads, first epoch only); a corrupted sample
    stops training with an error naming shard file and sample. false trains on the bytes as
    they are (stored NaN/inf then reach the trainer's non-finite-loss guard)."""
    nonfinite: str = "raise"
    """What a stored NaN/inf sample does when data.verify is on: raise (an error naming shard
    file, sample and token) or skip (left out of its batch, counted and logged)."""


@dataclass
class LossMix:
    """Weights of the terms of loss.objective=mix (each >= 0, not all 0)."""
    kl: float = 0.5
    """Soft cross-entropy (forward KL's gradient)."""
    tv: float = 0.5
    """Total variation, 1 − α."""
    lk_alpha: float = 0.0
    """LK^α, −log α."""
    lk_lambda: float = 0.0
    """LK^λ, λ·KL + (1 − λ)·TV with λ = exp(−loss.lk_eta·α)."""


@dataclass
class LossConfig:
    objective: LossObjective = LossObjective.soft_ce
    """Row objective against the teacher p̂ with draft q and α = Σ min(p̂, q): soft_ce (forward
    KL), tv (1 − α), lk_alpha (−log α), lk_lambda (λ·KL + (1 − λ)·TV, λ = exp(−lk_eta·α)) or
    mix (loss.mix's weights); kernels/loss.py has the formulas."""
    lk_eta: float = 3.0
    """LK^λ's η: larger moves the weight from KL to TV at a lower α."""
    mix: LossMix = field(default_factory=LossMix)
    """Term weights of objective=mix."""
    impl: LossImpl = LossImpl.auto
    """triton (fused kernel), torch (reference twin) or auto (triton on CUDA, else torch)."""
    step_weight: float = 0.8
    """Weight of TTT step k is step_weight**k."""
    normalisation: Normalisation = Normalisation.valid
    """valid: mean over valid rows per step; specforge: divide by all rows."""
    position_mask: bool = True
    """Drop rows whose target argmax is outside the draft vocabulary."""
    chunk_size: Optional[int] = None
    """Rows per fused-loss chunk; null = the kernel's default."""
    skip_masked_rows: bool = True
    """List the rows that count (valid · loss_mask) on the host; the others skip the lm_head GEMMs."""


@dataclass
class OptimConfig:
    lr: float = 1e-4
    """Peak learning rate (with optim=muon, of both halves unless optim.muon_lr is set)."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    schedule: Schedule = Schedule.cosine
    """LR schedule after warmup."""
    warmup_ratio: float = 0.015
    """Warmup as a fraction of total optimizer steps (used when warmup_steps is null)."""
    warmup_steps: Optional[int] = None
    """Warmup length in optimizer steps (>= 0; 0 = none); overrides warmup_ratio."""
    clip_grad_norm: float = 0.5
    """Global gradient-norm clip (>= 0); 0 disables."""
    compact_masters: bool = True
    """Hold each fp32 master weight as its bf16 parameter + 16 low bits (the same fp32 values,
    2 bytes per parameter less; Triton update on GPU, off DeepSpeed). false: full fp32 copies."""
    moments: Moments = Moments.fp32
    """AdamW's exp_avg / exp_avg_sq storage: fp32, or bf16 with stochastic rounding (4 bytes of
    optimizer state per parameter less; DDP with bf16 parameters: the fused kernel on GPU, its
    torch twin on CPU)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    name: OptimName = OptimName.adamw
    """adamw, or muon: Muon for the hidden matrices, AdamW for lm_head and norms (train/muon.py)."""
    muon_lr: Optional[float] = None
    """optim=muon: Muon's peak learning rate; null = optim.lr."""
    muon_weight_decay: Optional[float] = None
    """optim=muon: Muon's decoupled weight decay; null = optim.weight_decay."""
    muon_momentum: float = 0.95
    """optim=muon: Muon's momentum, in [0, 1)."""
    muon_nesterov: bool = True
    """optim=muon: Nesterov momentum for Muon (always on under ZeRO)."""
    muon_ns_steps: int = 5
    """optim=muon: Newton-Schulz iterations per update (1..99; 5 under ZeRO)."""
    muon_adjust_lr: MuonAdjustLR = MuonAdjustLR.match_rms_adamw
    """optim=muon: torch's adjust_lr_fn: match_rms_adamw (AdamW's lr carries over) or original
    (wants optim.muon_lr near 0.02)."""


@dataclass
class DistConfig:
    backend: DistBackend = DistBackend.ddp
    """ddp or deepspeed (ZeRO via accelerate)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage (1, 2, 3) when backend=deepspeed."""
    deepspeed_config: Optional[str] = None
    """DeepSpeed JSON (a path, or a name in conf/deepspeed/); null = conf/deepspeed/zero<stage>.json.
    Used as given except "auto" fields, which the config fills (train.dist.deepspeed_config)."""


@dataclass
class TrackerConfig:
    kind: List[str] = field(default_factory=list)
    """accelerate trackers to log to, e.g. [wandb], [tensorboard], [mlflow,aim]; [] = none (the
    JSONL metrics file is always written)."""
    mode: WandbMode = WandbMode.offline
    """wandb mode: online, offline or disabled."""
    project: str = "eyas"
    """wandb project."""
    entity: Optional[str] = None
    """wandb entity (team); null = your default."""
    run_name: Optional[str] = None
    """wandb run name; null = the command line's overrides joined (Hydra's override_dirname),
    or run_name when there are none."""
    group: Optional[str] = None
    """wandb group; null = the sweep directory name under --multirun."""


@dataclass
class TrainConfig(SeedSettings):
    """The train group: the seed (`data.common.settings.SeedSettings`, also the seed of generation and
    synthesis) plus the loop's settings."""

    epochs: int = 1
    """Passes over the training set (max_steps wins when set)."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (>= 1); null = train.epochs passes."""
    log_every: int = 10
    """Optimizer steps between metric logs (>= 1; the last step always logs)."""
    eval_every: int = 0
    """Optimizer steps between evaluations; 0 = only at the end (negative: refused)."""
    save_every: int = 0
    """Optimizer steps between checkpoints; 0 = only at the end (negative: refused)."""
    keep_last: int = 2
    """Checkpoints kept by rotation, >= 1 (the best one is kept too)."""
    resume: Optional[str] = None
    """Checkpoint directory to resume from, or "latest" (newest in this run's dir). A run dir
    that is not empty is reused only when resuming one of its own checkpoints or with
    train.overwrite=true."""
    overwrite: bool = False
    """Reuse a run directory that holds an earlier run: its checkpoints, latest/best pointers,
    metrics, exports, summary and tracker logs are removed first (and the removal logged).
    False = such a directory is refused, naming what it holds."""
    max_nonfinite_steps: int = 20
    """Abort after this many optimizer steps skipped for a NaN/inf loss or gradient norm. A
    non-finite micro-batch drops the whole optimizer step it belongs to (as GradScaler does).
    Off DeepSpeed the skip is decided on the device, so the count is read, and this limit
    checked, only every train.log_every steps (and at checkpoints): a run may overshoot it by
    up to log_every - 1 steps. Under DeepSpeed the count is checked at once; ZeRO-3 and fp32
    runs skip a non-finite micro-batch alone."""
    deterministic: bool = False
    """torch deterministic algorithms (bitwise-reproducible resume on CPU)."""
    param_dtype: ParamDtype = ParamDtype.auto
    """Drafter parameter dtype: bf16 (fp32 master weights in the optimizer), fp32, or auto
    (bf16 on CUDA; fp32 on CPU, where bf16 matmuls are emulated and several times slower)."""
    cpu_threads: Optional[int] = None
    """torch intra-op threads per process on CPU; null = cores / processes - 1 (at least 1):
    an OpenMP thread that shares a core with busy work spin-waits and slows everything."""
    peak_tflops: Optional[float] = None
    """Accelerator peak for MFU in TFLOP/s; null = 989 (H100/H200 dense bf16) on CUDA."""
    profile_steps: int = 0
    """Optimizer steps to profile from train.profile_start (0: off): a Chrome trace and a kernel
    table per rank in the run's profile/; each profiled step ends with a device sync."""
    profile_start: int = 10
    """First profiled step, numbered as in metrics.jsonl (>= 1; past compile and warm-up)."""
    dry_run: bool = False
    """Compose the config, start the processes and write the run summary, then stop."""


@dataclass
class ExportConfig:
    enabled: bool = True
    """Export the drafter in layout A at the end of training."""
    every: int = 0
    """Also export every N optimizer steps; 0 = only at the end."""
    speculators_config: bool = False
    """Also write a vLLM speculators-format config next to the export."""
    select: ExportSelect = ExportSelect.best
    """Which weights the end-of-training export holds: `best` = the checkpoint with the highest
    eval decoder-walk τ (`tau_trajectory`; every new best eval is checkpointed), `last` = the
    final step's. Without held-out data (data.eval_fraction=0, no data.eval_dataset) `best`
    falls back to `last` (logged); with train.eval_every=0 the only eval is the final step's,
    so `best` is the final step too."""


@dataclass
class EvalConfig:
    speculative: bool = True
    """After export, run real greedy speculative decoding with the target on held-out prompts."""
    prompts: Optional[str] = None
    """Held-out prompts (messages JSONL); null = the shipped held-out prompts."""
    num_prompts: int = 8
    """How many held-out prompts to decode."""
    engines: bool = True
    """Load the export with vLLM's and SGLang's own loaders when their venvs exist."""
    engine_serve: bool = True
    """After real decoding, serve the export with a real vLLM engine on the same prompts when
    its venv exists (`eyas engines setup --runtime`) and compare vLLM's acceptance counters
    with eyas's (`eyas evaluate --engine vllm`)."""
    max_new_tokens: int = 64
    """Tokens generated per prompt; the trainer's eval also walks each eval-split answer's first
    max_new_tokens tokens (`tau_trajectory_capped`), to compare with real decoding's τ."""
    context_buckets: List[int] = field(default_factory=lambda: list(DEFAULT_EDGES))
    """Edges of the τ-by-context buckets (the position where a round starts; the last bucket is
    open): the trainer's eval logs eval/tau_ctx_<bucket> and keeps eval/by_context."""
    target_device: str = "auto"
    """Where the evaluation's target runs (real decoding, eval.heldout_offline): auto (the GPU
    when there is one, else the CPU), cpu or cuda[:i]. The engine-reference drafter of real
    decoding runs beside the target."""
    processes: int = 1
    """Real decoding in this many processes side by side, the prompts split into parts
    (`train.evaluate.pool`). Each loads its own copy of the target and the drafter once: for
    small targets, whose batch-1 decoding leaves the device mostly idle. The tokens and
    acceptance are those of one process; tokens/s and speedup are measured with the
    processes sharing the machine."""
    heldout_offline: bool = False
    """Also answer the held-out prompts greedily in float32 (the first num_prompts, at most
    heldout_max_new_tokens tokens, else max_new_tokens; cached under data.cache_dir/heldout/),
    extract them and report the export's offline decoder walk on that text: the offline figure
    next to the real one (`heldout_offline` in summary.json)."""
    heldout_max_new_tokens: Optional[int] = None
    """Length of the held-out answers eval.heldout_offline walks (null: max_new_tokens). A
    longer one (e.g. 384) reports the walk over those answers (`tau_trajectory`) and, beside
    it, the walk within each answer's first max_new_tokens tokens (`tau_trajectory_capped`,
    the figure real decoding's τ compares with), from one set of answers."""


@dataclass
class EyasConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run_name: str = "eyas"
    """Name of the run directory runs/<run_name>: run_name=NAME (or an experiment's own) when
    given, else $EYAS_RUN_ID when set, else the start time YYYYmmdd-HHMMSS (rank 0's, on every
    rank of a launch)."""
    output_dir: str = MISSING
    """Where this job writes (set by conf/config.yaml to Hydra's run dir)."""


def register() -> None:
    """The schema for `conf/config.yaml` to extend, and --help's config-group resolver."""
    from eyas.train.hydra_cli import config_groups
    ConfigStore.instance().store(name="eyas_schema", node=EyasConfig)
    OmegaConf.register_new_resolver("eyas_help_groups", config_groups, replace=True)


class ConfigError(ValueError):
    """A configuration value that cannot work, with the override that fixes it."""


def check(cfg: DictConfig | Any) -> None:
    """Cross-field rules that types alone cannot express."""
    def fail(key: str, value: Any, expected: str, fix: str) -> None:
        raise ConfigError(f"{key}={value!r}: expected {expected}. Fix: {fix}")

    # run_name names one directory inside runs/ (train/hydra_cli.py checks it before Hydra
    # makes that directory)
    if (message := run_name_message(cfg.run_name)) is not None:
        raise ConfigError(message)
    check_target(cfg.target, fail)
    check_drafter(cfg.drafter, fail)
    check_data(cfg.data, fail)
    check_optim(cfg.optim, fail, deepspeed=cfg.dist.backend == DistBackend.deepspeed,
                fp32_params=cfg.train.param_dtype == ParamDtype.fp32,
                zero_stage=cfg.dist.zero_stage)
    check_loop(cfg.train, cfg.export, fail)
    check_dist(cfg.dist, cfg.drafter, fail)
    check_trackers(cfg.tracker, fail)
    check_eval(cfg.eval, fail)
    check_loss(cfg.loss, fail)
    # generation, extraction (no data.dataset) and decoding run the model; training reads the
    # embedding and lm_head only
    need = ("model" if cfg.data.dataset is None or cfg.eval.speculative
            or cfg.eval.heldout_offline else "embedding")
    if (why := weights_error(cfg.target.name, need, cfg.data.cache_dir)) is not None:
        raise ConfigError(f"target.name={cfg.target.name!r}: {why}")


def load(cfg: DictConfig) -> EyasConfig:
    """The composed Hydra config, checked, as typed dataclasses (done once, by the entry point)."""
    check(cfg)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def to_plain(cfg: EyasConfig | DictConfig) -> dict:
    """The config as plain Python types, enums as strings (for trackers and records)."""
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True)  # type: ignore[return-value]
