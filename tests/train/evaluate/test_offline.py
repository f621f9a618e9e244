"""Offline evaluation (train.evaluate.offline): τ by hand, against a brute-force decoder walk, against the
trainer's own counts, across ranks, and the `eyas evaluate` CLI in both modes."""

import json
import random
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from eyas.data.store.dataset import open_dataset
from eyas.data.store.loader import PackedLoader
from eyas.data.produce.prompts import prompts_path
from eyas.models.serving.export import export_drafter
from eyas.models.context import DEFAULT_EDGES, context_scalars, context_table
from eyas.models.metrics import COUNT_KEYS, accept_counts, chain_counts, summarize, tau_curves
from eyas.models.objective import metric_mask
from eyas.data.common.targets import load_embedding_and_head, load_target_config
from eyas.models.ttt import structural_valid
from eyas.train.evaluate.offline import draft_argmax, offline_eval
from eyas.train.cli import call
from eyas.train.step import TrainingModule, batch_inputs

cli_main = partial(call, "evaluate")

K = 3

pytestmark = pytest.mark.usefixtures("one_thread")


def _pattern(T, loss_mask, correct, doc_ids=None):
    """Inputs of chain_counts realising a correctness table {(k, t): bool} (unlisted: wrong)."""
    doc_ids = torch.zeros(T, dtype=torch.int32) if doc_ids is None else doc_ids
    mask = metric_mask(structural_valid(doc_ids, K), torch.tensor(loss_mask, dtype=torch.bool))
    target = torch.arange(T) % 7 + 10                                    # target ids 10..16
    shifted = torch.stack([torch.cat([target[1 + k:], torch.zeros(1 + k, dtype=torch.long)])
                           for k in range(K)])                           # argmax at t+1+k
    draft = shifted + 20                                                 # wrong everywhere...
    for (k, t), ok in correct.items():
        if ok:
            draft[k, t] = shifted[k, t]                                  # ...except listed rows
    return draft, torch.zeros(64, dtype=torch.long), target, mask


# one document, prompt 0..3, assistant tokens 4..9; chain starts t = 3..8.
# correct(k, t) below; L(t) = 3, 1, 0, 2, 2 (step 2 of t=7 leaves the text), 1
HAND_LOSS_MASK = [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
HAND_TABLE = {(0, 3): 1, (0, 4): 1, (0, 5): 0, (0, 6): 1, (0, 7): 1, (0, 8): 1,
              (1, 2): 1, (1, 3): 1, (1, 4): 0, (1, 5): 1, (1, 6): 1, (1, 7): 1,
              (2, 1): 0, (2, 2): 0, (2, 3): 1, (2, 4): 1, (2, 5): 1, (2, 6): 0}


def test_tau_by_hand():
    c = chain_counts(*_pattern(10, HAND_LOSS_MASK, HAND_TABLE))
    assert c["total"].tolist() == [6, 6, 6]
    assert c["correct"].tolist() == [5, 5, 3]
    assert c["cond_correct"].tolist() == [5, 3, 1]
    assert c["cond_total"].tolist() == [6, 4, 2]
    assert int(c["chain_starts"]) == 6
    r = {**summarize(c), **tau_curves(c)}
    assert [r[f"acc_{k}"] for k in range(3)] == pytest.approx([5 / 6, 5 / 6, 3 / 6])
    assert [r[f"cond_acc_{k}"] for k in range(3)] == pytest.approx([5 / 6, 3 / 4, 1 / 2])
    assert r["tau_by_k"] == pytest.approx([11 / 6, 14 / 6, 15 / 6])     # (6 + Σ min(L, K')) / 6
    assert r["tau"] == r["tau_by_k"][-1]
    assert r["tau_independent_by_k"] == pytest.approx(
        [1 + 5 / 6, 1 + 5 / 6 + 25 / 36, 1 + 5 / 6 + 25 / 36 + 25 / 72])
    # decoder walk: token 4 comes from the prefill, rounds emit 5..9, each counted as the
    # engines count it: 1 + accepted drafts (also those past the span's end).  K'=1: t=3 (1),
    # t=5 (0), t=6 (1) -> 3 rounds; K'=2: t=3 (2), t=6 (2: tokens 8, 9); K'=3: t=3 (3),
    # t=7 (2: token 9 and token 10, the target's argmax after the span)
    assert c["traj_rounds"].tolist() == [3, 2, 2]
    assert c["traj_accepted"].tolist() == [2, 4, 5]
    assert r["tau_trajectory_by_k"] == pytest.approx([1 + 2 / 3, 3.0, 3.5])
    assert r["tau_trajectory"] == r["tau_trajectory_by_k"][-1]
    assert r["tau_independent"] == r["tau_independent_by_k"][-1]
    assert "tau_trajectory_capped" not in r and "traj_cap_rounds" not in c


@pytest.mark.parametrize("cap, rounds, accepted", [
    (1, [0, 0, 0], [0, 0, 0]),       # the prefill's token alone: no round
    (3, [1, 1, 1], [1, 2, 3]),       # tokens 4..6: one round (t=3) whatever K'
    (4, [2, 1, 1], [1, 2, 3]),       # tokens 4..7: K'=1 needs t=5 too
    (6, [3, 2, 2], [2, 4, 5]),       # the whole span (tokens 4..9): the uncapped walk
    (50, [3, 2, 2], [2, 4, 5])])
def test_walk_within_the_first_tokens_by_hand(cap, rounds, accepted):
    """The test above's text; the walk stops once the answer's first `cap` tokens are committed,
    counting that round's accepted drafts in full (as real decoding with max_new_tokens = cap
    does)."""
    c = chain_counts(*_pattern(10, HAND_LOSS_MASK, HAND_TABLE), walk_cap=cap)
    assert c["traj_rounds"].tolist() == [3, 2, 2]                    # the full walk unchanged
    assert c["traj_cap_rounds"].tolist() == rounds
    assert c["traj_cap_accepted"].tolist() == accepted
    r = {**summarize(c), **tau_curves(c)}
    want = [1 + a / n if n else float("nan") for a, n in zip(accepted, rounds)]
    assert r["tau_trajectory_capped_by_k"] == pytest.approx(want, nan_ok=True)
    assert r["tau_trajectory_capped"] == pytest.approx(want[-1], nan_ok=True)


def test_walk_cap_is_per_span_and_summed_with_zero_counts():
    """Two answers in one row: each is capped from its own first token; a rank's zero counts
    carry the capped keys too, so the all-reduced dicts match."""
    from eyas.models.metrics import add_counts, zero_counts
    loss = [0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1]          # answers: tokens 1..4 and 7..11
    table = {(0, t): 1 for t in range(12)}                # step 0 right everywhere
    c = chain_counts(*_pattern(12, loss, table), walk_cap=2)
    # K'=1,2,3 alike: each answer's first round (t=0 and t=6) accepts one draft, then stops
    assert c["traj_cap_rounds"].tolist() == [2, 2, 2]
    assert c["traj_cap_accepted"].tolist() == [2, 2, 2]
    z = zero_counts(K, walk_cap=2)
    assert set(z) == set(c)
    assert add_counts(z, c)["traj_cap_accepted"].tolist() == [2, 2, 2]
    with pytest.raises(ValueError, match="cap must be >= 1"):
        chain_counts(*_pattern(12, loss, table), walk_cap=0)


def _walk_bruteforce(draft, target, loss_mask, doc_ids, kk):
    """A greedy chain decoder over every assistant span, written from the definitions."""
    T = len(target)
    rounds = accepted = 0
    for s in range(1, T):
        # a span: maximal run of loss_mask = 1 inside one document, tokens s..e
        if not loss_mask[s] or (loss_mask[s - 1] and doc_ids[s - 1] == doc_ids[s]) \
                or doc_ids[s - 1] != doc_ids[s]:
            continue
        e = s
        while e + 1 < T and loss_mask[e + 1] and doc_ids[e + 1] == doc_ids[s]:
            e += 1
        c = s                                  # committed index; the prefill produced token s
        while c < e:
            t, n = c - 1, 0                    # chain start row t = c - 1 drafts c+1, c+2, ...
            # draft n is checked against the target's argmax at index c+n, stored up to the
            # span's last token e (which verifies one draft past the span)
            while n < kk and c + n <= e and draft[n][t] == target[t + 1 + n]:
                n += 1
            rounds += 1
            accepted += n
            c += n + 1
    return rounds, accepted


def test_trajectory_matches_a_bruteforce_decoder():
    rng = random.Random(0)
    for trial in range(30):
        lengths = [rng.randint(2, 14) for _ in range(rng.randint(1, 4))]
        T = sum(lengths) + rng.randint(0, 3)
        doc = torch.full((T,), -1, dtype=torch.int32)
        lm, pos = [0] * T, 0
        for d, n in enumerate(lengths):
            doc[pos:pos + n] = d
            for i in range(pos + rng.randint(1, n - 1), pos + n):    # assistant tail, maybe 2 turns
                lm[i] = int(rng.random() < 0.9)
            pos += n
        table = {(k, t): rng.random() < 0.7 for k in range(K) for t in range(T)}
        draft, d2t, target, mask = _pattern(T, lm, table, doc)
        c = chain_counts(draft, d2t, target, mask)
        for kk in range(1, K + 1):
            got = (int(c["traj_rounds"][kk - 1]), int(c["traj_accepted"][kk - 1]))
            assert got == _walk_bruteforce(draft.tolist(), target.tolist(), lm, doc.tolist(), kk), \
                (trial, kk)


def test_tau_by_context_on_a_long_sample():
    # one 36k-token answer (prompt = token 0) whose chains accept n_b drafts in context bucket b:
    # 3 in 0-2k, 2 in 2k-8k, 1 in 8k-16k, 0 in 16k-32k, 1 in 32k+
    T, n_by_bucket = 36_000, [3, 2, 1, 0, 1]
    edges = DEFAULT_EDGES
    bucket = torch.bucketize(torch.arange(T), torch.tensor(edges[1:]), right=True)
    bl = bucket.tolist()
    table = {(k, t): k < n_by_bucket[bl[t]] for t in range(T) for k in range(K)}
    draft, d2t, target, mask = _pattern(T, [0] + [1] * (T - 1), table)
    c = chain_counts(draft, d2t, target, mask, torch.arange(T), edges)
    by = context_table(c, edges)
    starts = [2048, 6144, 8192, 16384, 3231]          # t = 0..T-2 (the last token starts none)
    assert [b["bucket"] for b in by] == ["0-2k", "2k-8k", "8k-16k", "16k-32k", "32k+"]
    assert [(b["lo"], b["hi"]) for b in by] == [(0, 2048), (2048, 8192), (8192, 16384),
                                                (16384, 32768), (32768, None)]
    assert [b["rounds"] for b in by] == starts and [b["tokens"] for b in by] == starts
    assert [b["tau"] for b in by] == [1.0 + n for n in n_by_bucket]
    nan = float("nan")
    want = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, nan], [0.0, nan, nan], [1.0, 0.0, nan]]
    assert str([b["cond_acc"] for b in by]) == str(want)               # exact, NaN included
    assert sum(int(x) for x in c["ctx_tau_sum"]) == int(c["tau_sum"])   # the buckets add up
    assert context_scalars(by)["tau_ctx_8k-16k"] == 2.0
    # other edges: one bucket per 1000 positions of the first 3000, then the rest
    by = context_table(chain_counts(draft, d2t, target, mask, torch.arange(T), (0, 1000, 3000)),
                       (0, 1000, 3000))
    assert [(b["bucket"], b["tau"]) for b in by] == [
        ("0-1000", 4.0), ("1000-3000", (1048 * 4 + 952 * 3) / 2000),
        ("3000+", tail_tau(n_by_bucket, starts))]


def test_a_round_at_a_bucket_edge_is_bucketed_alike_offline_and_in_real_decoding():
    # the chain that starts at row t reads aux[t] and token x_{t+1}: real decoding runs it as
    # the round that verifies x_{t+1} at position L = t + 1
    from eyas.models.context import context_counts, context_table, rounds_table
    edges = (0, 2048)
    for t in (2046, 2047, 2048):
        mask = torch.zeros(1, t + 2, dtype=torch.bool)
        mask[0, t] = True
        off = context_table(context_counts(torch.zeros(1, t + 2, dtype=torch.int64), mask,
                                           torch.arange(t + 2), edges), edges)
        real = rounds_table([(t + 1, 0, 1)], 1, edges)
        assert [b["rounds"] for b in off] == [b["rounds"] for b in real] == \
            ([1, 0] if t < 2048 else [0, 1]), t


def tail_tau(n_by_bucket, starts):
    """τ over every start from position 3000 on (the rest of 2k-8k, then the later buckets)."""
    rest = [starts[1] - 952] + starts[2:]
    return sum((1 + n) * s for n, s in zip(n_by_bucket[1:], rest)) / sum(rest)


def test_offline_counts_equal_the_trainers(tiny_drafter, tiny_llama_dataset):
    drafter = tiny_drafter(load_target_config("tiny-llama"))
    head = load_embedding_and_head("tiny-llama")[1].float()
    rows = head[torch.arange(4096) + drafter.d2t]
    # without the position mask the loss weighs every counted row, so its α is the evaluation's
    loss_cfg = SimpleNamespace(step_weight=0.8, normalisation="valid", position_mask=False,
                               chunk_size=None, objective="soft_ce", lk_eta=3.0)
    module = TrainingModule(drafter, rows, loss_cfg, loss_impl="torch", ttt_steps=K)
    loader = PackedLoader(open_dataset(tiny_llama_dataset), 384, 0, 1, seed=0, shuffle=False,
                          num_workers=0)
    chains = 0
    for batch in loader:
        arg, mask = draft_argmax(drafter, batch, K)
        # make some chains correct: every 6th row t gets targets equal to its drafts at k = 0..2
        drafted = arg + drafter.d2t[arg]
        for t in range(0, batch.num_tokens - K - 1, 6):
            for k in range(K):
                batch.target_argmax[t + 1 + k] = drafted[k, t]
        mine = chain_counts(arg, drafter.d2t, batch.target_argmax, mask)
        with torch.no_grad():
            res = module(**batch_inputs(batch))
        theirs = accept_counts(res.draft_argmax, drafter.d2t, batch.target_argmax,
                               res.metric_mask)
        assert torch.equal(res.draft_argmax, arg) and torch.equal(res.metric_mask, mask)
        for key in COUNT_KEYS:
            assert torch.equal(mine[key], theirs[key]), key
        *_, alpha = draft_argmax(drafter, batch, K, head_rows=rows)
        assert all(torch.equal(alpha[key], res.alpha[key]) for key in alpha), (alpha, res.alpha)
        assert int(alpha["alpha_rows"][0]) == int(mask[0].sum()) > 0
        chains += int(mine["cond_correct"][K - 1])
    assert chains > 10                       # full-length chains were counted, not only misses


def test_offline_eval_directory_module_and_rank_split(tiny_drafter, tiny_llama_dataset, tmp_path):
    drafter = tiny_drafter(load_target_config("tiny-llama"), seed=1)
    out = export_drafter(drafter.state_dict(), drafter.config, drafter.d2t, drafter.t2d,
                         tmp_path / "export", target_config=load_target_config("tiny-llama"))
    by_module = offline_eval(drafter, tiny_llama_dataset, k=K, token_budget=256)
    by_dir = offline_eval(out, tiny_llama_dataset, k=K, token_budget=256)
    assert by_dir["counts"] == by_module["counts"]
    assert by_dir["chain_starts"] > 100
    parts = [offline_eval(out, tiny_llama_dataset, k=K, token_budget=256, rank=r, world_size=2)
             for r in range(2)]
    summed = {key: [a + b for a, b in zip(parts[0]["counts"][key], parts[1]["counts"][key])]
              for key in by_dir["counts"]}
    assert summed == by_dir["counts"]
    assert 0 < parts[0]["chain_starts"] < by_dir["chain_starts"]
    sub = offline_eval(out, tiny_llama_dataset, k=2, token_budget=256, indices=[0, 5, 7])
    assert sub["num_samples"] == 3 and len(sub["tau_by_k"]) == 2


_RANK1 = """
import json, sys, torch, torch.distributed as dist
from eyas.train.evaluate.offline import offline_eval
port, out, ds = sys.argv[1], sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
res = offline_eval(out, ds, k=3, token_budget=256, rank=1, world_size=2)
dist.destroy_process_group()
print(json.dumps(res["counts"]))
"""


def test_counts_are_all_reduced_across_processes(tiny_drafter, tiny_llama_dataset, tmp_path):
    """Rank 0 here, rank 1 in a subprocess (gloo): both report the single-process counts."""
    import os
    import subprocess
    import sys

    import torch.distributed as dist

    from tests.ports import free_port
    drafter = tiny_drafter(load_target_config("tiny-llama"), seed=2)
    out = export_drafter(drafter.state_dict(), drafter.config, drafter.d2t, drafter.t2d,
                         tmp_path / "export", target_config=load_target_config("tiny-llama"))
    single = offline_eval(out, tiny_llama_dataset, k=K, token_budget=256)["counts"]
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", _RANK1, str(port), str(out),
                              str(tiny_llama_dataset)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=2, timeout=__import__("datetime").timedelta(minutes=4))
        mine = offline_eval(out, tiny_llama_dataset, k=K, token_budget=256, rank=0,
                            world_size=2)["counts"]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        stdout, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr[-2000:]
    theirs = json.loads(stdout.strip().splitlines()[-1])
    assert mine == theirs == single


def test_cli_offline_and_speculative(tiny_drafter, tiny_llama_dataset, tmp_path, capsys):
    drafter = tiny_drafter(load_target_config("tiny-llama"), seed=3)
    out = export_drafter(drafter.state_dict(), drafter.config, drafter.d2t, drafter.t2d,
                         tmp_path / "export", target_config=load_target_config("tiny-llama"))
    f = tmp_path / "offline.json"
    assert cli_main(["--drafter", str(out), "--data", str(tiny_llama_dataset), "--k", "3",
                     "--out", str(f), "--token-budget", "256", "--eval-fraction", "0.25"]) == 0
    res = json.loads(f.read_text())
    for key in ("tau", "tau_by_k", "acc_0", "acc_2", "cond_acc_0", "cond_acc_2", "acc_overall",
                "tau_independent", "tau_trajectory"):
        assert key in res
    assert res["num_samples"] == 6 and len(res["tau_by_k"]) == 3
    printed = capsys.readouterr().out
    assert "tau_traj" in printed and "by context" in printed and "32k+" in printed
    by = res["by_context"]
    assert [b["bucket"] for b in by] == ["0-2k", "2k-8k", "8k-16k", "16k-32k", "32k+"]
    assert by[0]["rounds"] == res["chain_starts"] and by[0]["tau"] == pytest.approx(res["tau"])
    assert all(b["rounds"] == 0 and b["tau"] is None for b in by[1:])   # short samples only
    # other edges: the buckets split the same starts, and their τ average to the total
    assert cli_main(["--drafter", str(out), "--data", str(tiny_llama_dataset), "--k", "3",
                     "--out", str(f), "--token-budget", "256", "--eval-fraction", "0.25",
                     "--context-buckets", "0,44,50"]) == 0        # answers start at 35..60
    by = json.loads(f.read_text())["by_context"]
    assert [b["bucket"] for b in by] == ["0-44", "44-50", "50+"] and by[2]["hi"] is None
    assert sum(b["rounds"] for b in by) == res["chain_starts"] and all(b["rounds"] for b in by)
    assert sum(b["tau"] * b["rounds"] for b in by) == pytest.approx(res["tau"] *
                                                                    res["chain_starts"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        cli_main(["--drafter", str(out), "--data", "x", "--k", "3", "--out", "y",
                  "--context-buckets", "0,2048,1024"])
    assert exc.value.code == 2
    assert "--context-buckets '0,2048,1024': expected" in capsys.readouterr().err

    f = tmp_path / "spec.json"
    assert cli_main(["--drafter", str(out), "--target", "tiny-llama", "--prompts",
                     str(prompts_path("heldout")), "--k", "2", "--out", str(f),
                     "--max-new-tokens", "5", "--num-prompts", "2", "--dtype", "fp32"]) == 0
    res = json.loads(f.read_text())
    assert res["tokens_identical"] is True and res["num_prompts"] == 2
    assert [key for key in res if key.startswith(("cond_acc_", "alive_"))] == \
        ["cond_acc_0", "cond_acc_1", "alive_0", "alive_1"]
    for key in ("tau", "tau_emitted", "target_forwards", "tokens_generated", "tokens_per_s",
                "baseline_tokens_per_s", "speedup"):
        assert res[key] is not None, key
    assert res["tau"] == 1 + res["mean_accepted_drafts"]
    assert res["by_context"][0]["rounds"] == res["decode_rounds"]
    assert res["by_context"][0]["tau"] == pytest.approx(res["tau"])
    assert "speedup" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli_main(["--drafter", str(out), "--prompts", "x.jsonl", "--k", "2", "--out", "y"])
    assert e.value.code == 2
    assert "error: --prompts needs --target" in capsys.readouterr().err
