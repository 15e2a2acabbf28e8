"""specgate's release: one version (pyproject.toml's) in every place that names it, a changelog
section for it, the chart packaged, and pushed to an OCI registry when one is given.

    python scripts/release.py check                 # every place agrees (or exit 1 naming one)
    python scripts/release.py set-version 0.2.0     # write a new version to every place
    python scripts/release.py package --out dist [--registry oci://HOST/PATH] [--plain-http]

`make release` runs check, then package (REGISTRY=... PLAIN_HTTP=1 to push; IMAGES=HOST/PATH
also builds the specgate image with scripts/build_image.py and pushes it with crane). The
engine's worker image is built and pushed with docker (docs/install.md).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION_PATTERN = re.compile(r"^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$")


class ReleaseError(Exception):
    """What is wrong, in one line that names the file and the fix."""


@dataclass(frozen=True)
class Place:
    """A file that names the version: `pattern` finds it there (group 1 is the version)."""

    path: str
    pattern: str

    def read(self, root: Path) -> str:
        text = (root / self.path).read_text()
        found = re.search(self.pattern, text, re.M)
        if found is None:
            raise ReleaseError(f"{self.path}: no version found ({self.pattern})")
        return found.group(1)

    def write(self, root: Path, version: str) -> None:
        path = root / self.path
        text = path.read_text()
        found = re.search(self.pattern, text, re.M)
        if found is None:
            raise ReleaseError(f"{self.path}: no version found ({self.pattern})")
        path.write_text(text[: found.start(1)] + version + text[found.end(1) :])


SOURCE = Place("pyproject.toml", r'^version = "([^"]+)"$')
PLACES = (
    Place("charts/specgate/Chart.yaml", r"^version: (\S+)$"),
    Place("charts/specgate/Chart.yaml", r'^appVersion: "([^"]+)"$'),
    Place("charts/specgate/values.yaml", r"^  engineImage: ghcr.io/specgate/worker:(\S+?)-sglang"),
)
"""Where the version is written besides pyproject.toml. The default images in the code follow
the installed package; deploy/operator.yaml and the chart's README are generated from them
(`make deploy chart-docs`, checked by the tests)."""
CHANGELOG = "CHANGELOG.md"


def version(root: Path = ROOT) -> str:
    return str(tomllib.loads((root / SOURCE.path).read_text())["project"]["version"])


def check(root: Path = ROOT) -> str:
    """The version, once every place and the changelog agree on it; ReleaseError otherwise."""
    wanted = version(root)
    for place in PLACES:
        found = place.read(root)
        if found != wanted:
            raise ReleaseError(
                f"{place.path}: version {found}, pyproject.toml says {wanted}:"
                f" run `python scripts/release.py set-version {wanted}`"
            )
    changelog = (root / CHANGELOG).read_text()
    if not re.search(rf"^## \[{re.escape(wanted)}\]", changelog, re.M):
        raise ReleaseError(f"{CHANGELOG}: no '## [{wanted}]' section: say what the release changes")
    return wanted


def set_version(new: str, root: Path = ROOT) -> None:
    if not VERSION_PATTERN.match(new):
        raise ReleaseError(f"version {new!r}: give MAJOR.MINOR.PATCH[-PRERELEASE]")
    for place in (SOURCE, *PLACES):
        place.write(root, new)


IMAGES = ("specgate", "engine-sim")
"""What `make images` builds and a release pushes: the specgate image and the engine stand-in."""


def push_image(archive: Path, reference: str, plain_http: bool, crane: str) -> str:
    """An OCI archive that `make images` built, pushed as `reference`; returns the reference
    with its digest."""
    if not archive.is_file():
        raise ReleaseError(f"{archive}: no image: run `make images`")
    with tempfile.TemporaryDirectory() as layout:
        with tarfile.open(archive) as tar:
            tar.extractall(layout, filter="data")
        insecure = ["--insecure"] if plain_http else []
        _run([crane, "push", layout, reference, *insecure])
        digest = _run([crane, "digest", reference, *insecure]).strip()
    print(f"pushed {reference}@{digest}")
    return f"{reference}@{digest}"


def push_images(image_dir: Path, repository: str, plain_http: bool, crane: str, root: Path) -> None:
    if not re.match(r"^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)*$", repository):
        raise ReleaseError(f"images {repository!r}: give HOST[:PORT]/PATH")
    release = version(root)
    for name in IMAGES:
        archive = image_dir / f"{name}-{release}.oci.tar"
        push_image(archive, f"{repository}/{name}:{release}", plain_http, crane)


def package(
    out: Path, registry: str | None, plain_http: bool, helm: str, root: Path = ROOT
) -> Path:
    """The chart as a .tgz in `out`, pushed to `registry` when given; returns the archive."""
    release = check(root)
    out.mkdir(parents=True, exist_ok=True)
    chart = root / "charts" / "specgate"
    _run([helm, "package", str(chart), "--destination", str(out)])
    archive = out / f"specgate-{release}.tgz"
    if not archive.is_file():
        raise ReleaseError(f"helm package made no {archive.name}")
    print(f"packaged {archive}")
    if registry is not None:
        if not re.match(r"^oci://[^\s/]+(/[^\s]*)?$", registry):
            raise ReleaseError(f"registry {registry!r}: give oci://HOST[:PORT]/PATH")
        plain = ["--plain-http"] if plain_http else []
        pushed = _run([helm, "push", str(archive), registry, *plain])
        print(pushed.strip())
    return archive


def _run(args: list[str]) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["failed"]
        raise ReleaseError(f"{Path(args[0]).name} {args[1]}: {last[0]}")
    return done.stdout + done.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="release.py", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="every place names pyproject.toml's version")
    bump = sub.add_parser("set-version", help="write a new version to every place")
    bump.add_argument("version")
    pack = sub.add_parser("package", help="package the chart (and push it)")
    pack.add_argument("--out", type=Path, default=ROOT / "dist")
    pack.add_argument("--registry", help="oci://HOST[:PORT]/PATH to push the chart to")
    pack.add_argument("--plain-http", action="store_true", help="the registry speaks HTTP")
    pack.add_argument("--helm", default=str(ROOT / ".tools" / "bin" / "helm"))
    pack.add_argument("--images", metavar="HOST/PATH", help="push the specgate image here too")
    pack.add_argument("--image-dir", type=Path, default=ROOT / "dist" / "images")
    pack.add_argument("--crane", default=str(ROOT / ".tools" / "bin" / "crane"))
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            print(f"specgate {check(args.root)}: every place agrees")
        elif args.command == "set-version":
            set_version(args.version, args.root)
            print(f"version {args.version}: now `make deploy chart-docs` and a changelog section")
        else:
            package(args.out, args.registry, args.plain_http, args.helm, args.root)
            if args.images:
                push_images(args.image_dir, args.images, args.plain_http, args.crane, args.root)
    except (ReleaseError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
