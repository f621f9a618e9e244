"""eyas.data.checkout: a checkout on sys.path stays after the installed packages."""

import json
import subprocess
import sys

from eyas.data.checkout import ROOT, keep_checkout_last


def test_the_checkout_moves_last_once(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", ["", str(tmp_path), str(ROOT), "/nonexistent/site"])
    keep_checkout_last()
    assert sys.path == [str(tmp_path), "/nonexistent/site", str(ROOT)]
    keep_checkout_last()                                   # already last: unchanged
    assert sys.path == [str(tmp_path), "/nonexistent/site", str(ROOT)]


def test_python_run_from_the_checkout_imports_eyas_with_the_checkout_last():
    """`python -c` (as `python -m`) from the checkout puts it first; importing eyas moves it."""
    code = ("import sys, json; first = sys.path[0]; import eyas.models; "
            "print(json.dumps([first, sys.path[-1], sys.path.count(sys.path[-1])]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    first, last, count = json.loads(r.stdout)
    assert first == "" and last == str(ROOT) and count == 1
