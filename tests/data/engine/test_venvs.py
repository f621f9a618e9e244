"""The runtime engine's install probes PyTorch's CPU index first, as launch.sh does: an
unreachable index is left out at once (one warning naming it) instead of pip's retries."""

import http.server
import logging
import threading
import time

import pytest

from eyas.data.engine.venvs import _torch_cpu_index
from tests.ports import free_port


def test_an_unreachable_index_is_left_out_at_once(monkeypatch, caplog):
    url = f"http://127.0.0.1:{free_port()}/whl/cpu"          # nothing listens there
    monkeypatch.setenv("EYAS_TORCH_CPU_INDEX", url)
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="eyas.data.engine.venvs"):
        assert _torch_cpu_index() == []
    assert time.monotonic() - t0 < 5
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"probing PyTorch's CPU wheel index {url}") for m in said)
    assert any(f"{url} is unreachable" in m and "EYAS_TORCH_CPU_INDEX" in m for m in said)


def test_a_reachable_index_is_used_and_an_empty_setting_skips_it(monkeypatch, tmp_path):
    (tmp_path / "whl" / "cpu" / "torch").mkdir(parents=True)
    (tmp_path / "whl" / "cpu" / "torch" / "index.html").write_text("<html></html>")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
        monkeypatch.setenv("EYAS_TORCH_CPU_INDEX", url)
        assert _torch_cpu_index() == ["--extra-index-url", url]
    finally:
        server.shutdown()
    monkeypatch.setenv("EYAS_TORCH_CPU_INDEX", "")
    assert _torch_cpu_index() == []


@pytest.fixture(autouse=True)
def _quiet_server_log(monkeypatch):
    monkeypatch.setattr(http.server.SimpleHTTPRequestHandler, "log_message", lambda *a: None)
