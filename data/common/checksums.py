"""Per-file SHA-256 of a directory (a checkpoint, an export), in coreutils `sha256sum` format.

    write_checksums(dir)          # writes dir/SHA256SUMS: "<hex>  <relative path>" per file
    problems = verify_checksums(dir)   # [] when every listed file is there, unchanged

`sha256sum -c SHA256SUMS` checks the same file by hand. Engines ignore the file: vLLM and SGLang
read config.json and *.safetensors only. Hashing uses `hashlib.file_digest` (stdlib, streamed).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from eyas.data.common.utils import atomic_write_bytes

CHECKSUMS_NAME = "SHA256SUMS"


class ChecksumError(ValueError):
    """A file of a checksummed directory is missing or no longer matches its SHA-256."""


@dataclass(frozen=True)
class Problem:
    file: Path
    kind: str        # "missing" | "mismatch" | "unreadable"
    detail: str

    def __str__(self) -> str:
        return f"{self.file}: {self.detail}"


def file_sha256(path: str | os.PathLike) -> str:
    """The hex SHA-256 of a file, read in 1 MiB blocks (hashlib.file_digest needs Python 3.11)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != CHECKSUMS_NAME)


def write_checksums(root: str | os.PathLike) -> Path:
    """Hash every regular file under `root` (recursively) into `root/SHA256SUMS`, atomically."""
    root = Path(root)
    lines = [f"{file_sha256(p)}  {p.relative_to(root).as_posix()}\n" for p in _files(root)]
    return atomic_write_bytes(root / CHECKSUMS_NAME, "".join(lines).encode())


def read_checksums(root: str | os.PathLike) -> dict[str, str] | None:
    """{relative path: hex digest} of `root/SHA256SUMS`, or None when there is none."""
    path = Path(root) / CHECKSUMS_NAME
    if not path.is_file():
        return None
    out = {}
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name:
            raise ChecksumError(f"{path}:{n}: not a sha256sum line ({line[:80]!r}); the "
                                f"checksum file itself is damaged: re-create the directory")
        out[name.removeprefix("*")] = digest.lower()
    return out


def verify_checksums(root: str | os.PathLike) -> list[Problem] | None:
    """Every listed file that is missing or differs (None: the directory has no SHA256SUMS).

    Files the list does not name are not reported here (callers decide what they mean)."""
    root = Path(root)
    listed = read_checksums(root)
    if listed is None:
        return None
    out: list[Problem] = []
    for name, want in listed.items():
        path = root / name
        if not path.is_file():
            out.append(Problem(path, "missing", f"listed in {CHECKSUMS_NAME} but missing"))
            continue
        try:
            got = file_sha256(path)
        except OSError as e:
            out.append(Problem(path, "unreadable", f"unreadable ({e.strerror})"))
            continue
        if got != want:
            out.append(Problem(path, "mismatch", f"SHA-256 differs from {CHECKSUMS_NAME} (file "
                               f"is {path.stat().st_size} bytes): it changed after it was "
                               f"written (truncated copy, bit rot, edited)"))
    return out


def unlisted(root: str | os.PathLike) -> list[Path]:
    """Files under `root` that its SHA256SUMS does not name ([] without a SHA256SUMS)."""
    root = Path(root)
    listed = read_checksums(root) or {}
    return [p for p in _files(root) if listed and p.relative_to(root).as_posix() not in listed]
