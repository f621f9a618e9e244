"""`eyas engines check` installs no engine venv unless told to: without --setup a missing venv
is named, with the command that installs it, in one line (exit 3); on a terminal it asks."""

import os
import pty
import subprocess
import sys

from eyas.data.engine.venvs import DEFAULT_VERSIONS

EYAS = [sys.executable, "-m", "eyas.train.cli"]


def test_a_missing_venv_is_named_with_its_install_command(small_export, tmp_path):
    root = tmp_path / "venvs"
    r = subprocess.run([*EYAS, "engines", "check", str(small_export), "--target-config",
                        "tiny-llama", "--venv-root", str(root), "--sglang-version", "0.5.9"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stderr
    assert r.stdout == ""
    assert r.stderr.splitlines() == [(
        f"eyas engines check: no vllm {DEFAULT_VERSIONS['vllm']} and no sglang 0.5.9 venv "
        f"under {root} (several GB each, minutes to install, once): run `eyas engines setup "
        f"--engines vllm,sglang --sglang-version 0.5.9 --venv-root {root}`, or pass --setup")]
    assert not root.exists()                       # nothing was installed


def test_on_a_terminal_it_asks_and_no_installs_nothing(small_export, tmp_path):
    root = tmp_path / "venvs"
    pid, fd = pty.fork()
    if pid == 0:   # the child: stdin and stderr are the terminal
        os.execv(sys.executable, [*EYAS, "engines", "check", str(small_export), "--target-config",
                                  "tiny-llama", "--engines", "vllm", "--venv-root", str(root)])
    seen = b""
    while b"[y/N]" not in seen:
        seen += os.read(fd, 4096)
    os.write(fd, b"n\n")
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:                             # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3
    text = seen.decode().replace("\r\n", "\n")
    assert (f"eyas engines check: no vllm {DEFAULT_VERSIONS['vllm']} venv under {root} "
            f"(several GB each, minutes to install, once): run `eyas engines setup --engines "
            f"vllm --venv-root {root}`, or pass --setup\ninstall them now? [y/N] n\n") in text
    assert not root.exists()
