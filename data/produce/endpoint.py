"""A small client for OpenAI-compatible servers (vLLM, SGLang, `transformers serve`, ...).

`EndpointClient` sends `GET /models` and `POST /chat/completions` over one pooled httpx client
(thread-safe: `data.produce.served` calls it from several threads). Connection errors, timeouts and the
answers 429 and 5xx are retried with exponential backoff (doubling from `backoff` seconds, with
jitter, capped at `max_backoff`; a `Retry-After` header is honoured up to the cap); after
`retries` retries the request fails with `EndpointUnavailable`. Any other 4xx answer is the
request's own fault and fails at once with `EndpointRequestError`. Both name what was asked
(`what`, e.g. the prompt id), the URL and the server's answer. The retry loop is written here
(a dozen lines) rather than taken from a retry library eyas does not otherwise depend on.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from typing import Any
from urllib.parse import urlsplit

import httpx

log = logging.getLogger(__name__)


class EndpointError(RuntimeError):
    """A request to the endpoint failed; the message names the request and the server's answer."""


class EndpointRequestError(EndpointError):
    """The server refused the request (HTTP 4xx other than 429): fix the request or option."""

    exit_status = 2


class EndpointUnavailable(EndpointError):
    """The server stayed unreachable or kept failing (connection errors, 5xx, 429)."""

    exit_status = 3


class EndpointStopped(EndpointError):
    """The request was abandoned because the run is stopping (another request failed)."""


def base_url(url: str) -> str:
    """'http://host:8000/v1/' -> 'http://host:8000/v1'; a URL without a path gets '/v1'."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--endpoint {url!r}: expected an http(s) URL such as "
                         f"http://HOST:PORT/v1 (the server's OpenAI-compatible API root)")
    url = url.rstrip("/")
    return url if parts.path.strip("/") else url + "/v1"


def _detail(response: httpx.Response) -> str:
    """The server's error text, one line, at most 300 characters."""
    try:
        body = response.json()
        err = body.get("error", body.get("detail", body)) if isinstance(body, dict) else body
        if isinstance(err, dict):
            err = err.get("message", err)
        text = err if isinstance(err, str) else json.dumps(err)
    except ValueError:
        text = response.text
    text = " ".join(str(text).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers.get("retry-after", ""))
    except ValueError:
        return None


class EndpointClient:
    """Requests to one OpenAI-compatible API root (`base_url(url)`), retried as the module says.

    `stop()` makes every waiting retry give up at once (EndpointStopped)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 5, backoff: float = 1.0, max_backoff: float = 60.0,
                 connections: int = 8) -> None:
        if retries < 0 or backoff < 0 or timeout <= 0:
            raise ValueError(f"retries and backoff must be >= 0 and timeout > 0; got retries="
                             f"{retries}, backoff={backoff}, timeout={timeout}")
        self.url = base_url(url)
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            headers=headers, timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)),
            limits=httpx.Limits(max_connections=connections,
                                max_keepalive_connections=connections))
        self._stop = threading.Event()

    def close(self) -> None:
        self._client.close()

    def stop(self) -> None:
        self._stop.set()

    def request(self, method: str, path: str, what: str, body: dict | None = None) -> Any:
        """The JSON answer of `method url/path`, retried on connection errors, 429 and 5xx."""
        url = f"{self.url}/{path.lstrip('/')}"
        for attempt in range(self.retries + 1):
            if self._stop.is_set():
                raise EndpointStopped(f"{what}: abandoned (the run is stopping)")
            wait = None
            try:
                response = self._client.request(method, url, json=body)
            except httpx.TransportError as e:
                problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            else:
                if response.status_code < 400:
                    try:
                        return response.json()
                    except ValueError:
                        problem = f"HTTP {response.status_code} with a body that is not JSON"
                elif response.status_code == 429 or response.status_code >= 500:
                    problem = f"HTTP {response.status_code}: {_detail(response)}"
                    wait = _retry_after(response)
                else:
                    raise EndpointRequestError(
                        f"{what}: {method} {url} answered HTTP {response.status_code}: "
                        f"{_detail(response)}")
            if attempt == self.retries:
                raise EndpointUnavailable(
                    f"{what}: {method} {url} failed {attempt + 1} time(s), last with {problem}; "
                    f"check that the server is up (re-running resumes where this run stopped)")
            delay = min(self.max_backoff, self.backoff * 2 ** attempt) * random.uniform(0.5, 1.0)
            if wait is not None:
                delay = max(delay, min(wait, self.max_backoff))
            log.warning("%s: %s; retry %d/%d in %.1f s", what, problem, attempt + 1,
                        self.retries, delay)
            if self._stop.wait(delay):
                raise EndpointStopped(f"{what}: abandoned (the run is stopping)")
        raise AssertionError("unreachable")

    def models(self) -> list[str]:
        """The ids `GET /models` lists, in its order."""
        answer = self.request("GET", "models", "listing the served models")
        data = answer.get("data") if isinstance(answer, dict) else None
        ids = [m.get("id") for m in data or [] if isinstance(m, dict) and m.get("id")]
        if not ids:
            raise EndpointRequestError(f"GET {self.url}/models lists no model; name one with "
                                       f"--model NAME")
        return ids

    def chat(self, body: dict[str, Any], what: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """(choices[0], usage) of one non-streamed `POST /chat/completions`."""
        answer = self.request("POST", "chat/completions", what, body)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)
                and isinstance(choices[0].get("message"), dict)):
            raise EndpointRequestError(f"{what}: {self.url}/chat/completions answered without "
                                       f"choices[0].message: {json.dumps(answer)[:300]}")
        usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
        return choices[0], usage
