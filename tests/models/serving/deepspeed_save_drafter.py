"""Save a tiny drafter as a real multi-process DeepSpeed ZeRO checkpoint (used by test_export.py).

    accelerate launch --use_deepspeed --zero_stage 3 --num_processes 2 \
        tests/models/serving/deepspeed_save_drafter.py OUT_DIR STAGE

Takes one optimizer step so the saved weights differ from the seeded init, then writes
OUT_DIR/ckpt (accelerate save_state + eyas_state.json) and OUT_DIR/reference.safetensors (the
full parameters gathered from every rank, for comparison).
"""

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import DistributedType, InitProcessGroupKwargs
from safetensors.torch import save_file

from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.data.common.targets import load_target_config


def main(out: Path, stage: int) -> None:
    ds = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 1,
          "gradient_accumulation_steps": 1, "bf16": {"enabled": False},
          "steps_per_print": 10**9}
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds),
                      kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    assert acc.num_processes == 2 and acc.distributed_type == DistributedType.DEEPSPEED, \
        (acc.num_processes, acc.distributed_type)
    cfg = Eagle3Config.from_target(load_target_config("tiny-llama"), draft_vocab_size=512,
                                   ttt_steps=2)
    torch.manual_seed(0)
    # as the trainer builds it under ZeRO-3 (conf/dist/zero3.yaml): q/k/v run their own forward
    drafter = Eagle3Drafter(cfg, attention="eager", embedding_qkv_once=False).to(torch.bfloat16)
    ids = torch.randperm(cfg.vocab_size)[:512].sort().values
    drafter.set_vocab_map(ids - torch.arange(512))
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(drafter, opt)

    g = torch.Generator().manual_seed(1 + acc.process_index)
    T = 12
    out_ = model(torch.randint(0, cfg.vocab_size, (T,), generator=g),
                 torch.randn(T, 3 * cfg.target_hidden_size, generator=g).to(torch.bfloat16),
                 torch.zeros(T, dtype=torch.int32), torch.arange(T), 2)
    acc.backward(out_.hidden.float().pow(2).mean())
    opt.step()
    opt.zero_grad()

    import deepspeed
    params = list(model.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=stage == 3):
        if acc.is_main_process:
            ref = {k: v.detach().clone().contiguous() for k, v in model.module.state_dict().items()}
            save_file(ref, out / "reference.safetensors")
    acc.wait_for_everyone()
    acc.save_state(str(out / "ckpt"))
    if acc.is_main_process:
        state = {"step": 1, "drafter": cfg.to_dict(),
                 "objective": {"drafter.ttt_steps": cfg.ttt_steps, "world_size": 2}}
        (out / "ckpt" / "eyas_state.json").write_text(json.dumps(state))
    acc.wait_for_everyone()
    acc.end_training()             # as the trainer does: the process group is destroyed


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
    # Every file is written. Under CPU load, a native thread of the gloo/DeepSpeed stack
    # sometimes aborts the interpreter's own teardown ("terminate called without an active
    # exception", SIGABRT, no Python frame left): skip that teardown, which this helper does
    # not test, so the exit status is the script's.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

