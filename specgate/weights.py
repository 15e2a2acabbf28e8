"""Model weights from a hub, for `source.type: hub`: the engine pod's init container runs
`specgate fetch-weights`, which downloads each repository at its revision into the cache
volume, and the engine then loads them from there with the hub switched off.

The transfer is `huggingface_hub`'s (Hugging Face's hub, and mirrors that serve its API): the
revision's file list from the model API, then each chosen file by commit into
`{cache}/{repo}/{revision}`, several at a time. What survives what:
- a connection dropped mid-file: huggingface_hub asks again with a Range request, from the last
  chunk it wrote (10 MiB), up to five times while bytes keep arriving;
- a failure past that, or a 5xx: the whole revision is tried again (ATTEMPTS, backing off),
  and files already complete are kept;
- a container killed mid-file: the next one (a restarted init container on the same emptyDir,
  or any pod on the same claim) keeps the complete files and starts the cut-off file over;
  huggingface_hub writes each transfer to a file of its own process, which is removed here
  once nothing has written to it for STALE_PART_SECONDS.
A revision is marked complete after its last file; a cache that holds it is used without a
request. Pin a commit: a branch name is resolved once per cache and not followed.

Only what SGLang loads is downloaded unless the resource lists patterns: configuration and
tokenizer files, and the safetensors weights (or the PyTorch ones when a repository has no
safetensors), so the duplicate checkpoints many repositories carry (`original/*.pth`) stay on
the hub.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COMPLETE = ".specgate-complete"
MAX_FILES = 100_000
REPO_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
"""OWNER/NAME, as the resource's schema requires (api.HUB_REPO)."""
REVISION_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")
COMMIT_PATTERN = re.compile(r"^[0-9a-f]{40}$")

ENGINE_FILES = ("*.json", "*.model", "*.txt", "*.tiktoken", "*.py", "*.jinja")
"""Configuration, tokenizer and chat-template files: what SGLang reads besides the weights."""
SAFETENSORS = ("*.safetensors",)
PYTORCH = ("*.bin", "*.pt", "*.pth")
"""Weights SGLang loads when a repository has no safetensors (many EAGLE drafts)."""

ATTEMPTS = 5
"""Whole-repository attempts after transient failures, each resuming the files cut off."""
MAX_BACKOFF_SECONDS = 60.0
WORKERS = 8
STALE_PART_SECONDS = 600.0
"""A partial file unchanged this long belongs to a download that is gone (huggingface_hub
gives up on a connection silent for seconds)."""
PROGRESS_SECONDS = 10.0
"""How often the log reports bytes while a revision downloads."""


class FetchError(Exception):
    """A download that cannot go on; the message says what and what to check."""


class TransientError(FetchError):
    """A failure a later attempt may not meet (the network, the hub's 5xx)."""


@dataclass(frozen=True)
class RepoRef:
    repo: str
    revision: str

    @classmethod
    def parse(cls, text: str) -> RepoRef:
        """`owner/name@revision` (revision `main` when absent)."""
        repo, _, revision = text.partition("@")
        revision = revision or "main"
        if not REPO_PATTERN.match(repo) or ".." in repo:
            raise FetchError(
                f"{text!r}: the repository must be OWNER/NAME (letters, digits, . _ -)"
            )
        if not REVISION_PATTERN.match(revision) or ".." in revision.split("/"):
            raise FetchError(f"{text!r}: the revision must be a branch, tag or commit")
        return cls(repo, revision)

    def folder(self, cache: Path) -> Path:
        """Where this revision lives in the cache (a revision with '/' is one folder)."""
        return cache / self.repo / self.revision.replace("/", "--")


def safe_file_name(name: Any) -> str:
    """A repository file name that stays inside its folder; FetchError otherwise."""
    if not isinstance(name, str) or not name or len(name) > 1024:
        raise FetchError(f"the hub listed a file name that is not one: {name!r}")
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
        raise FetchError(f"the hub listed a file outside the repository: {name!r}")
    return name


def choose(names: Sequence[str], patterns: Sequence[str] | None) -> list[str]:
    """The files to download: those matching `patterns`, or by default what SGLang loads
    (configuration and tokenizer files, safetensors weights or else PyTorch ones)."""
    if patterns is None:
        safetensors = any(fnmatch.fnmatch(n, "*.safetensors") for n in names)
        patterns = (*ENGINE_FILES, *(SAFETENSORS if safetensors else PYTORCH))
    return [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]


def _size(count: int) -> str:
    return f"{count / 1e9:.1f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB"


@dataclass
class Budget:
    """The bytes the cache may hold for one pod's repositories (an emptyDir's sizeLimit: past
    it the kubelet evicts the pod, and the next one would download and be evicted again)."""

    limit: int | None
    sizes: dict[RepoRef, int] = field(default_factory=dict)
    """Each repository's bytes, as last listed (a retried listing replaces its own)."""

    def take(self, ref: RepoRef, size: int) -> None:
        self.sizes[ref] = size
        used = sum(self.sizes.values())
        if self.limit is not None and used > self.limit:
            raise FetchError(
                f"{ref.repo}@{ref.revision}: the models need {_size(used)}, over the"
                f" cache's {_size(self.limit)}: raise source.hub.cacheSize or narrow"
                " source.hub.allowPatterns"
            )


@dataclass
class Progress:
    """Bytes received for one revision, reported at most every PROGRESS_SECONDS; the download
    threads add to it through the progress-bar class huggingface_hub accepts."""

    label: str
    total: int
    log: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    done: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _started: float = 0.0
    _reported: float = 0.0

    def __post_init__(self) -> None:
        self._started = self._reported = self.clock()

    def add(self, count: int) -> None:
        with self._lock:
            self.done += count
            now = self.clock()
            if now - self._reported < PROGRESS_SECONDS:
                return
            self._reported = now
            rate = self.done / max(now - self._started, 1e-9)
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        self.log(
            f"{self.label}: {self.done / 1e9:.2f} of {self.total / 1e9:.2f} GB{share},"
            f" {rate / 1e6:.0f} MB/s"
        )

    def bar_class(self) -> type:
        """A class huggingface_hub instantiates per file as its progress bar; each one
        adds what it is told to this revision's count."""
        progress = self

        class Bar:
            def __init__(self, *args: Any, initial: int = 0, **kwargs: Any) -> None:
                progress.add(initial or 0)

            def update(self, count: float | None = 1) -> None:
                progress.add(int(count or 0))

            def close(self) -> None:
                pass

            def __enter__(self) -> Bar:
                return self

            def __exit__(self, *exc: Any) -> None:
                pass

        return Bar


@contextlib.contextmanager
def _explained(what: str) -> Iterator[None]:
    """huggingface_hub's errors as one line that says what to check; transient ones marked so
    the caller tries again."""
    import httpx2
    from huggingface_hub import errors

    try:
        yield
    except FetchError:
        raise
    except errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else 0
        hint = {
            401: "the repository needs a token: set source.hub.tokenSecretRef",
            403: "the token may not read this repository (a gated model needs its terms accepted)",
            404: "no such repository, revision or file: check spec.model.path and its revision",
        }.get(status)
        if hint is None:
            raise TransientError(f"{what}: HTTP {status} from the hub") from None
        raise FetchError(f"{what}: HTTP {status}: {hint}") from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise FetchError(
                f"{what}: the cache volume is full: raise source.hub.cacheSize, the claim's"
                " size, or narrow source.hub.allowPatterns"
            ) from None
        if exc.errno in (errno.EACCES, errno.EROFS):
            raise FetchError(f"{what}: the cache volume is not writable: {exc}") from None
        raise _unreachable(what, exc) from None
    except (httpx2.HTTPError, errors.LocalEntryNotFoundError) as exc:
        raise _unreachable(what, exc) from None


def _unreachable(what: str, exc: BaseException) -> TransientError:
    text = str(exc).strip()
    first = text.splitlines()[0][:300] if text else type(exc).__name__
    return TransientError(f"{what}: {first}: check source.hub.endpoint and the network")


def _listing(ref: RepoRef, endpoint: str, token: str | None) -> tuple[str, dict[str, int]]:
    """The revision's commit and its files with their sizes, checked."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token or False)
    with _explained(f"{ref.repo}@{ref.revision}"):
        try:
            info = api.model_info(ref.repo, revision=ref.revision, files_metadata=True, timeout=60)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise FetchError(f"{ref.repo}: the hub's file list is malformed ({exc})") from None
    commit = getattr(info, "sha", None)
    if not isinstance(commit, str) or not COMMIT_PATTERN.match(commit):
        raise FetchError(f"{ref.repo}: the hub named no commit for {ref.revision}")
    siblings = getattr(info, "siblings", None)
    if not isinstance(siblings, list):
        raise FetchError(f"{ref.repo}: the hub's file list is malformed (no siblings)")
    if len(siblings) > MAX_FILES:
        raise FetchError(f"{ref.repo}: {len(siblings)} files, over {MAX_FILES}")
    sizes: dict[str, int] = {}
    for sibling in siblings:
        size = getattr(sibling, "size", None)
        size = size if isinstance(size, int) and size >= 0 else 0
        sizes[safe_file_name(getattr(sibling, "rfilename", None))] = size
    return commit, sizes


def _download(
    ref: RepoRef,
    target: Path,
    commit: str,
    names: list[str],
    sizes: dict[str, int],
    total: int,
    *,
    endpoint: str,
    token: str | None,
    log: Callable[[str], None],
) -> None:
    from huggingface_hub import hf_hub_download

    label = f"{ref.repo}@{ref.revision}"
    progress = Progress(label, total, log)
    bar = progress.bar_class()
    finished = iter(range(1, len(names) + 1))
    lock = threading.Lock()

    def one(name: str) -> None:
        with _explained(f"{label}: {name}"):
            hf_hub_download(
                ref.repo, name, revision=commit, local_dir=target, endpoint=endpoint,
                token=token or False, tqdm_class=bar,
            )  # fmt: skip
        with lock:
            log(f"{label}: [{next(finished)}/{len(names)}] {name} ({_size(sizes[name])})")

    with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="fetch") as pool:
        for future in [pool.submit(one, name) for name in names]:
            future.result()


def remove_stale_parts(folder: Path, now: float | None = None) -> list[Path]:
    """Remove partial files that killed downloads left in `folder`; returns them. A partial
    file still written to (another pod on a shared claim) is left alone."""
    now = time.time() if now is None else now
    removed = []
    for part in (folder / ".cache" / "huggingface" / "download").glob("**/*.incomplete"):
        with contextlib.suppress(OSError):
            if now - part.stat().st_mtime > STALE_PART_SECONDS:
                part.unlink()
                removed.append(part)
    return removed


def fetch(
    ref: RepoRef,
    cache: Path,
    *,
    endpoint: str,
    token: str | None = None,
    patterns: Sequence[str] | None = None,
    budget: Budget | None = None,
    attempts: int = ATTEMPTS,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> Path:
    """Download `ref` into the cache unless it is there already; returns its folder. Transient
    failures are tried again (`attempts` in all, backing off), each attempt resuming the files
    already begun. With a `budget`, a revision that would take the cache past it is refused
    before anything is downloaded."""
    budget = budget or Budget(None)
    target = ref.folder(cache)
    if (target / COMPLETE).is_file():
        budget.take(ref, _complete_bytes(target))
        log(f"{ref.repo}@{ref.revision}: in the cache ({target})")
        return target
    for attempt in range(1, attempts + 1):
        try:
            commit, sizes = _listing(ref, endpoint, token)
            names = choose(sorted(sizes), patterns)
            if not names:
                raise FetchError(
                    f"{ref.repo}: no file matches {list(patterns or [])}:"
                    " check source.hub.allowPatterns"
                )
            total = sum(sizes[n] for n in names)
            budget.take(ref, total)
            target.mkdir(parents=True, exist_ok=True)
            for part in remove_stale_parts(target):
                log(f"{ref.repo}@{ref.revision}: removed {part.name}, left by a stopped download")
            _download(
                ref, target, commit, names, sizes, total, endpoint=endpoint, token=token, log=log
            )
            break
        except TransientError as exc:
            if attempt == attempts:
                raise FetchError(f"{exc} (after {attempts} attempts)") from None
            pause = min(MAX_BACKOFF_SECONDS, 2.0**attempt)
            log(f"{exc}; attempt {attempt + 1} of {attempts} in {pause:.0f} s")
            sleep(pause)
    marker = {"revision": ref.revision, "commit": commit, "files": names, "bytes": total}
    (target / COMPLETE).write_text(json.dumps(marker))
    log(f"{ref.repo}@{ref.revision}: {len(names)} files, {_size(total)}, commit {commit}")
    return target


def _complete_bytes(folder: Path) -> int:
    try:
        size = json.loads((folder / COMPLETE).read_text()).get("bytes", 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return size if isinstance(size, int) and size >= 0 else 0


def fetch_all(
    endpoint: str,
    cache: Path,
    repos: list[str],
    patterns: Sequence[str] | None = None,
    max_bytes: int | None = None,
) -> int:
    """`specgate fetch-weights`: every REPO[@REVISION] in turn, the token from HF_TOKEN, all of
    them within `max_bytes`; 0, or 2 with one line on stderr."""
    token = os.environ.get("HF_TOKEN", "").strip() or None
    budget = Budget(max_bytes)
    try:
        refs = [RepoRef.parse(text) for text in repos]
        for ref in refs:
            fetch(ref, cache, endpoint=endpoint, token=token, patterns=patterns, budget=budget)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


__all__ = ["Budget", "FetchError", "RepoRef", "choose", "fetch", "fetch_all", "safe_file_name"]
