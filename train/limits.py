"""Ranges of single config values, and the trackers a run can use, for `train.config.check`
(which passes its `fail`). The values refused, and why: docs/configuration.md, "Values that
are refused"; where 0 means something (off, or "only at the end"), the schema docstring says
so and 0 is accepted.

`MAX_TTT_STEPS` bounds the TTT unroll. Each step adds a full decoder layer's activations
(and, with the torch loss, a [T, draft_vocab] logits block) for the backward, so memory and
time grow linearly in K, while the loss weight of step k is step_weight**k (0.8**64 ≈ 6e-7
with the default: later steps train nothing measurable) and serving engines propose a
handful of draft tokens (num_speculative_tokens <= K; EAGLE-3 trains K=7).
`train.trainer` also estimates the unroll's activation memory before training and refuses
a K that cannot fit (`ttt_activation_bytes`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from eyas.data.common.settings import DTYPE_CHOICES
from eyas.data.common.targets import AUX_IDS_RULE, aux_layer_ids_error
from eyas.models.context import check_edges
from eyas.train.choices import TRACKER_PACKAGES, DistBackend, FP8Recipe, WandbMode

Fail = Callable[[str, Any, str, str], None]

MAX_TTT_STEPS = 64

RUN_NAME_RULE = ("a name, not a path: letters, digits, '_', '.', '-', '+', '=' and '@', "
                 "starting with a letter, digit or '_', at most 128 characters")
_RUN_NAME = re.compile(r"\w[\w.+=@-]{0,127}")


def run_name_error(name: Any) -> str | None:
    """Why `name` cannot be a run_name (runs/<run_name> is one directory inside runs/), or
    None. A directory elsewhere is hydra.run.dir's to pick."""
    if isinstance(name, str) and _RUN_NAME.fullmatch(name):
        return None
    return RUN_NAME_RULE


def run_name_message(name: Any) -> str | None:
    """The one-line refusal of a `name` that cannot be a run_name, with the fix, or None."""
    if (why := run_name_error(name)) is None:
        return None
    return (f"run_name={name!r}: expected {why}. Fix: run_name=my-run (or EYAS_RUN_ID=my-run); "
            f"to write the run elsewhere, hydra.run.dir=DIR")


def _floors(group, prefix: str, floors, fail: Fail) -> None:
    """Refuse a value below its floor: `floors` holds (field of `group`, least value, what is
    expected, the value the fix sets); `prefix` is the group's key."""
    for name, least, expected, fixed in floors:
        if (value := getattr(group, name)) < least:
            fail(f"{prefix}.{name}", value, expected, f"{prefix}.{name}={fixed}")


_DATA_FLOORS = (
    ("token_budget", 16, ">= 16", "2048"),
    ("num_prompts", 1, "an integer >= 1 (shipped prompts the embedded default answers)", "96"),
    ("num_workers", 0, "an integer >= 0 (0: no prefetch threads)", "2"),
    ("samples_per_prompt", 1, "an integer >= 1", "1"),
    ("endpoint_concurrency", 1, "an integer >= 1", "8"),
    ("synthetic_prompts", 0, "an integer >= 0", "0"),
    ("synthetic_opener_words", 0, "an integer >= 0", "2 (or 0: no openers)"),
    ("synthetic_examples", 0, "an integer >= 0", "4 (or 0: no example lists)"))


def check_data(data, fail: Fail) -> None:
    """The data group: read checks, budget, eval split, embedded-default sampling, endpoint."""
    if data.nonfinite not in ("raise", "skip"):
        fail("data.nonfinite", data.nonfinite, "raise or skip", "data.nonfinite=raise")
    if data.capture == "endpoint" and not data.capture_endpoint:
        fail("data.capture_endpoint", None, "the capturing server's URL with data.capture="
             "endpoint", "data.capture_endpoint=http://HOST:8000/v1")
    if data.vocab_count not in ("auto", "target_argmax", "next_token", "masked_token"):
        fail("data.vocab_count", data.vocab_count, "auto, target_argmax, next_token or "
             "masked_token", "data.vocab_count=auto")
    if data.stream.enabled and (data.stream.ahead < 1 or data.stream.spool_bytes < 1):
        fail("data.stream.ahead", data.stream.ahead, ">= 1 (and spool_bytes >= 1)",
             "data.stream.ahead=256")
    _floors(data, "data", _DATA_FLOORS, fail)
    if not 0.0 <= data.eval_fraction < 1.0:
        fail("data.eval_fraction", data.eval_fraction, "in [0, 1)", "data.eval_fraction=0.05")
    if data.samples_per_prompt > 1 and data.temperature <= 0:
        fail("data.temperature", data.temperature, "> 0 when data.samples_per_prompt > 1 "
             "(answers after the first are sampled)", "data.temperature=0.7")
    if data.synthetic_prompts > 0 and data.synthetic_temperature <= 0:
        fail("data.synthetic_temperature", data.synthetic_temperature,
             "> 0 (prompts are sampled)", "data.synthetic_temperature=1.0")
    if not 0.0 < data.top_p <= 1.0:
        fail("data.top_p", data.top_p, "in (0, 1]", "data.top_p=0.95")


def check_target(target, fail: Fail) -> None:
    """The aux layer ids (`data.common.targets.AUX_IDS_RULE`) and the target's dtype."""
    ids = target.aux_layer_ids
    if ids is not None and aux_layer_ids_error(ids) is not None:
        fail("target.aux_layer_ids", list(ids), f"{AUX_IDS_RULE} ({aux_layer_ids_error(ids)})",
             "target.aux_layer_ids=[2,16,29] (or null for 2, N//2, N-3)")
    if target.dtype not in DTYPE_CHOICES:
        fail("target.dtype", target.dtype, f"one of {list(DTYPE_CHOICES)}", "target.dtype=auto")


def check_drafter(drafter, fail: Fail) -> None:
    """A draft vocabulary of two tokens or more, drafter.ttt_steps in [1, MAX_TTT_STEPS] (module
    doc: where the bound comes from), and drafter.fp8_layers naming the drafter's linear
    layers."""
    from eyas.models.fp8 import DEFAULT_FP8_LAYERS, fp8_layers_error
    if drafter.draft_vocab_size < 2:
        fail("drafter.draft_vocab_size", drafter.draft_vocab_size, ">= 2",
             "drafter.draft_vocab_size=32000")
    K = drafter.ttt_steps
    if not 1 <= K <= MAX_TTT_STEPS:
        fail("drafter.ttt_steps", K, f"an integer in [1, {MAX_TTT_STEPS}] (each step adds a "
             f"decoder layer's activations; the loss weight of step k is loss.step_weight**k, "
             f"and engines serve at most K draft tokens)", "drafter.ttt_steps=7")
    why = fp8_layers_error(drafter.fp8_layers)
    if why is not None:
        fail("drafter.fp8_layers", list(drafter.fp8_layers), why,
             f"drafter.fp8_layers=[{','.join(DEFAULT_FP8_LAYERS)}] (the default)")
    fp8_qkv = FP8Recipe(drafter.fp8) != FP8Recipe.off and any(
        n in drafter.fp8_layers for n in ("q_proj", "k_proj", "v_proj"))
    if drafter.fp8_split_qkv and not (fp8_qkv and drafter.embedding_qkv_once):
        fail("drafter.fp8_split_qkv", True, "only with drafter.fp8 on, q/k/v among "
             "drafter.fp8_layers and drafter.embedding_qkv_once=true (it splits their FP8 "
             "GEMMs)", "drafter.fp8_split_qkv=false, or drafter.fp8=tensorwise")


_LOOP_FLOORS = (
    ("log_every", 1, "an integer >= 1 (the non-finite step limit is also checked at that "
     "interval)", "10"),
    ("keep_last", 1, "an integer >= 1", "2"),
    ("max_nonfinite_steps", 0, "an integer >= 0 (0 = abort at the first skipped step)", "20"),
    ("profile_steps", 0, "an integer >= 0 (0 = off)", "3"),
    ("profile_start", 1, "an integer >= 1 (steps are numbered from 1, as in metrics.jsonl)",
     "10"))


def check_loop(train, export, fail: Fail) -> None:
    """The loop's counts and intervals: no negative interval, no max_steps=0."""
    if train.overwrite and train.resume == "latest":
        fail("train.overwrite", True, "false with train.resume=latest (overwrite removes the "
             "checkpoints that resume would continue from)",
             "drop train.overwrite=true to resume, or train.resume=null to start over")
    if train.epochs < 1 and train.max_steps is None:
        fail("train.epochs", train.epochs, ">= 1 (or set train.max_steps)", "train.epochs=1")
    if train.max_steps is not None and train.max_steps < 1:
        fail("train.max_steps", train.max_steps, "an integer >= 1, or null (train.epochs "
             "decides)", "train.max_steps=100 (or train.max_steps=null)")
    _floors(train, "train", _LOOP_FLOORS, fail)
    for key, value in (("train.eval_every", train.eval_every),
                       ("train.save_every", train.save_every), ("export.every", export.every)):
        if value < 0:
            fail(key, value, "an integer >= 0 (0 = only at the end)", f"{key}=0 or {key}=1000")
    if train.cpu_threads is not None and train.cpu_threads < 1:
        fail("train.cpu_threads", train.cpu_threads, "an integer >= 1, or null (cores / "
             "processes - 1)", "train.cpu_threads=null")


def check_dist(dist, drafter, fail: Fail) -> None:
    """The backend's ZeRO stage and what ZeRO-3 cannot run (compiled graphs, views of gathered
    weights, float8 linears)."""
    deepspeed = dist.backend == DistBackend.deepspeed
    if deepspeed and dist.zero_stage not in (1, 2, 3):
        fail("dist.zero_stage", dist.zero_stage, "1, 2 or 3 with backend=deepspeed",
             "dist=zero2 (or dist.zero_stage=2)")
    if deepspeed and dist.zero_stage == 3:
        why = {"compile": "ZeRO-3 gathers its partitioned weights in module hooks, which "
                          "compiled graphs bypass",
               "embedding_qkv_once": "its q/k/v views would hold ZeRO-3's gathered weights from "
                                     "the forward to the backward"}
        for key, reason in why.items():
            if getattr(drafter, key):
                fail(f"drafter.{key}", True, f"false under ZeRO-3 ({reason})",
                     f"drafter.{key}=false (dist=zero3 sets it), or dist=zero2")
        if drafter.fp8 != FP8Recipe.off:
            fail("drafter.fp8", drafter.fp8.value, "off under ZeRO-3 (its partitioned weights "
                 "bypass the float8 linears)", "dist=zero2 (or drafter.fp8=off)")
    if not deepspeed and dist.zero_stage != 0:
        fail("dist.zero_stage", dist.zero_stage, "0 with backend=ddp",
             f"dist=zero{dist.zero_stage} to use DeepSpeed ZeRO-{dist.zero_stage}, "
             f"or dist.zero_stage=0")
    if not deepspeed and dist.deepspeed_config is not None:
        fail("dist.deepspeed_config", dist.deepspeed_config, "null with dist=ddp (DDP reads "
             "no DeepSpeed JSON)", "dist=zero2 (the JSON's ZeRO stage) or dist.deepspeed_config=null")


def check_loss(loss, fail: Fail) -> None:
    """The objective's weights."""
    if loss.step_weight <= 0:
        fail("loss.step_weight", loss.step_weight, "> 0", "loss.step_weight=0.8")
    mix = loss.mix
    weights = {k: getattr(mix, k) for k in ("kl", "tv", "lk_alpha", "lk_lambda")}
    if min(weights.values()) < 0 or max(weights.values()) <= 0:
        fail("loss.mix", weights, "weights >= 0, at least one > 0",
             "loss.mix.kl=0.5 loss.mix.tv=0.5")
    if loss.lk_eta < 0:
        fail("loss.lk_eta", loss.lk_eta, ">= 0", "loss.lk_eta=3.0")


def check_optim(optim, fail: Fail, *, deepspeed: bool = False, fp32_params: bool = False,
                zero_stage: int | None = None) -> None:
    """Optimizer values out of range, and bf16 moments where no master-weight update runs."""
    if optim.lr <= 0:
        fail("optim.lr", optim.lr, "> 0", "optim.lr=1e-4")
    if len(optim.betas) != 2 or not all(0 <= b < 1 for b in optim.betas):
        fail("optim.betas", list(optim.betas), "two values in [0, 1)", "optim.betas=[0.9,0.95]")
    if optim.grad_accum < 1:
        fail("optim.grad_accum", optim.grad_accum, ">= 1", "optim.grad_accum=1")
    if not 0.0 <= optim.warmup_ratio < 1.0:
        fail("optim.warmup_ratio", optim.warmup_ratio, "in [0, 1)", "optim.warmup_ratio=0.015")
    moments = getattr(optim.moments, "value", optim.moments)
    if moments != "fp32" and deepspeed:
        fail("optim.moments", moments, "fp32 under DeepSpeed (its engine keeps its own fp32 "
             "optimizer state)", "optim.moments=fp32, or dist=ddp")
    if moments != "fp32" and fp32_params:
        fail("optim.moments", moments, "fp32 with train.param_dtype=fp32 (bf16 moments belong "
             "to the master-weight update of bf16 parameters)",
             "optim.moments=fp32, or train.param_dtype=bf16")
    if optim.clip_grad_norm < 0:
        fail("optim.clip_grad_norm", optim.clip_grad_norm, ">= 0 (0 = no clipping)",
             "optim.clip_grad_norm=0.5 (or 0 to disable clipping)")
    if optim.warmup_steps is not None and optim.warmup_steps < 0:
        fail("optim.warmup_steps", optim.warmup_steps, "an integer >= 0, or null (then "
             "optim.warmup_ratio decides)", "optim.warmup_steps=0 (no warmup) or null")
    check_muon(optim, fail, deepspeed=deepspeed, zero_stage=zero_stage)


def check_muon(optim, fail: Fail, *, deepspeed: bool, zero_stage: int | None = None) -> None:
    """optim=muon's own values, and under DeepSpeed what its ZeRO-1/2 Muon cannot honour
    (ZeRO-3 refused; train/muon.py). zero_stage: the ZeRO stage (None: unknown, as 3)."""
    if getattr(optim, "name", "adamw") != "muon":           # a str Enum equals its value
        return
    zero = f"dist=zero{zero_stage}" if zero_stage else "DeepSpeed ZeRO"
    if deepspeed and zero_stage not in (1, 2):
        fail("optim.name", "muon", "adamw under DeepSpeed ZeRO-3 (eyas runs DeepSpeed's Muon "
             "under ZeRO-1/2 only; its ZeRO-3 path is not wired up or tested here)",
             "dist=zero2 or dist=ddp (optim=muon runs there), or optim=adamw")
    if deepspeed and optim.clip_grad_norm > 0:
        fail("optim.clip_grad_norm", optim.clip_grad_norm, f"0 with optim=muon under {zero} "
             "(DeepSpeed clips the orthogonalised Muon update, whose norm does not follow the "
             "gradient's, so any clip would shrink Muon's steps)",
             "optim.clip_grad_norm=0, or dist=ddp (which clips the gradients)")
    if deepspeed and not optim.muon_nesterov:
        fail("optim.muon_nesterov", optim.muon_nesterov, f"true under {zero} (DeepSpeed's "
             "ZeRO Muon always uses Nesterov momentum)", "optim.muon_nesterov=true, or dist=ddp")
    if deepspeed and optim.muon_ns_steps != 5:
        fail("optim.muon_ns_steps", optim.muon_ns_steps, f"5 under {zero} (DeepSpeed's ZeRO "
             "Muon always runs 5 Newton-Schulz steps)", "optim.muon_ns_steps=5, or dist=ddp")
    if optim.muon_lr is not None and optim.muon_lr <= 0:
        fail("optim.muon_lr", optim.muon_lr, "> 0, or null (= optim.lr)", "optim.muon_lr=null")
    if optim.muon_weight_decay is not None and optim.muon_weight_decay < 0:
        fail("optim.muon_weight_decay", optim.muon_weight_decay,
             ">= 0, or null (= optim.weight_decay)", "optim.muon_weight_decay=null")
    if not 0.0 <= optim.muon_momentum < 1.0:
        fail("optim.muon_momentum", optim.muon_momentum, "in [0, 1)", "optim.muon_momentum=0.95")
    if not 1 <= optim.muon_ns_steps <= 99:
        fail("optim.muon_ns_steps", optim.muon_ns_steps, "1..99", "optim.muon_ns_steps=5")


def ttt_activation_bytes(config, tokens: int, bytes_per_value: int, eager_attention: bool,
                         torch_loss: bool) -> int:
    """A lower-bound estimate of what the TTT unroll keeps for the backward, in bytes.

    Per step and token: the layer's inputs and outputs (embedding, feedback, attention and
    MLP residuals, norms: ~10·H), q/k/v and the attention output, and the SwiGLU's four [I]
    activations. Eager attention keeps the fp32 probabilities of step k over all k+1 key
    blocks, [heads, T, T·(k+1)], so its share grows with K²; the torch loss keeps [T, Vd] fp32
    logits and probabilities per step. Buffers freed before the backward, the flex kernels'
    own and the allocator's slack are not counted."""
    c, T, K = config, int(tokens), int(config.ttt_steps)
    qkv = (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    per_row = (10 * c.hidden_size + qkv + 4 * c.intermediate_size) * bytes_per_value
    total = K * T * per_row
    if eager_attention:
        total += c.num_attention_heads * T * T * 4 * K * (K + 1) // 2
    if torch_loss:
        total += K * 2 * T * c.draft_vocab_size * 4
    return int(total)


def ttt_memory_error(config, tokens: int, resolved, device) -> str | None:
    """A one-line reason when the TTT unroll's estimated activations (`ttt_activation_bytes`,
    for one micro-batch of `tokens`) exceed the memory `device` has free, else None."""
    import torch
    width = torch.finfo(resolved.param_dtype).bits // 8
    need = ttt_activation_bytes(config, tokens, width, resolved.attention == "eager",
                                resolved.loss_impl == "torch")
    device = torch.device(device)     # the GPU's free memory, else the host's available
    if device.type == "cuda":
        free, where = torch.cuda.mem_get_info(device)[0], f"{device} has"
    else:
        import psutil
        free, where = psutil.virtual_memory().available, "this host has"
    if need <= free:
        return None
    gib = 2 ** 30
    return (f"drafter.ttt_steps={config.ttt_steps}: the TTT unroll keeps about "
            f"{need / gib:.1f} GiB of activations for a micro-batch of data.token_budget="
            f"{tokens} tokens ({resolved.attention} attention, {resolved.loss_impl} loss; "
            f"estimate of train/limits.py) but {where} {free / gib:.1f} GiB free. Fix: lower "
            f"drafter.ttt_steps (EAGLE-3 trains 7) or data.token_budget")


def _installed(dists) -> bool:
    from importlib.metadata import PackageNotFoundError, version
    for d in dists:
        try:
            version(d)
            return True
        except PackageNotFoundError:
            pass
    return False


def wandb_key_available() -> bool:
    """WANDB_API_KEY, or a netrc entry for the wandb host (what `wandb login` writes)."""
    import netrc
    import os
    from urllib.parse import urlparse
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


_EVAL_FLOORS = (
    ("num_prompts", 1, "an integer >= 1 (held-out prompts to decode; eval.speculative=false "
     "turns real decoding off)", "8"),
    ("processes", 1, "an integer >= 1", "1"),
    ("max_new_tokens", 1, "an integer >= 1", "64"))


def check_eval(ev, fail: Fail) -> None:
    """The eval group: context buckets, the evaluation's device, decoding processes, lengths."""
    try:
        check_edges(ev.context_buckets)
    except ValueError:
        fail("eval.context_buckets", list(ev.context_buckets), "increasing integer "
             "positions starting at 0", "eval.context_buckets=[0,2048,8192,16384,32768]")
    dev = str(ev.target_device)
    if dev not in ("auto", "cpu", "cuda") and not (dev.startswith("cuda:") and dev[5:].isdigit()):
        fail("eval.target_device", dev, "auto, cpu, cuda or cuda:<index>",
             "eval.target_device=auto")
    _floors(ev, "eval", _EVAL_FLOORS, fail)
    if ev.prompts and (ev.speculative or ev.heldout_offline) \
            and not Path(ev.prompts).expanduser().is_file():
        fail("eval.prompts", ev.prompts, "an existing messages JSONL file, or null (the "
             "shipped held-out prompts)", "eval.prompts=null")
    longer = ev.heldout_max_new_tokens
    if longer is not None and longer < ev.max_new_tokens:
        fail("eval.heldout_max_new_tokens", longer,
             f"null or an integer >= eval.max_new_tokens ({ev.max_new_tokens})",
             f"eval.heldout_max_new_tokens={3 * ev.max_new_tokens}")


def check_trackers(tracker, fail: Fail) -> None:
    """tracker.kind: known, installed, each once; tracker.mode=online needs a wandb key."""
    kinds = list(tracker.kind)
    for kind in kinds:
        if kind not in TRACKER_PACKAGES:
            fail("tracker.kind", kinds, f"names from {sorted(TRACKER_PACKAGES)}",
                 "tracker=wandb, tracker=tensorboard, tracker=none or tracker.kind=[mlflow]")
        if not _installed(TRACKER_PACKAGES[kind]):
            fail("tracker.kind", kinds, f"installed trackers ({kind} is not installed)",
                 f"pip install {TRACKER_PACKAGES[kind][0]}, or drop {kind} from tracker.kind")
    if len(set(kinds)) != len(kinds):
        fail("tracker.kind", kinds, "each tracker once",
             f"tracker.kind=[{','.join(dict.fromkeys(kinds))}]")
    if "wandb" in kinds and tracker.mode == WandbMode.online and not wandb_key_available():
        fail("tracker.mode", "online", "a wandb API key (WANDB_API_KEY unset, no netrc entry)",
             "wandb login, export WANDB_API_KEY=..., or tracker.mode=offline")
