"""Weights from a hub (specgate/weights.py, `specgate fetch-weights`), against a local server
that speaks the hub's file API (the revision's file list, then each file by commit), as an
engine pod's init container runs it: what it downloads, what it skips, what it refuses.

Not covered here: huggingface.co itself (no network), its redirects to a CDN, and the engine
loading the downloaded files (the GPU jobs load config-only models from local folders)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from specgate import weights
from specgate.weights import FetchError, RepoRef

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_test_token"


class FakeHub:
    """Repositories {repo: {file: bytes}}, one revision each (any name resolves to COMMIT);
    `gated` repositories need the token; `listing` overrides a repository's file list."""

    def __init__(self, repos: dict[str, dict[str, bytes]], gated: set[str] = frozenset()):  # type: ignore[assignment]
        self.repos, self.gated = repos, gated
        self.listing: dict[str, list[Any]] = {}
        self.requests: list[str] = []

    def handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                hub.requests.append(self.path)
                parts = self.path.strip("/").split("/")
                if parts[:2] == ["api", "models"]:
                    repo = "/".join(parts[2:4])
                    files = hub.repos.get(repo)
                    if files is None:
                        return self._send(404, b"{}")
                    if repo in hub.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                        return self._send(401, b"{}")
                    siblings = hub.listing.get(repo, [{"rfilename": f} for f in files])
                    body = json.dumps({"sha": COMMIT, "siblings": siblings}).encode()
                    return self._send(200, body)
                repo, name = "/".join(parts[:2]), "/".join(parts[4:])
                if parts[2:4] != ["resolve", COMMIT] or name not in hub.repos.get(repo, {}):
                    return self._send(404, b"")
                return self._send(200, hub.repos[repo][name])

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler


@contextlib.contextmanager
def serving(hub: FakeHub) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), hub.handler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


REPOS = {
    "acme/tiny-target": {"config.json": b'{"hidden_size": 64}', "weights/model.bin": b"\0" * 3000},
    "acme/tiny-draft": {"config.json": b'{"draft": true}'},
}


def test_a_revision_is_downloaded_once_and_then_taken_from_the_cache(tmp_path: Path) -> None:
    hub = FakeHub(REPOS, gated={"acme/tiny-target"})
    lines: list[str] = []
    with serving(hub) as url:
        ref = RepoRef.parse("acme/tiny-target@v1")
        folder = weights.fetch(ref, tmp_path, endpoint=url, token=TOKEN, log=lines.append)
        assert folder == tmp_path / "acme" / "tiny-target" / "v1"
        assert (folder / "weights" / "model.bin").read_bytes() == b"\0" * 3000
        assert json.loads((folder / weights.COMPLETE).read_text())["commit"] == COMMIT
        assert any("[2/2]" in line for line in lines)  # progress, file by file
        asked = len(hub.requests)
        again = weights.fetch(ref, tmp_path, endpoint=url, token=TOKEN, log=lines.append)
        assert again == folder and len(hub.requests) == asked  # no request at all
        assert lines[-1].endswith(f"in the cache ({folder})")


def test_a_killed_download_starts_over_and_leaves_no_half_revision(tmp_path: Path) -> None:
    hub = FakeHub(REPOS)
    stale = tmp_path / "acme" / "tiny-draft" / "main.partial"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("from a pod killed mid-download")
    with serving(hub) as url:
        folder = weights.fetch(RepoRef.parse("acme/tiny-draft"), tmp_path, endpoint=url,
                               log=lambda _: None)  # fmt: skip
    assert sorted(p.name for p in folder.iterdir()) == [weights.COMPLETE, "config.json"]
    assert not stale.exists()


@pytest.mark.parametrize(
    ("listing", "error"),
    [
        ([{"rfilename": "../../etc/passwd"}], "outside the repository"),
        ([{"rfilename": "/etc/passwd"}], "outside the repository"),
        ([{"rfilename": "a//b"}], "outside the repository"),
        ([{"rfilename": 7}], "not one"),
        ("nonsense", "malformed"),
    ],
)
def test_a_hostile_file_list_writes_nothing(tmp_path: Path, listing: Any, error: str) -> None:
    hub = FakeHub(REPOS)
    hub.listing["acme/tiny-draft"] = listing
    with serving(hub) as url, pytest.raises(FetchError, match=error):
        weights.fetch(RepoRef.parse("acme/tiny-draft"), tmp_path / "cache", endpoint=url,
                      log=lambda _: None)  # fmt: skip
    assert not (tmp_path / "etc").exists()
    assert not list((tmp_path / "cache").rglob("passwd"))


def test_a_gated_repository_without_a_token_says_how_to_give_one(tmp_path: Path) -> None:
    hub = FakeHub(REPOS, gated={"acme/tiny-target"})
    with serving(hub) as url:
        with pytest.raises(FetchError, match="tokenSecretRef"):
            weights.fetch(RepoRef.parse("acme/tiny-target"), tmp_path, endpoint=url,
                          log=lambda _: None)  # fmt: skip
        with pytest.raises(FetchError, match="no such repository"):
            weights.fetch(RepoRef.parse("acme/missing"), tmp_path, endpoint=url,
                          log=lambda _: None)  # fmt: skip


@pytest.mark.parametrize("text", ["acme", "acme/../x", "/abs/path", "acme/x@..", "acme/x@-r"])
def test_malformed_repositories_are_refused(text: str) -> None:
    with pytest.raises(FetchError):
        RepoRef.parse(text)


def test_the_command_downloads_both_models_and_answers_bad_input_in_one_line(
    tmp_path: Path,
) -> None:
    hub = FakeHub(REPOS, gated={"acme/tiny-target"})
    with serving(hub) as url:
        done = subprocess.run(
            [sys.executable, "-m", "specgate.cli", "fetch-weights", "--endpoint", url,
             "--cache", str(tmp_path), "acme/tiny-target@v1", "acme/tiny-draft"],
            capture_output=True, text=True, timeout=60,
            env={"HF_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "acme" / "tiny-draft" / "main" / "config.json").exists()
        bad = subprocess.run(
            [sys.executable, "-m", "specgate.cli", "fetch-weights", "--endpoint", url,
             "--cache", str(tmp_path), "acme/tiny-target@v2"],
            capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
        )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("error: GET ") and "tokenSecretRef" in bad.stderr


def test_the_fetcher_and_the_schema_agree_on_what_a_hub_id_is() -> None:
    from specgate import api

    assert weights.REPO_PATTERN.pattern == api.HUB_REPO
