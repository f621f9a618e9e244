"""`eyas generate --endpoint`: answers from a real OpenAI-compatible server.

The server is `transformers serve` (transformers' serving extra: FastAPI + uvicorn) serving the
local SmolLM2 directory on the CPU, started once for this module on a free loopback port; one
test stops it mid-run and starts it again on the same port. Answers are short (max_tokens 8) and prompts
few, because every answer costs a few CPU seconds.
"""

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.ports import free_port

PROMPTS = [
    {"id": "a", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"id": "b", "messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Name a color."},
                             {"role": "assistant", "content": "Blue."},
                             {"role": "user", "content": "Now name another one."}]},
    {"id": "c", "conversations": [{"from": "human", "value": "Say hi."}]},
    {"id": "d", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
     "tools": [{"type": "function", "function": {
         "name": "get_weather", "description": "The weather of a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                        "required": ["city"]}}}]},
]
EYAS = [sys.executable, "-m", "eyas.train.cli"]


def _serve_problem() -> str | None:
    import importlib.util
    missing = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"`transformers serve` needs {', '.join(missing)} (pip install "
                f"'transformers[serving]', in the test extra)")
    return None


class Server:
    """A `transformers serve` process for the SmolLM2 directory on 127.0.0.1:port."""

    def __init__(self, model_dir: Path, log: Path, port: int | None = None) -> None:
        self.model_dir, self.log, self.port = model_dir, log, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc = None

    def start(self) -> "Server":
        import httpx
        exe = Path(sys.executable).with_name("transformers")
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(exe), "serve", str(self.model_dir), "--device", "cpu", "--host",
                 "127.0.0.1", "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT,
                env=env)
        deadline = time.monotonic() + 180   # a readiness bound, not a measured duration
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"transformers serve exited with {self.proc.returncode}: "
                            f"{self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"transformers serve did not come up: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def smollm2_dir():
    problem = _serve_problem()
    if problem:
        pytest.skip(problem)
    from eyas.data.common.targets import resolve_target
    try:
        return resolve_target("smollm2")
    except FileNotFoundError as e:
        pytest.skip(f"the SmolLM2 target is not available: {e}")


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    srv = Server(smollm2_dir, tmp_path_factory.mktemp("serve") / "serve.log").start()
    yield srv
    srv.stop()


def write_prompts(path: Path, records=PROMPTS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def generate_args(url: str, prompts: Path, out: Path, *extra: str) -> list[str]:
    return [*EYAS, "generate", "--endpoint", url, "--prompts", str(prompts), "--out", str(out),
            "--max-tokens", "8", "--seed", "1", *extra]


def run(args, check=True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    if check and r.returncode != 0:
        pytest.fail(f"{args[3:5]} exited {r.returncode}: {r.stderr[-3000:]}")
    return r


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen) -> None:
    """Block until `path` holds `n` complete lines (or `proc` ended)."""
    while proc.poll() is None:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        time.sleep(0.05)
    pytest.fail(f"eyas generate ended ({proc.returncode}) before writing {n} records")


@pytest.mark.slow
def test_answers_every_prompt_with_card_and_prepare_reads_it(server, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "conv.jsonl"
    kwargs = ["--chat-template-kwargs", '{"enable_thinking": false}']
    r = run(generate_args(server.url, prompts, out, "--concurrency", "2", *kwargs))
    assert not (tmp_path / "conv.jsonl.partial").exists()
    recs = {x["id"]: x for x in lines(out)}
    assert sorted(recs) == ["a", "b", "c", "d"]
    b = recs["b"]
    assert [m["role"] for m in b["messages"]] == ["system", "user", "assistant", "user",
                                                  "assistant"]
    assert b["messages"][2]["content"] == "Blue."          # the prefix is kept as given
    assert recs["d"]["tools"] == PROMPTS[3]["tools"]
    for rec in recs.values():
        gen = rec["generation"]
        assert rec["messages"][-1]["role"] == "assistant" and rec["messages"][-1]["content"]
        assert gen["model"] == str(server.model_dir)       # the first of GET /v1/models
        assert gen["max_tokens"] == 8 and gen["seed"] == 1
        assert gen["chat_template_kwargs"] == {"enable_thinking": False}
        assert gen["finish_reason"][0] in ("stop", "length")
        assert gen["truncated"] == ("length" in gen["finish_reason"])
        assert gen["usage"][0]["completion_tokens"] <= 8
    card = json.loads((tmp_path / "conv.card.json").read_text())
    assert card == json.loads(r.stdout)
    assert card["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert card["counts"]["records"] == 4 and card["counts"]["prompts"] == 4
    assert card["counts"]["empty_answers"] == 0 and card["model"] == str(server.model_dir)
    assert sum(card["finish_reasons"].values()) == 4
    assert card["tokens"]["completion"] == sum(x["generation"]["usage"][0]["completion_tokens"]
                                               for x in recs.values())
    assert "tokens/s" in (tmp_path / "conv.log").read_text()

    # the same command again: nothing to do, nothing changes
    before = out.read_bytes()
    run(generate_args(server.url, prompts, out, *kwargs))
    assert out.read_bytes() == before
    # another sampling setup on the finished file is refused, naming the field
    r = run(generate_args(server.url, prompts, out, "--temperature", "0.7", *kwargs), check=False)
    assert r.returncode == 2 and "temperature=0.0" in r.stderr and "temperature=0.7" in r.stderr
    assert out.read_bytes() == before

    from eyas.data.produce.prepare import prepare
    summary = prepare(out, "smollm2", tmp_path / "tokens")
    assert summary["conversations"] == 4
    manifest = json.loads((tmp_path / "tokens" / "manifest.json").read_text())
    assert manifest["prepare"]["generation_card"]["sha256"] == card["sha256"]
    assert manifest["prepare"]["generation_card"]["matches_input"] is True


def test_kill9_then_resume_writes_each_record_once(server, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", [PROMPTS[0], PROMPTS[2]])
    out, partial = tmp_path / "conv.jsonl", tmp_path / "conv.jsonl.partial"
    args = generate_args(server.url, prompts, out, "--concurrency", "1",
                         "--samples-per-prompt", "2")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        wait_for_lines(partial, 1, proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not out.exists() and not (tmp_path / "conv.card.json").exists()
    kept = partial.read_bytes()
    written = kept.count(b"\n")
    assert 1 <= written < 4
    with open(partial, "ab") as f:   # a torn last line, as a kill mid-write leaves it
        f.write(kept.splitlines(keepends=True)[0][:30])
    r = run(args)
    assert "discarding a partial last line" in r.stderr
    assert f"{4 - written} of 4 records to generate" in r.stderr
    ids = [x["id"] for x in lines(out)]
    assert sorted(ids) == ["a", "a#s1", "c", "c#s1"]
    assert out.read_bytes().startswith(kept)             # the first run's records are kept
    assert json.loads((tmp_path / "conv.card.json").read_text())["counts"]["records"] == 4


def test_assistant_message_keeps_reasoning_and_tool_calls_as_returned():
    from eyas.data.produce.served import _assistant_message
    call = [{"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]
    got = _assistant_message({"role": "assistant", "content": None, "reasoning_content": "hm",
                              "tool_calls": call, "refusal": None, "audio": None})
    assert got == {"role": "assistant", "content": None, "reasoning_content": "hm",
                   "tool_calls": call}
    # vLLM's empty tool_calls list is no tool call
    assert _assistant_message({"role": "assistant", "content": "hi", "tool_calls": []}) == {
        "role": "assistant", "content": "hi"}


def test_prepare_refuses_an_unfinished_output(tmp_path):
    from eyas.data.produce.prepare import PrepareError, prepare
    partial = tmp_path / "conv.jsonl.partial"
    partial.write_text(json.dumps({"id": "a", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    with pytest.raises(PrepareError, match="unfinished `eyas generate` output.*conv.jsonl"):
        prepare(partial, "smollm2", tmp_path / "tokens")


def test_a_second_writer_of_one_output_is_refused(tmp_path):
    import fcntl

    from eyas.data.common.lock import sibling_lock_path
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:1])
    out = tmp_path / "conv.jsonl"
    with open(sibling_lock_path(out), "w") as held:   # as a running `eyas generate` holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        r = run(generate_args("http://127.0.0.1:9/v1", prompts, out), check=False)
    assert r.returncode == 2 and "is being written by another process" in r.stderr
    assert not out.exists() and not (tmp_path / "conv.jsonl.partial").exists()


def test_refused_request_names_the_prompt(server, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:1])
    out = tmp_path / "conv.jsonl"
    r = run(generate_args(server.url, prompts, out, "--model", "no-such-model"), check=False)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("eyas generate: prompt 'a' (sample 0, turn 0)")
    assert "HTTP 400" in err and "no-such-model" in err
    assert not out.exists() and not (tmp_path / "conv.card.json").exists()


def test_server_error_is_retried_then_names_the_prompt(server, tmp_path):
    # `transformers serve` answers HTTP 500 when its chat template gets `tools` that are not a
    # list (a prompt record's own `tools` must be a list: eyas refuses it before sending)
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:1])
    out = tmp_path / "conv.jsonl"
    r = run(generate_args(server.url, prompts, out, "--retries", "1", "--retry-backoff", "0.01",
                          "--chat-template-kwargs", '{"tools": "not-a-list"}'), check=False)
    assert r.returncode == 3, r.stderr
    assert "HTTP 500" in r.stderr and "retry 1/1" in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("eyas generate: prompt 'a' (sample 0, turn 0)")
    assert "failed 2 time(s)" in last and not out.exists()


@pytest.mark.slow
def test_server_gone_mid_run_keeps_what_was_written_and_resumes(server, smollm2_dir, tmp_path):
    srv = server   # stopped mid-run, then started again on the same port for the others
    prompts = write_prompts(tmp_path / "prompts.jsonl", [PROMPTS[0], PROMPTS[2]])
    out, partial = tmp_path / "conv.jsonl", tmp_path / "conv.jsonl.partial"
    args = generate_args(srv.url, prompts, out, "--model", str(smollm2_dir), "--concurrency",
                         "1", "--retries", "2", "--retry-backoff", "0.05")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        wait_for_lines(partial, 1, proc)
        srv.stop()
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 3, stderr
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("eyas generate: prompt '") and "failed 3 time(s)" in last
        assert "the same command resumes" in last
        kept = lines(partial)
        assert len(kept) == 1 and not out.exists()
        srv.start()
        run(args)
        recs = lines(out)
        assert sorted(x["id"] for x in recs) == ["a", "c"]
        assert recs[:len(kept)] == kept
    finally:
        if srv.proc.poll() is not None:
            srv.start()


def test_main_job_data_stage_takes_answers_from_the_endpoint(server, tmp_path):
    """data.endpoint=URL: the embedded dataset's answers come from the server (answer 0
    greedy, answer 1 sampled), then are tokenised and extracted with the local target."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from eyas.data.common.targets import default_device
    from eyas.train.config import register
    from eyas.data.produce.recipe import _embedded_key, embedded_dataset
    from eyas.train.resolve import resolve
    register()
    conf = Path(__file__).resolve().parents[3] / "conf"
    base = ["target=tiny_llama", "data.num_prompts=2", "data.max_new_tokens=8",
            "data.samples_per_prompt=2", f"data.cache_dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        local = compose(config_name="config", overrides=base)
        cfg = compose(config_name="config", overrides=[*base, f"data.endpoint={server.url}"])
    for c in (local, cfg):
        c.output_dir = "unused"
    local, c = OmegaConf.to_object(local), OmegaConf.to_object(cfg)
    assert _embedded_key(c.data, c.target, 0, torch.float32) != \
        _embedded_key(local.data, local.target, 0, torch.float32)
    paths = embedded_dataset(c.data, c.target, seed=c.train.seed,
                                   target_dtype=resolve(c, default_device()).target_dtype)
    recs = lines(paths.conversations)
    assert len(recs) == 4 and len({r["id"] for r in recs}) == 4
    for r in recs:
        assert r["generation"]["model"] == str(server.model_dir)
        sampled = r["id"].endswith("#s1")
        assert r["generation"]["temperature"] == (c.data.temperature if sampled else 0.0)
    assert (paths.train / "manifest.json").is_file()


def test_progress_lines_come_on_a_clock_with_the_time_left(monkeypatch, caplog):
    """A line at most every PROGRESS_LOG_EVERY_S (30 s) and one at the end, not per tenth."""
    from eyas.data.produce import served
    now = [0.0]
    monkeypatch.setattr(served.time, "perf_counter", lambda: now[0])
    progress = served._Progress(4)
    rec = {"generation": {"usage": [{"completion_tokens": 10}], "truncated": False}}
    with caplog.at_level(logging.INFO, logger="eyas.data.produce.served"):
        for t in (10.0, 30.0, 40.0, 50.0):
            now[0] = t
            progress.add(rec)
    assert [m.split(" (")[0] for m in caplog.messages] == [
        "generate: 2/4 records, 20 tokens in 30.0 s", "generate: 4/4 records, 40 tokens in 50.0 s"]
    assert caplog.messages[0].endswith("about 30 s left")
    assert caplog.messages[1].endswith("about 0 s left")
