"""data.produce.engine_capture's host side, against transformers, without an engine.

The engine hands eyas the residual stream entering the aux layers and the stream after the last
layer BEFORE the final norm (vLLM's id N). eyas turns the latter into the teacher with the
target's own norm and head, read from the checkpoint files alone. Here the engine's file is
made from a transformers forward (hooks on the norm's input), so the expected values are the
model's own: `hidden_states[-1]` and the argmax of its logits.
"""

from __future__ import annotations

import pytest
import torch

from eyas.data.common.capture import ExtractError, target_fingerprint
from eyas.data.produce.engine_capture import TargetHead, sample_features
from eyas.data.common.targets import load_target, resolve_target

pytestmark = pytest.mark.usefixtures("one_thread")
AUX = [2, 4, 5]


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_target("tiny-llama", dtype=torch.float32)
    return model, TargetHead(resolve_target("tiny-llama"), "float32")


def _engine_file(model, ids: torch.Tensor) -> tuple[dict, object]:
    """What vLLM's connector writes for `ids` (ids AUX + N), and transformers' own output."""
    seen = {}
    hook = model.model.norm.register_forward_pre_hook(
        lambda m, args: seen.update(pre=args[0].detach()))
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    hook.remove()
    hs = torch.stack([out.hidden_states[k][0] for k in AUX] + [seen["pre"][0]], dim=1)
    return {"hidden_states": hs, "token_ids": ids.clone()}, out


def test_head_and_fingerprint_read_from_files_equal_the_model(tiny):
    model, head = tiny
    assert torch.equal(head.norm.weight, model.model.norm.weight)
    assert torch.equal(head.head.weight, model.lm_head.weight)
    assert head.num_layers == 8
    assert head.fingerprint() == target_fingerprint(model)


def test_the_last_state_goes_through_the_final_norm(tiny):
    model, head = tiny
    ids = torch.randint(3, 4000, (37,), generator=torch.Generator().manual_seed(0))
    states, out = _engine_file(model, ids)
    sample = {"input_ids": ids, "loss_mask": torch.ones(37, dtype=torch.bool)}
    f = sample_features(states, sample, head, name="s0", n_aux=3, teacher="both", topk=4)
    assert torch.equal(f["aux"], torch.stack([out.hidden_states[k][0] for k in AUX], dim=1))
    torch.testing.assert_close(f["last"], out.hidden_states[-1][0], rtol=0, atol=0)
    assert torch.equal(f["target_argmax"], out.logits[0].argmax(-1))
    assert torch.equal(f["topk_ids"][:, 0], f["target_argmax"])
    torch.testing.assert_close(f["topk_logits"][:, 0], out.logits[0].max(-1).values)


def test_token_ids_the_engine_changed_are_refused_by_name(tiny):
    model, head = tiny
    ids = torch.arange(10, 30)
    states, _ = _engine_file(model, ids)
    states["token_ids"][7] += 1
    sample = {"input_ids": ids, "loss_mask": torch.ones(20, dtype=torch.bool)}
    with pytest.raises(ExtractError, match=r"tokens/ sample 3: the engine's token ids differ "
                                           r"from the stored ones \(first at position 7\)"):
        sample_features(states, sample, head, name="tokens/ sample 3", n_aux=3, teacher="last",
                        topk=0)
    states["token_ids"] = states["token_ids"][:12]
    with pytest.raises(ExtractError, match="lengths 12 vs 20"):
        sample_features(states, sample, head, name="s", n_aux=3, teacher="last", topk=0)


def test_a_truncated_engine_file_is_one_line_naming_it(tmp_path):
    from safetensors.torch import save_file

    from eyas.data.produce.engine_capture import take_states
    path = tmp_path / "req-7.safetensors"
    save_file({"hidden_states": torch.zeros(5, 4, 8), "token_ids": torch.arange(5)}, str(path))
    path.write_bytes(path.read_bytes()[:-40])          # the writer died mid-file
    with pytest.raises(ExtractError) as e:
        take_states(path, "sample 7")
    assert str(e.value).startswith(f"sample 7: {path}: the engine's hidden-states file is "
                                   f"unreadable (")
    assert str(e.value).endswith("; capture it again (the same command resumes)")
    assert "\n" not in str(e.value)
