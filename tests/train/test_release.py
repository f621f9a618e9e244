"""train.main's hand-back of a finished stage's memory: after training, nothing accelerate
holds keeps the drafter or its optimizer state alive (the decode workers of the
checks after training need the GPU memory they held)."""

import gc
import weakref

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from eyas.train.main import _release_gpu_memory


def test_release_drops_the_model_and_the_optimizer():
    acc = Accelerator(cpu=True)
    try:
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.AdamW(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)   # as build_optimizer
        model, opt = acc.prepare(model, opt)
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        sched.step()               # its state is saved in eyas_state.json, not held by accelerate
        assert opt.optimizer.state                                         # moments exist
        refs = {name: weakref.ref(o) for name, o in
                (("model", model), ("optimizer", opt.optimizer))}
        del model, opt, sched
        gc.collect()
        assert {n for n, r in refs.items() if r() is not None} == set(refs)  # accelerate holds them
        _release_gpu_memory(acc, "train")
        assert {n for n, r in refs.items() if r() is not None} == set()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
