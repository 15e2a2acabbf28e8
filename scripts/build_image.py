"""Build the specgate image (operator and routers) as an OCI archive without a container engine:
what the root Dockerfile makes, from Debian packages and PyPI wheels.

    python scripts/build_image.py --out dist/images [--cache .tools/image-cache]

Two layers: a Debian bookworm root filesystem with Python 3.11 (mmdebstrap, as root) and the
specgate wheel with its dependencies (pip, manylinux wheels for CPython 3.11, byte code compiled
with hash-based validation). Every file's time is SOURCE_DATE_EPOCH (default: the last commit's),
owners are root, entries sorted, gzip without a timestamp: the same packages and wheels give
the same digest. The image's user, entrypoint, command and environment are the Dockerfile's
(tests/test_image_build.py checks they agree and runs the image's `specgate` in a chroot).

Prints each step with its time, then the archive, its digest and its size.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3-minimal", "libpython3.11-stdlib", "ca-certificates", "libstdc++6")
"""Debian's Python 3.11 (the Dockerfile's python:3.11-slim is the same minor release), and the
C++ runtime that compiled wheels need (google-re2, which cel-python imports)."""
ACCOUNT = "specgate:x:65532:65532:specgate:/nonexistent:/usr/sbin/nologin"
"""The user the pods run as (the Dockerfile's USER), named in /etc/passwd: Python's
getpass.getuser(), which kopf calls for its identity, fails for a uid without an entry."""
EXCLUDED = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*", "/usr/share/info/*")
SITE = "usr/local/lib/python3.11/dist-packages"
"""Where Debian's python3 finds packages not from Debian."""
REPOSITORY = "ghcr.io/specgate/specgate"
STANDIN_REPOSITORY = "ghcr.io/specgate/engine-sim"
"""The engine stand-in: the specgate image plus an `sglang.launch_server` that serves one
simulated pod from the command line the operator renders (specgate_sim.sglang_launch), for
clusters and tests without a GPU. It is not SGLang."""
STANDIN_SHIM = {
    "__init__.py": '"""The engine stand-in, not SGLang: see specgate_sim.sglang_launch."""\n',
    "launch_server.py": (
        '"""One simulated pod from the patched SGLang command line."""\n\n'
        "import sys\n\nfrom specgate_sim.sglang_launch import main\n\nsys.exit(main())\n"
    ),
}


class BuildError(Exception):
    """A step failed; the message names it and its last output line."""


@dataclass(frozen=True)
class ImageConfig:
    """What the Dockerfile's final stage sets, read from it (one source of truth)."""

    user: str
    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]

    @classmethod
    def from_dockerfile(cls, text: str) -> ImageConfig:
        final = text[text.rindex("\nFROM ") :]
        user = re.search(r"^USER (\S+)$", final, re.M)
        entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", final, re.M)
        cmd = re.search(r"^CMD (\[.*\])$", final, re.M)
        env: dict[str, str] = {}
        for line in re.findall(r"^ENV (.+)$", final, re.M):
            env.update(dict(pair.split("=", 1) for pair in line.split()))
        if not (user and entrypoint and cmd):
            raise BuildError("Dockerfile: its final stage needs USER, ENTRYPOINT and CMD")
        return cls(user[1], json.loads(entrypoint[1]), json.loads(cmd[1]), env)


def _step(name: str, args: list[str], **kw: object) -> None:
    started = time.monotonic()
    print(f"{name} ...", flush=True)
    done = subprocess.run(args, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["failed"]
        raise BuildError(f"{name}: {last[0]}")
    print(f"{name}: {time.monotonic() - started:.0f} s", flush=True)


def debian_rootfs(out: Path, epoch: int) -> None:
    """Debian with Python 3.11 as a tar (mmdebstrap is reproducible with SOURCE_DATE_EPOCH)."""
    if shutil.which("mmdebstrap") is None:
        raise BuildError("mmdebstrap is missing: apt-get install mmdebstrap (make tools does)")
    args = [
        "mmdebstrap",
        "--quiet",
        "--mode=root",
        "--variant=essential",
        f"--include={','.join(PACKAGES)}",
        *(f"--dpkgopt=path-exclude={p}" for p in EXCLUDED),
        f"--customize-hook=echo '{ACCOUNT}' >> \"$1/etc/passwd\"",
        "--customize-hook=echo 'specgate:x:65532:' >> \"$1/etc/group\"",
        SUITE,
        str(out),
        MIRROR,
    ]
    _step("debian root filesystem", args, env={**os.environ, "SOURCE_DATE_EPOCH": str(epoch)})


def python_tree(tree: Path, wheels: Path, epoch: int) -> None:
    """The specgate wheel and its dependencies, installed as the image's python3 finds them."""
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(epoch)}
    pip = [sys.executable, "-m", "pip"]
    _step(
        "specgate wheel",
        [*pip, "wheel", "--no-deps", "--wheel-dir", str(wheels), str(ROOT)],
        env=env,
    )
    (wheel,) = wheels.glob("specgate-*.whl")
    site = tree / SITE
    # Wheels for the image's CPython 3.11 and glibc (bookworm's 2.36), not the build machine's.
    platforms = [f"--platform=manylinux_2_{minor}_x86_64" for minor in range(17, 37)]
    _step(
        "dependencies",
        [
            *pip,
            "install",
            "--quiet",
            "--no-compile",
            "--target",
            str(site),
            "--only-binary=:all:",
            *platforms,
            "--python-version",
            "3.11",
            "--implementation",
            "cp",
            "--abi",
            "cp311",
            str(wheel),
        ],
        env=env,
    )
    # direct_url.json names the build folder, and pip's scripts in bin/ are replaced by the
    # launcher below: neither is part of the image, nor in the RECORD that lists its files.
    for info in site.glob("*.dist-info"):
        (info / "direct_url.json").unlink(missing_ok=True)
        record = info / "RECORD"
        if record.is_file():
            lines = record.read_text().splitlines(keepends=True)
            kept = [
                line
                for line in lines
                if not line.startswith(("bin/", f"{info.name}/direct_url.json"))
            ]
            record.write_text("".join(kept))
    shutil.rmtree(site / "bin", ignore_errors=True)
    launcher = tree / "usr/local/bin/specgate"
    launcher.parent.mkdir(parents=True, exist_ok=True)
    launcher.write_text(
        "#!/usr/bin/python3\nimport sys\nfrom specgate.cli import main\nsys.exit(main())\n"
    )
    launcher.chmod(0o755)
    _step(
        "byte code",
        [
            sys.executable,
            "-m",
            "compileall",
            "-q",
            "-j",
            "0",
            "--invalidation-mode",
            "unchecked-hash",
            "-d",
            "/" + SITE,
            str(site),
        ],
    )


def _normalized(info: tarfile.TarInfo, epoch: int) -> tarfile.TarInfo:
    info.mtime = epoch
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.pax_headers = {}
    return info


def layer_from_tree(tree: Path, epoch: int) -> bytes:
    """A tar of `tree` (sorted, times and owners fixed)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for path in sorted(tree.rglob("*")):
            name = str(path.relative_to(tree))
            info = _normalized(tar.gettarinfo(str(path), arcname=name), epoch)
            if path.is_file() and not path.is_symlink():
                info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
                with path.open("rb") as handle:
                    tar.addfile(info, handle)
            else:
                tar.addfile(info)
    return buffer.getvalue()


def _gzip(data: bytes) -> bytes:
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=6) as zipped:
        zipped.write(data)
    return out.getvalue()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def oci_archive(
    layers: list[bytes],
    config: ImageConfig,
    version: str,
    epoch: int,
    out: Path,
    *,
    repository: str = REPOSITORY,
    history: tuple[str, ...] = (),
) -> str:
    """An OCI image layout in one tar (what `docker load`, `ctr import`, `skopeo` and
    `crane push` read); returns the manifest's digest."""
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
    blobs: dict[str, bytes] = {}
    compressed = [_gzip(layer) for layer in layers]
    image_config = {
        "created": created,
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "User": config.user,
            "Entrypoint": config.entrypoint,
            "Cmd": config.cmd,
            "Env": [
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                *(f"{k}={v}" for k, v in sorted(config.env.items())),
            ],
            "Labels": {
                "org.opencontainers.image.version": version,
                "org.opencontainers.image.source": "https://github.com/specgate/specgate",
            },
        },
        "rootfs": {"type": "layers", "diff_ids": [_digest(layer) for layer in layers]},
        "history": [{"created": created, "created_by": step} for step in history],
    }
    config_blob = json.dumps(image_config, sort_keys=True, separators=(",", ":")).encode()
    blobs[_digest(config_blob)] = config_blob
    layer_descriptors = []
    for blob in compressed:
        blobs[_digest(blob)] = blob
        layer_descriptors.append(
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": _digest(blob),
                "size": len(blob),
            }
        )
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": _digest(config_blob),
            "size": len(config_blob),
        },
        "layers": layer_descriptors,
    }
    manifest_blob = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    blobs[_digest(manifest_blob)] = manifest_blob
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": _digest(manifest_blob),
                "size": len(manifest_blob),
                "annotations": {
                    "org.opencontainers.image.ref.name": version,
                    "io.containerd.image.name": f"{repository}:{version}",
                },
            }
        ],
    }
    files = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index, sort_keys=True, separators=(",", ":")).encode(),
        **{f"blobs/sha256/{d.removeprefix('sha256:')}": b for d, b in sorted(blobs.items())},
    }
    with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tar:
        for folder in ("blobs", "blobs/sha256"):
            info = _normalized(tarfile.TarInfo(folder), epoch)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data in files.items():
            info = _normalized(tarfile.TarInfo(name), epoch)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return _digest(manifest_blob)


def _commit_epoch() -> int:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "log", "-1", "--format=%ct"], capture_output=True, text=True
    )
    return int(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip() else 0


def build(out_dir: Path, cache: Path, epoch: int) -> list[tuple[Path, str]]:
    """The specgate image and the engine stand-in, as OCI archives in `out_dir`."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    config = ImageConfig.from_dockerfile(DOCKERFILE.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    inputs = json.dumps([SUITE, MIRROR, PACKAGES, EXCLUDED, ACCOUNT, epoch]).encode()
    base = cache / f"debian-{SUITE}-{hashlib.sha256(inputs).hexdigest()[:16]}.tar"
    if not base.is_file():
        for old in cache.glob(f"debian-{SUITE}-*.tar"):
            old.unlink()  # one base kept: a few hundred MB each
        debian_rootfs(base, epoch)
    history = ("mmdebstrap " + " ".join(PACKAGES), f"pip install specgate {version}")
    with tempfile.TemporaryDirectory() as scratch:
        tree, wheels, shim = (Path(scratch) / name for name in ("tree", "wheels", "shim"))
        python_tree(tree, wheels, epoch)
        started = time.monotonic()
        layers = [base.read_bytes(), layer_from_tree(tree, epoch)]
        archive = out_dir / f"specgate-{version}.oci.tar"
        built = [(archive, oci_archive(layers, config, version, epoch, archive, history=history))]
        package = shim / SITE / "sglang"
        package.mkdir(parents=True)
        for name, text in STANDIN_SHIM.items():
            (package / name).write_text(text)
        compile_shim = [sys.executable, "-m", "compileall", "-q", "--invalidation-mode",
                        "unchecked-hash", "-d", f"/{SITE}/sglang", str(package)]  # fmt: skip
        _step("stand-in byte code", compile_shim)
        standin = ImageConfig(
            config.user, ["python3", "-m", "sglang.launch_server"], [], config.env
        )
        archive = out_dir / f"engine-sim-{version}.oci.tar"
        digest = oci_archive(
            [*layers, layer_from_tree(shim, epoch)], standin, version, epoch, archive,
            repository=STANDIN_REPOSITORY, history=(*history, "sglang.launch_server stand-in"),
        )  # fmt: skip
        built.append((archive, digest))
        print(f"layers and archives: {time.monotonic() - started:.0f} s", flush=True)
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "images")
    parser.add_argument(
        "--cache",
        type=Path,
        default=ROOT / ".tools" / "image-cache",
        help="where the Debian root filesystem is kept between builds",
    )
    parser.add_argument(
        "--epoch",
        type=int,
        default=None,
        help="file times (default SOURCE_DATE_EPOCH, else the last commit's)",
    )
    args = parser.parse_args(argv)
    epoch = args.epoch
    if epoch is None:
        epoch = int(os.environ.get("SOURCE_DATE_EPOCH") or _commit_epoch())
    started = time.monotonic()
    try:
        built = build(args.out, args.cache, epoch)
    except (BuildError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    took = time.monotonic() - started
    for archive, digest in built:
        print(f"{archive}: {digest}, {archive.stat().st_size / 1e6:.1f} MB, {took:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
