"""`eyas generate`: answers from a served target (data.served), on the command line."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from eyas.data.common.log import HelpFormatter, setup_logging
from eyas.data.common.settings import EndpointSettings, GenerationSettings, field_help

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


def build_parser() -> argparse.ArgumentParser:
    gen = GenerationSettings
    p = argparse.ArgumentParser(
        prog="eyas generate", formatter_class=HelpFormatter,
        description="Answer prompts (OpenAI messages or ShareGPT JSONL) with a target served by "
        "an OpenAI-compatible server (vLLM, SGLang, transformers serve) into a conversations "
        "JSONL that `eyas prepare` reads. Written to OUT.partial until every prompt x sample is "
        "in, then renamed to OUT beside its data card (OUT's .card.json); re-running the same "
        "command resumes.")
    p.add_argument("--endpoint", required=True, metavar="URL",
                   help="the server's API root, e.g. http://localhost:8000/v1")
    p.add_argument("--prompts", required=True, help="prompts JSONL")
    p.add_argument("--out", required=True, help="conversations JSONL to write")
    p.add_argument("--model", default=None,
                   help="served model name (default: the first that GET /v1/models lists)")
    p.add_argument("--max-tokens", type=int, default=gen.max_new_tokens,
                   help=field_help(gen, "max_new_tokens"))
    p.add_argument("--temperature", type=float, default=gen.temperature,
                   help=field_help(gen, "temperature"))
    p.add_argument("--top-p", type=float, default=gen.top_p, help=field_help(gen, "top_p"))
    p.add_argument("--seed", type=int, default=None,
                   help="base seed; each request gets one derived from it, the record id and "
                   "the turn (default: none sent, the server's own randomness)")
    p.add_argument("--concurrency", type=int, default=EndpointSettings.endpoint_concurrency,
                   help=field_help(EndpointSettings, "endpoint_concurrency",
                                   "data.endpoint_concurrency"))
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="answers per prompt; answer j > 0 of prompt X has id X#sj")
    p.add_argument("--api-key-env", default=None, metavar="VAR",
                   help="environment variable holding the API key, sent as a bearer token "
                   "(default: no key)")
    p.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help="chat_template_kwargs sent with every request, e.g. "
                   "'{\"enable_thinking\": false}' (default: none)")
    p.add_argument("--retries", type=int, default=5,
                   help="retries of a request after a connection error, 429 or 5xx")
    p.add_argument("--retry-backoff", type=float, default=1.0, metavar="SECONDS",
                   help="first retry delay, doubled per retry (capped at 60 s)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="per-request timeout")
    p.add_argument("--log-file", default=None,
                   help="also append the log here (default: OUT's .log, e.g. conv.log)")
    return p


def cli_main(argv: list[str] | None = None) -> int:
    """`eyas generate --endpoint URL --prompts P.jsonl --out C.jsonl [...]`."""
    from eyas.data.build.served import generate_from_endpoint
    args = build_parser().parse_args(argv)
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
