"""Real decoding in several processes (`eval.processes`, `eyas evaluate --processes`): every
prompt decodes exactly as in one process, in order, greedy and sampled (prompt i keeps seed + i
whichever process decodes it). Target: the tiny random Llama preset in fp32; drafter: a
random-weight export over the whole vocabulary."""

import json
import os
import re

import pytest
import torch

from eyas.data.common.targets import load_target
from eyas.train.evaluate.specdec import decode_prompts, load_engine_drafter, stop_token_ids
from eyas.train.evaluate.pool import DecodePool, decode_job
from eyas.data.common.utils import json_safe
from eyas.train.evaluate.offline import load_prompts, speculative_eval

QUESTIONS = ["Hi there", "What is 2+2?", "Tell me a story about a cat.", "Name a colour.",
             "Why is the sky blue?"]
TIMES = {"seconds", "baseline_seconds", "cpu_seconds", "baseline_cpu_seconds", "tokens_per_s",
         "baseline_tokens_per_s", "speedup", "speedup_cpu", "wall_seconds", "prefill_seconds",
         "baseline_prefill_seconds", "step_seconds"}

pytestmark = pytest.mark.usefixtures("one_thread")


def decode_in_processes(job, prompts, processes, *, seed):
    """One decoding of `prompts` at job's temperature and draft rule in a pool of its own."""
    with DecodePool(job, processes) as pool:
        return pool.decode(prompts, temperature=job["temperature"], draft=job["draft"],
                           seed=seed)


@pytest.fixture(scope="module")
def export(tmp_path_factory, full_vocab_export):
    model, _ = load_target("tiny-llama", dtype=torch.float32)
    return full_vocab_export(model, tmp_path_factory.mktemp("x") / "rand")


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "messages": [
        {"role": "user", "content": q}]}) + "\n" for i, q in enumerate(QUESTIONS)))
    return path


def _outputs(pairs):
    return [(name, b.tokens, s.tokens, s.accepted, s.rounds) for name, b, s in pairs]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_parts_decode_each_prompt_as_one_process_does(export, prompts_file, temperature):
    model, tok = load_target("tiny-llama", dtype=torch.float32)
    prompts = load_prompts(prompts_file, tok)
    engine, cfg = load_engine_drafter(export, model.get_input_embeddings().weight.detach(),
                                      dtype=torch.float32)
    kw = dict(k=3, max_new_tokens=10, temperature=temperature)
    one = decode_prompts(model, engine, cfg, [p for _, p in prompts], names=[n for n, _ in prompts],
                         stop_ids=stop_token_ids(model, tok), progress=False, seed=7, **kw)
    job = decode_job(export, "tiny-llama", dtype="fp32", cache_dir=None, device="cpu", **kw)
    three = decode_in_processes(job, prompts, 3, seed=7)
    assert _outputs(three) == _outputs(one)
    assert [n for n, _, _ in three] == [f"q{i}" for i in range(len(QUESTIONS))]
    if temperature > 0:   # the seeds matter: another seed samples other tokens
        other = decode_in_processes(job, prompts, 2, seed=8)
        assert _outputs(other) != _outputs(one)


@pytest.mark.slow
def test_speculative_eval_in_processes_reports_what_one_process_does(export, prompts_file):
    kw = dict(k=3, num_prompts=4, max_new_tokens=8, progress=False)
    one = json_safe(speculative_eval(export, "tiny-llama", prompts_file, **kw))
    two = json_safe(speculative_eval(export, "tiny-llama", prompts_file, processes=2, **kw))
    assert one["tokens_identical"] is True and one["num_prompts"] == 4
    assert {k: v for k, v in two.items() if k not in TIMES} == \
        {k: v for k, v in one.items() if k not in TIMES}
    with pytest.raises(ValueError, match="1 with a model passed in"):
        speculative_eval(export, "tiny-llama", prompts_file, processes=2,
                         model=load_target("tiny-llama", dtype=torch.float32)[0], tokenizer=1,
                         **kw)


@pytest.mark.slow
def test_one_pool_serves_every_temperature_with_its_workers_loaded_once(export, prompts_file):
    model, tok = load_target("tiny-llama", dtype=torch.float32)
    prompts = load_prompts(prompts_file, tok)
    engine, cfg = load_engine_drafter(export, model.get_input_embeddings().weight.detach(),
                                      dtype=torch.float32)
    job = decode_job(export, "tiny-llama", dtype="fp32", cache_dir=None, device="cpu", k=3,
                     max_new_tokens=10)
    with DecodePool(job, 2) as pool:
        for temperature in (0.0, 0.9, 0.0):
            got = pool.decode(prompts, temperature=temperature, draft="argmax", seed=5)
            one = decode_prompts(model, engine, cfg, [p for _, p in prompts],
                                 names=[n for n, _ in prompts], k=3, max_new_tokens=10,
                                 stop_ids=stop_token_ids(model, tok), progress=False, seed=5,
                                 temperature=temperature)
            assert _outputs(got) == _outputs(one), temperature
        # 5 prompts in 5 parts, three decodings: the pool's processes ran them all, each
        # having loaded the target and the drafter once
        assert 1 <= len(pool.worker_pids) <= 2 and pool.loads == len(pool.worker_pids)
    kw = dict(k=3, num_prompts=4, max_new_tokens=10, progress=False, temperature=0.9, seed=3)
    with DecodePool(job, 2) as pool:
        via_pool = json_safe(speculative_eval(export, "tiny-llama", prompts_file, pool=pool,
                                              **kw))
        with pytest.raises(ValueError, match=r"other settings: k 3 \(asked: 4\)"):
            speculative_eval(export, "tiny-llama", prompts_file, pool=pool, **dict(kw, k=4))
    alone = json_safe(speculative_eval(export, "tiny-llama", prompts_file, **kw))
    assert {k: v for k, v in via_pool.items() if k not in TIMES} == \
        {k: v for k, v in alone.items() if k not in TIMES}


@pytest.mark.slow
def test_the_cli_decodes_every_temperature_in_processes_as_in_one(export, prompts_file,
                                                                   tmp_path):
    from eyas.train.cli import main
    argv = ["evaluate", "--drafter", str(export), "--target", "tiny-llama", "--prompts",
            str(prompts_file), "--k", "3", "--num-prompts", "4", "--max-new-tokens", "8",
            "--temperatures", "0,0.9", "--sampling-seed", "2"]
    assert main(argv + ["--out", str(tmp_path / "one.json")]) == 0
    assert main(argv + ["--processes", "2", "--out", str(tmp_path / "two.json")]) == 0
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert [r["temperature"] for r in two["by_temperature"]] == [0.0, 0.9]
    assert two["by_temperature"] == one["by_temperature"]


@pytest.mark.slow
def test_a_worker_that_cannot_load_reports_the_loading_error(tmp_path, prompts_file):
    job = decode_job(tmp_path / "no-such-export", "tiny-llama", dtype="fp32", cache_dir=None,
                     device="cpu", k=3, max_new_tokens=4)
    prompts = load_prompts(prompts_file, load_target("tiny-llama", dtype=torch.float32)[1])
    missing = tmp_path / "no-such-export" / "config.json"
    with DecodePool(job, 2) as pool, pytest.raises(
            FileNotFoundError, match=re.escape(f"{missing} does not exist: a drafter directory "
                                               f"needs a config.json")):
        pool.decode(prompts, temperature=0.0, draft="argmax", seed=0)


_OWNER = """
import sys
from eyas.data.common.targets import load_tokenizer
from eyas.train.evaluate.pool import DecodePool, decode_job
if __name__ == "__main__":
    tok = load_tokenizer("tiny-llama")
    prompts = [(f"q{i}", tok.encode(f"Tell me a long story, number {i}")) for i in range(200)]
    job = decode_job(sys.argv[1], "tiny-llama", dtype="fp32", cache_dir=None, device="cpu",
                     k=3, max_new_tokens=200)
    with DecodePool(job, 2) as pool:
        print("decoding", flush=True)
        pool.decode(prompts, temperature=0.0, draft="argmax", seed=0)
"""


def _children(pid: int) -> set[int]:
    """The live (not zombie) processes whose parent is `pid` (Linux /proc)."""
    from pathlib import Path
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) process (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc")
def test_workers_end_when_the_process_that_owns_the_pool_is_killed(export, tmp_path):
    """A SIGKILL (or a SIGTERM with no handler) to the owner alone runs none of its cleanup;
    its decode workers must not go on decoding as orphans."""
    import signal
    import subprocess
    import sys
    import time
    script = tmp_path / "owner.py"
    script.write_text(_OWNER)
    owner = subprocess.Popen([sys.executable, str(script), str(export)], stdout=subprocess.PIPE,
                             text=True)
    workers: set[int] = set()
    try:
        assert owner.stdout.readline().strip() == "decoding"
        deadline = time.monotonic() + 120
        while len(workers := _children(owner.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)          # two workers and multiprocessing's resource tracker
        assert len(workers) == 3, f"the pool's processes did not start: {workers}"
        time.sleep(2.0)              # the workers are past their start-up
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 30
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [w for w in workers if _alive(w)], "decode workers outlived their owner"
    finally:
        owner.kill()
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
