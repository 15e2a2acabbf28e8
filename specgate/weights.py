"""Model weights from a hub, for `source.type: hub`: the engine pod's init container runs
`specgate fetch-weights`, which downloads each repository at its revision into the cache
volume, and the engine then loads them from there with the hub switched off.

It speaks the hub's file API (Hugging Face's, and mirrors that serve it): the revision's file
list from `GET {endpoint}/api/models/{repo}/revision/{revision}`, then each file from
`GET {endpoint}/{repo}/resolve/{commit}/{file}`, with the token from HF_TOKEN. A repository
lands in `{cache}/{repo}/{revision}` and is marked complete only after its last file, so a pod
killed mid-download starts over and a cache that holds the revision (a PVC shared by replicas,
or a restarted pod's emptyDir) is used as it is. Pin a commit: a branch name is downloaded
once per cache and not followed.

Standard library only: it runs in the specgate image, and the tests run it against a local
server that speaks the same API.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMPLETE = ".specgate-complete"
MAX_INFO_BYTES = 16 << 20
"""A revision's file list larger than this is refused (a hostile or broken endpoint)."""
MAX_FILES = 100_000
CHUNK = 1 << 20
REPO_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
"""OWNER/NAME, as the resource's schema requires (api.HUB_REPO)."""
REVISION_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")


class FetchError(Exception):
    """A download that cannot go on; the message says what and what to check."""


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


Opener = Callable[[urllib.request.Request], Any]


def _get(opener: Opener, url: str, token: str | None) -> Any:
    request = urllib.request.Request(url, headers={"User-Agent": "specgate-fetch-weights"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        return opener(request)
    except urllib.error.HTTPError as exc:
        hint = {
            401: "the repository needs a token: set source.hub.tokenSecretRef",
            403: "the token may not read this repository (a gated model needs its terms accepted)",
            404: "no such repository or revision: check spec.model.path and its revision",
        }.get(exc.code, "the hub refused the request")
        raise FetchError(f"GET {url}: HTTP {exc.code}: {hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise FetchError(f"GET {url}: {exc}: check source.hub.endpoint and the network") from None


def fetch(
    ref: RepoRef,
    cache: Path,
    *,
    endpoint: str,
    token: str | None = None,
    opener: Opener | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> Path:
    """Download `ref` into the cache unless it is there already; returns its folder."""
    opener = opener or (lambda request: urllib.request.urlopen(request, timeout=60))
    target = ref.folder(cache)
    if (target / COMPLETE).is_file():
        log(f"{ref.repo}@{ref.revision}: in the cache ({target})")
        return target
    base = endpoint.rstrip("/")
    quoted = urllib.parse.quote(ref.revision, safe="")
    with _get(opener, f"{base}/api/models/{ref.repo}/revision/{quoted}", token) as answer:
        raw = answer.read(MAX_INFO_BYTES + 1)
    if len(raw) > MAX_INFO_BYTES:
        raise FetchError(f"{ref.repo}: the hub's file list is over {MAX_INFO_BYTES >> 20} MiB")
    try:
        info = json.loads(raw)
        commit = info["sha"]
        names = [safe_file_name(s.get("rfilename")) for s in info["siblings"]]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FetchError(f"{ref.repo}: the hub's file list is malformed ({exc})") from None
    if not isinstance(commit, str) or not re.fullmatch(r"[0-9A-Za-z]{1,64}", commit):
        raise FetchError(f"{ref.repo}: the hub named no commit for {ref.revision}")
    if len(names) > MAX_FILES:
        raise FetchError(f"{ref.repo}: {len(names)} files, over {MAX_FILES}")
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    total = 0
    for i, name in enumerate(names, 1):
        path = partial / name
        path.parent.mkdir(parents=True, exist_ok=True)
        url = f"{base}/{ref.repo}/resolve/{commit}/{urllib.parse.quote(name)}"
        size = 0
        with _get(opener, url, token) as answer, open(path, "wb") as out:
            while chunk := answer.read(CHUNK):
                out.write(chunk)
                size += len(chunk)
        total += size
        log(f"{ref.repo}@{ref.revision}: [{i}/{len(names)}] {name} ({size / 1e6:.1f} MB)")
    (partial / COMPLETE).write_text(json.dumps({"revision": ref.revision, "commit": commit}))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    log(f"{ref.repo}@{ref.revision}: {len(names)} files, {total / 1e9:.2f} GB, commit {commit}")
    return target


def fetch_all(endpoint: str, cache: Path, repos: list[str]) -> int:
    """`specgate fetch-weights`: every REPO[@REVISION] in turn, the token from HF_TOKEN;
    0, or 2 with one line on stderr."""
    token = os.environ.get("HF_TOKEN", "").strip() or None
    try:
        refs = [RepoRef.parse(text) for text in repos]
        for ref in refs:
            fetch(ref, cache, endpoint=endpoint, token=token)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


__all__ = ["FetchError", "RepoRef", "fetch", "fetch_all", "safe_file_name"]
