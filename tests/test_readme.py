"""Every YAML block in the README is loaded and validated; the Quickstart has exactly the two
commands the project promises."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from specgate import admission, api
from specgate_operator import render
from specgate_router.settings import RouterSettings

from .conftest import ROOT

README = (ROOT / "README.md").read_text()
DOCS = README + "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", DOCS, flags=re.S)
YAML_BLOCKS = [body for lang, body in BLOCKS if lang == "yaml"]


def test_quickstart_is_exactly_make_demo_and_make_test() -> None:
    quickstart = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    (commands,) = re.findall(r"```sh\n(.*?)```", quickstart, flags=re.S)
    assert commands.split("\n")[:-1] == ["make demo", "make test"]


def test_readme_has_yaml_blocks() -> None:
    assert len(YAML_BLOCKS) >= 2


@pytest.mark.parametrize("body", YAML_BLOCKS, ids=lambda b: b.split("\n", 1)[0][:40])
def test_yaml_block_is_valid(body: str, schema: dict[str, Any]) -> None:
    doc = yaml.safe_load(body)
    if "model" in doc and "speculative" in doc:  # a resource's spec
        doc = {
            "apiVersion": "specgate.io/v1alpha1",
            "kind": "SpecDecodeDeployment",
            "metadata": {"name": "doc", "namespace": "default"},
            "spec": doc,
        }
    if doc.get("kind") == "SpecDecodeDeployment":
        sdd = api.SpecDecodeDeployment.model_validate(admission.admit(doc, schema))
        assert render.render(sdd)
    else:
        RouterSettings.model_validate(doc)


def test_documented_commands_exist() -> None:
    from specgate.cli import build_parser

    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    documented = re.findall(r"(?:`|bin/|^)specgate ([a-z][\w-]*)", DOCS, flags=re.M)
    assert {"up", "sim", "render", "demo", "router"} <= set(documented)
    for command in documented:
        assert command in commands, command


def test_the_readme_reads_in_five_minutes() -> None:
    """Within 250 lines: a result or a limit is a line with a link, not a paragraph."""
    assert len(README.splitlines()) <= 250
