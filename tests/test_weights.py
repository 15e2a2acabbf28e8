"""Weights from a hub (specgate/weights.py, `specgate fetch-weights`), against a local server
that speaks the hub's file API (the revision's file list, then each file by commit), as an
engine pod's init container runs it: what it downloads, what it skips, what it refuses.

Not covered here: huggingface.co itself (no network), its redirects to a CDN, and the engine
loading the downloaded files (the GPU jobs load config-only models from local folders)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
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
    """Repositories {repo: {file: bytes}}, one revision each (any name resolves to COMMIT),
    served as the hub serves them: the model API with file sizes, then HEAD and GET (with
    Range) on `resolve`. `gated` repositories need the token; `listing` overrides a
    repository's file list; `drop_after[name] = n` cuts the connection after n bytes of that
    file, `drops[name]` times (then serves it whole); `stall[name]` holds that file's body
    after its first half until the event is set."""

    def __init__(self, repos: dict[str, dict[str, bytes]], gated: set[str] = frozenset()):  # type: ignore[assignment]
        self.repos, self.gated = repos, gated
        self.listing: dict[str, list[Any]] = {}
        self.drop_after: dict[str, int] = {}
        self.drops: dict[str, int] = {}
        self.stall: dict[str, threading.Event] = {}
        self.unavailable = 0  # answer the model API 503 this many times
        self.requests: list[str] = []
        self.ranges: list[tuple[str, str]] = []

    def handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                hub.requests.append(f"{self.command} {self.path}")
                path = self.path.split("?")[0]
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"]:
                    repo = "/".join(parts[2:4])
                    files = hub.repos.get(repo)
                    if files is None:
                        return self._send(404, b"{}")
                    if not self._allowed(repo):
                        return self._send(401, b"{}")
                    if hub.unavailable > 0:
                        hub.unavailable -= 1
                        return self._send(503, b"{}")
                    siblings = hub.listing.get(
                        repo, [{"rfilename": f, "size": len(b)} for f, b in files.items()]
                    )
                    info = {"id": repo, "sha": COMMIT, "siblings": siblings}
                    return self._send(200, json.dumps(info).encode())
                repo, name = "/".join(parts[:2]), urllib.parse.unquote("/".join(parts[4:]))
                if parts[2:4] != ["resolve", COMMIT] or name not in hub.repos.get(repo, {}):
                    return self._send(404, b"")
                if not self._allowed(repo):
                    return self._send(401, b"")
                data = hub.repos[repo][name]
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hash(data) & 0xFFFFFFFF:x}"'}
                if not body:
                    return self._send(200, data, headers, body=False)
                start = 0
                if (wanted := self.headers.get("Range")) is not None:
                    hub.ranges.append((name, wanted))
                    start = int(wanted.removeprefix("bytes=").split("-")[0])
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                code, rest = (206 if start else 200), data[start:]
                if hub.drops.get(name, 0) > 0:
                    hub.drops[name] -= 1
                    cut = hub.drop_after[name]
                    self._send(code, rest, headers, body=False, length=len(rest))
                    self.wfile.write(rest[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if name in hub.stall:
                    self._send(code, rest, headers, body=False, length=len(rest))
                    self.wfile.write(rest[: len(rest) // 2])
                    self.wfile.flush()
                    hub.stall[name].wait(30)
                    self.close_connection = True
                    return
                return self._send(code, rest, headers)

            def _allowed(self, repo: str) -> bool:
                auth = self.headers.get("Authorization")
                return repo not in hub.gated or auth == f"Bearer {TOKEN}"

            def _send(
                self, code: int, data: bytes, headers: dict[str, str] | None = None,
                body: bool = True, length: int | None = None,
            ) -> None:  # fmt: skip
                self.send_response(code)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data) if length is None else length))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        return Handler


@contextlib.contextmanager
def serving(hub: FakeHub) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), hub.handler())
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        for event in hub.stall.values():
            event.set()
        server.shutdown()
        server.server_close()


CHUNK = 10 << 20
"""huggingface_hub writes a download in chunks of this size: a transfer cut off resumes from
the last chunk it wrote."""
WEIGHTS = bytes(range(256)) * (24 << 12)  # 24 MiB, in which a misplaced byte shows
REPOS = {
    "acme/tiny-target": {
        "config.json": b'{"hidden_size": 64}',
        "tokenizer.json": b"{}",
        "model.safetensors": WEIGHTS,
        "original/consolidated.00.pth": b"a duplicate checkpoint SGLang never reads",
    },
    "acme/tiny-draft": {"config.json": b'{"draft": true}', "pytorch_model.bin": b"\1" * 999},
}
TARGET_FILES = ["config.json", "model.safetensors", "tokenizer.json"]


def downloaded(folder: Path) -> list[str]:
    """The repository files in a folder (not the markers and huggingface_hub's metadata)."""
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*")
        if p.is_file() and ".cache" not in p.parts and p.name != weights.COMPLETE
    )  # fmt: skip


def test_a_revision_is_downloaded_once_and_then_taken_from_the_cache(tmp_path: Path) -> None:
    hub = FakeHub(REPOS, gated={"acme/tiny-target"})
    lines: list[str] = []
    with serving(hub) as url:
        ref = RepoRef.parse("acme/tiny-target@v1")
        folder = weights.fetch(ref, tmp_path, endpoint=url, token=TOKEN, log=lines.append)
        assert folder == tmp_path / "acme" / "tiny-target" / "v1"
        assert (folder / "model.safetensors").read_bytes() == WEIGHTS
        assert json.loads((folder / weights.COMPLETE).read_text())["commit"] == COMMIT
        assert sum("] " in line and line.count("/3]") for line in lines) == 3  # file by file
        asked = len(hub.requests)
        again = weights.fetch(ref, tmp_path, endpoint=url, token=TOKEN, log=lines.append)
        assert again == folder and len(hub.requests) == asked  # no request at all
        assert lines[-1].endswith(f"in the cache ({folder})")


def test_only_what_the_engine_loads_is_downloaded_unless_patterns_say_otherwise(
    tmp_path: Path,
) -> None:
    hub = FakeHub(REPOS)
    with serving(hub) as url:
        target = weights.fetch(RepoRef.parse("acme/tiny-target"), tmp_path / "a", endpoint=url,
                               log=lambda _: None)  # fmt: skip
        # The checkpoint duplicated under original/ stays on the hub.
        assert downloaded(target) == TARGET_FILES
        # A draft with no safetensors gets its PyTorch weights.
        draft = weights.fetch(RepoRef.parse("acme/tiny-draft"), tmp_path / "a", endpoint=url,
                              log=lambda _: None)  # fmt: skip
        assert downloaded(draft) == ["config.json", "pytorch_model.bin"]
        chosen = weights.fetch(RepoRef.parse("acme/tiny-target"), tmp_path / "b", endpoint=url,
                               patterns=["*.json", "original/*"], log=lambda _: None)  # fmt: skip
        assert downloaded(chosen) == ["config.json", "original/consolidated.00.pth",
                                      "tokenizer.json"]  # fmt: skip
        with pytest.raises(FetchError, match="allowPatterns"):
            weights.fetch(RepoRef.parse("acme/tiny-draft"), tmp_path / "c", endpoint=url,
                          patterns=["*.gguf"], log=lambda _: None)  # fmt: skip


def test_a_connection_dropped_mid_file_resumes_where_it_stopped(tmp_path: Path) -> None:
    hub = FakeHub(REPOS)
    hub.drop_after["model.safetensors"], hub.drops["model.safetensors"] = 15 << 20, 1
    with serving(hub) as url:
        folder = weights.fetch(RepoRef.parse("acme/tiny-target"), tmp_path, endpoint=url,
                               log=lambda _: None)  # fmt: skip
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    # The retry asked for what it lacked from the last chunk written, not the whole file again.
    assert hub.ranges == [("model.safetensors", f"bytes={CHUNK}-")]


def test_a_hub_error_is_tried_again_with_backoff(tmp_path: Path) -> None:
    hub = FakeHub(REPOS)
    hub.unavailable = 2
    lines: list[str] = []
    waits: list[float] = []
    with serving(hub) as url, pytest.raises(FetchError, match="after 2 attempts"):
        weights.fetch(RepoRef.parse("acme/tiny-draft"), tmp_path, endpoint=url, attempts=2,
                      sleep=waits.append, log=lines.append)  # fmt: skip
    assert waits == [2.0] and any("attempt 2 of 2" in line for line in lines)
    assert not (tmp_path / "acme" / "tiny-draft" / "main" / weights.COMPLETE).exists()
    with serving(hub) as url:  # the next start succeeds
        folder = weights.fetch(RepoRef.parse("acme/tiny-draft"), tmp_path, endpoint=url,
                               log=lambda _: None)  # fmt: skip
    assert downloaded(folder) == ["config.json", "pytorch_model.bin"]


def test_models_that_cannot_fit_the_cache_are_refused_before_downloading(tmp_path: Path) -> None:
    """An emptyDir past its sizeLimit gets the pod evicted, and the next pod would download
    and be evicted again: models over the cache's size are refused first, the sizes of the
    revisions already in the cache counted."""
    hub = FakeHub(REPOS)
    command = [sys.executable, "-m", "specgate.cli", "fetch-weights", "--endpoint", "URL",
               "--cache", str(tmp_path), "acme/tiny-draft", "acme/tiny-target"]  # fmt: skip
    with serving(hub) as url:
        command[command.index("URL")] = url
        draft_only = subprocess.run([*command[:-1], "--max-bytes=2000"], capture_output=True,
                                    text=True, timeout=60, env=_env())  # fmt: skip
        assert draft_only.returncode == 0, draft_only.stderr
        # The draft (1 KB) is in the cache; with the target's 24 MiB the two need 25.2 MB.
        too_big = subprocess.run([*command, "--max-bytes=20000000"], capture_output=True,
                                 text=True, timeout=60, env=_env())  # fmt: skip
    assert too_big.returncode == 2
    error = too_big.stderr.strip().splitlines()[-1]  # after the progress lines, one error line
    assert error == (
        "error: acme/tiny-target@main: the models need 25.2 MB, over the cache's 20.0 MB:"
        " raise source.hub.cacheSize or narrow source.hub.allowPatterns"
    )
    assert not any("/resolve/" in r and "model.safetensors" in r for r in hub.requests)
    assert not (tmp_path / "acme" / "tiny-target" / "main").exists()


@pytest.mark.filterwarnings("ignore:Not enough free disk space")  # huggingface_hub's own
def test_a_full_cache_volume_is_named_and_not_tried_again(tmp_path: Path) -> None:
    """A cache too small for the weights (an emptyDir's sizeLimit, a small claim): one line that
    says which setting to raise, at once, not five attempts that fill it again."""
    assert os.geteuid() == 0, "the test mounts a 1 MiB tmpfs (root)"
    cache = tmp_path / "small"
    cache.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(cache)], check=True)
    waits: list[float] = []
    try:
        with serving(FakeHub(REPOS)) as url, pytest.raises(FetchError) as refused:
            weights.fetch(RepoRef.parse("acme/tiny-target"), cache, endpoint=url,
                          sleep=waits.append, log=lambda _: None)  # fmt: skip
    finally:
        subprocess.run(["umount", str(cache)], check=True)
    assert "the cache volume is full: raise source.hub.cacheSize" in str(refused.value)
    assert waits == []


def test_a_killed_download_keeps_its_complete_files_and_its_leftovers_go(
    tmp_path: Path,
) -> None:
    """An init container killed mid-file (a node drain, an OOM kill): the next one, on the
    same cache volume, fetches only the files the first did not finish, and removes the
    partial file the first left once it is stale (not while another download may own it)."""
    hub = FakeHub(REPOS)
    hub.stall["model.safetensors"] = threading.Event()
    command = [sys.executable, "-m", "specgate.cli", "fetch-weights", "--endpoint", "URL",
               "--cache", str(tmp_path), "acme/tiny-target"]  # fmt: skip
    parts = tmp_path / "acme" / "tiny-target" / "main" / ".cache" / "huggingface" / "download"
    with serving(hub) as url:
        command[command.index("URL")] = url
        first = subprocess.Popen(command, stderr=subprocess.DEVNULL, env=_env())
        deadline = time.monotonic() + 60
        finished = [parts / f"{name}.metadata" for name in ("config.json", "tokenizer.json")]
        while time.monotonic() < deadline and not (
            all(p.exists() for p in finished)
            and any(p.stat().st_size >= CHUNK for p in parts.glob("*.incomplete"))
        ):
            time.sleep(0.05)
        first.kill()
        first.wait(10)
        (left,) = parts.glob("*.incomplete")
        assert left.stat().st_size >= CHUNK
        os.utime(left, (time.time() - weights.STALE_PART_SECONDS - 1,) * 2)
        live = parts / "another-pods-download.incomplete"
        live.write_bytes(b"still being written")
        del hub.stall["model.safetensors"]
        asked = len(hub.requests)
        second = subprocess.run(command, capture_output=True, text=True, timeout=60, env=_env())
    assert second.returncode == 0, second.stderr
    assert f"removed {left.name}" in second.stderr
    assert not left.exists() and live.exists()
    folder = tmp_path / "acme" / "tiny-target" / "main"
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    fetched = [r for r in hub.requests[asked:] if r.startswith("GET /acme/")]
    assert [r.rsplit("/", 1)[1] for r in fetched] == ["model.safetensors"]


def _env(**extra: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", **extra}


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
            env=_env(HF_TOKEN=TOKEN),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "acme" / "tiny-draft" / "main" / "config.json").exists()
        chosen = subprocess.run(
            [sys.executable, "-m", "specgate.cli", "fetch-weights", "--endpoint", url,
             "--cache", str(tmp_path / "b"), "--allow=config.*", "acme/tiny-draft"],
            capture_output=True, text=True, timeout=60, env=_env(),
        )  # fmt: skip
        assert chosen.returncode == 0, chosen.stderr
        assert downloaded(tmp_path / "b" / "acme" / "tiny-draft" / "main") == ["config.json"]
        bad = subprocess.run(
            [sys.executable, "-m", "specgate.cli", "fetch-weights", "--endpoint", url,
             "--cache", str(tmp_path), "acme/tiny-target@v2"],
            capture_output=True, text=True, timeout=60, env=_env(),
        )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("error: acme/tiny-target@v2: HTTP 401: ")
    assert "tokenSecretRef" in bad.stderr


def test_the_fetcher_and_the_schema_agree_on_what_a_hub_id_is() -> None:
    from specgate import api

    assert weights.REPO_PATTERN.pattern == api.HUB_REPO
