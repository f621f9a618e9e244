"""`eyas generate`: answers from a served target (data.produce.served), on the command line."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.data.common.log import setup_logging
from eyas.data.common.options import option, shared
from eyas.data.common.settings import EndpointSettings, GenerationSettings

log = logging.getLogger(__name__)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as "
                                         f"'{{\"enable_thinking\": false}}', got {text!r}")
    return value


@dataclass(kw_only=True)
class GenerateOptions:
    """Answer prompts (OpenAI messages or ShareGPT JSONL) with a target served by an
    OpenAI-compatible server (vLLM, SGLang, transformers serve) into a conversations JSONL that
    `eyas prepare` reads. Written to OUT.partial until every prompt x sample is in, then renamed
    to OUT beside its data card (OUT's .card.json); re-running the same command resumes."""

    endpoint: str = option(help="the server's API root, e.g. http://localhost:8000/v1",
                           metavar="URL")
    prompts: str = option(help="prompts JSONL")
    out: str = option(help="conversations JSONL to write")
    model: str | None = option(
        None, "served model name (default: the first that GET /v1/models lists)")
    max_tokens: int = shared(GenerationSettings, "max_new_tokens")
    temperature: float = shared(GenerationSettings, "temperature")
    top_p: float = shared(GenerationSettings, "top_p")
    seed: int | None = option(
        None, "base seed; each request gets one derived from it, the record id and the turn "
        "(default: none sent, the server's own randomness)")
    concurrency: int = shared(EndpointSettings, "endpoint_concurrency",
                              "data.endpoint_concurrency")
    samples_per_prompt: int = option(1, "answers per prompt; answer j > 0 of prompt X has id X#sj")
    api_key_env: str | None = option(
        None, "environment variable holding the API key, sent as a bearer token (default: no "
        "key)", metavar="VAR")
    chat_template_kwargs: dict[str, Any] | None = option(
        None, "chat_template_kwargs sent with every request, e.g. "
        "'{\"enable_thinking\": false}' (default: none)", type=_json_object, metavar="JSON")
    retries: int = option(5, "retries of a request after a connection error, 429 or 5xx")
    retry_backoff: float = option(1.0, "first retry delay, doubled per retry (capped at 60 s)",
                                  metavar="SECONDS")
    timeout: float = option(600.0, "per-request timeout", metavar="SECONDS")
    log_file: str | None = option(
        None, "also append the log here (default: OUT's .log, e.g. conv.log)")


def main(args: GenerateOptions) -> int:
    """`eyas generate --endpoint URL --prompts P.jsonl --out C.jsonl [...]`."""
    from eyas.data.produce.served import generate_from_endpoint
    out = Path(args.out)
    log_file = args.log_file or out.with_name(
        f"{out.stem if out.suffix == '.jsonl' else out.name}.log")
    setup_logging(file=log_file)
    card = generate_from_endpoint(
        args.prompts, args.endpoint, out, model=args.model, max_tokens=args.max_tokens,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        concurrency=args.concurrency, samples_per_prompt=args.samples_per_prompt,
        api_key_env=args.api_key_env, chat_template_kwargs=args.chat_template_kwargs,
        retries=args.retries, backoff=args.retry_backoff, timeout=args.timeout)
    print(json.dumps(card, indent=1))
    return 0
