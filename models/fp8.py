"""FP8 training of the drafter's linear layers through torchao's float8 training.

    convert_drafter_to_float8(drafter, "tensorwise")

swaps the q/k/v/o projections and the gate/up/down projections (and `fc` when
`drafter.fp8_layers` names it) for torchao's `Float8Linear`: the forward GEMM runs in e4m3
and the two backward GEMMs in e4m3/e5m2 with dynamic scales (one per tensor for
"tensorwise", one per row for "rowwise"). Parameters stay in their dtype (bf16) under their
own names, so checkpoints, the optimizer and the export are unchanged; only the GEMM inputs
are cast, inside the step's compiled graphs when `drafter.compile` is on. The lm_head stays as
it is: the fused loss applies it (its GEMMs run in bf16 with fp32 accumulation, the
fused-loss tolerance).

torchao is the library choice here (`pip install 'eyas[fp8]'`): its casts fuse into the
compiled graphs around cuBLAS' FP8 GEMMs, and its recipes are the ones large trainings use.
On the H200 "tensorwise" is the fast recipe at the drafter's shapes; "rowwise" keeps more
precision per row at a cost there. On a CPU the same code runs through torch's FP8 emulation
(tests only: it is not faster there).
"""

from __future__ import annotations

import logging

import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

RECIPES = ("off", "tensorwise", "rowwise")
#: the drafter's linear layers that can train in FP8 (module names in `Eagle3Drafter`)
FP8_LAYERS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: those that do by default (`drafter.fp8_layers`): all but `fc`, the layer that reads the
#: target's raw aux states. On the SmolLM2 quality recipe this default trained within 0.2 % of
#: bf16's held-out τ (all eight lost 3.3 % in a smaller run), and at the Llama-8B shape it
#: steps as fast as all eight (benchmarks/README.md, "Levers side by side").
DEFAULT_FP8_LAYERS = FP8_LAYERS[1:]


def fp8_layers_error(layers) -> str | None:
    """Why `layers` cannot be `drafter.fp8_layers`, or None: a non-empty list of distinct
    names from FP8_LAYERS."""
    names = list(layers)
    unknown = [n for n in names if n not in FP8_LAYERS]
    if not names or unknown or len(set(names)) != len(names):
        return (f"a non-empty list of distinct names from {list(FP8_LAYERS)}"
                + (f" ({unknown} are not)" if unknown else ""))
    return None


def fp8_layer(name: str, layers) -> bool:
    """Whether the module at dotted path `name` is one of `layers` (by its last name part)."""
    return name.rsplit(".", 1)[-1] in layers


def convert_drafter_to_float8(drafter: nn.Module, recipe: str,
                              layers=DEFAULT_FP8_LAYERS) -> list[str]:
    """Swap the drafter's linear layers named in `layers` (default: all but `fc`) for
    float8 training linears in place; the others keep their bf16 GEMMs.

    recipe: "tensorwise" or "rowwise" (torchao's recipe names; "off" does nothing). Returns the
    converted module names. Every converted layer needs both dimensions divisible by 16 (the
    FP8 GEMM's alignment); the error names the layer and its shape otherwise."""
    if recipe not in RECIPES:
        raise ValueError(f"drafter.fp8={recipe!r}; choose one of {RECIPES}")
    why = fp8_layers_error(layers)
    if why is not None:
        raise ValueError(f"drafter.fp8_layers={list(layers)}; expected {why}")
    if recipe == "off":
        return []
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError(f"drafter.fp8={recipe} needs torchao (pip install 'eyas[fp8]' or "
                          f"pip install torchao); or train with drafter.fp8=off") from e
    names = []
    for name, module in drafter.named_modules():
        if isinstance(module, nn.Linear) and fp8_layer(name, layers):
            out_f, in_f = module.weight.shape
            if in_f % 16 or out_f % 16:
                raise ValueError(f"drafter.fp8={recipe}: layer {name} has weight [{out_f}, "
                                 f"{in_f}]; FP8 GEMMs need both dimensions divisible by 16 "
                                 f"(change the drafter shape or set drafter.fp8=off)")
            names.append(name)
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(drafter, config=config,
                               module_filter_fn=lambda module, name: fp8_layer(name, layers))
    log.info("FP8 training (%s): %s", recipe, ", ".join(names))
    return names


def is_float8_linear(module: nn.Module) -> bool:
    """Whether `module` is a torchao float8 training linear (`convert_drafter_to_float8`)."""
    return type(module).__name__ == "Float8Linear" and isinstance(module, nn.Linear)


def fp8_linear(x, weight, like: nn.Module):
    """x @ weightᵀ computed as the linear module `like` computes its own: with its FP8 GEMMs
    (forward and both backward GEMMs, dynamic scales of x and of `weight` itself) when it is a
    float8 training linear, else a plain `F.linear`. `weight` may be part of `like.weight`,
    e.g. the hidden half of a q/k/v projection (`models.layer.attention_inputs_split`).

    torchao's own float8 matmul is called as `Float8Linear.forward` calls it, on this weight."""
    if not is_float8_linear(like):
        return F.linear(x, weight)
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    return matmul_with_hp_or_float8_args.apply(x, weight.t(), like.linear_mm_config, like.config)
