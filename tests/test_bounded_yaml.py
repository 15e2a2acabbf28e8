"""The one YAML loader (specgate/bounded_yaml.py): every file specgate reads is bounded in
size, depth and alias expansion, and every refusal is one line naming the file and place."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from specgate import bounded_yaml
from specgate_router import client_auth
from specgate_router.settings import SettingsError
from specgate_router.settings import load as load_settings


def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    """About a kilobyte that expands to width**levels nodes."""
    lines = ["l0: &l0 [" + ",".join(["x"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_at_once() -> None:
    text = _alias_bomb()
    assert len(text) < 2000
    started = time.monotonic()
    with pytest.raises(bounded_yaml.YamlError, match=r"^f\.yaml: document 1 expands to more"):
        bounded_yaml.load_all(text, "f.yaml")
    assert time.monotonic() - started < 10  # refused before building anything


def test_aliases_within_the_bound_still_load() -> None:
    assert bounded_yaml.load("a: &x [1, 2]\nb: *x\n", "f") == {"a": [1, 2], "b": [1, 2]}
    assert bounded_yaml.load_all(_alias_bomb(3, 3), "f")[0]["l2"][2][2] == ["x", "x", "x"]


def test_deep_nesting_is_one_line_naming_the_place_not_a_recursion_error() -> None:
    with pytest.raises(bounded_yaml.YamlError) as info:
        bounded_yaml.load("a: " + "[" * 20_000, "deep.yaml")
    assert str(info.value) == "deep.yaml: line 1, column 67: nested deeper than 64 levels"
    assert bounded_yaml.load("a: " + "[" * 60 + "]" * 60, "ok")  # within the bound


def test_a_syntax_error_names_line_and_column_and_never_echoes_the_text() -> None:
    with pytest.raises(bounded_yaml.YamlError) as info:
        bounded_yaml.load("ok: 1\nkey: [sk-secret-value,\nnext: 2: 3\n", "keys.yaml")
    message = str(info.value)
    assert message.startswith("keys.yaml: line 3, column ") and "\n" not in message
    assert "sk-secret-value" not in message


def test_size_is_bounded_before_parsing(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("a: " + "x" * 100)
    with pytest.raises(bounded_yaml.YamlError, match="larger than 50 bytes"):
        bounded_yaml.load_file(big, max_bytes=50)
    with pytest.raises(bounded_yaml.YamlError, match="larger than 50 bytes"):
        bounded_yaml.load("a: " + "x" * 100, "s", max_bytes=50)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"a: \xff\xfe")
    with pytest.raises(bounded_yaml.YamlError, match="not UTF-8"):
        bounded_yaml.load_file(binary)


def test_one_document_where_one_is_expected() -> None:
    assert bounded_yaml.load("", "f") is None
    with pytest.raises(bounded_yaml.YamlError, match="2 YAML documents"):
        bounded_yaml.load("a: 1\n---\nb: 2\n", "f")


def test_the_router_config_error_names_the_line_without_printing_the_key(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text('pods: ["http://a:1"]\nengineApiKey: "sk-do-not-print\n')
    with pytest.raises(SettingsError) as info:
        load_settings(config, environ={})
    assert "sk-do-not-print" not in str(info.value)
    assert str(info.value).startswith(f"{config}: line ")
    config.write_text(_alias_bomb())
    with pytest.raises(SettingsError, match="expands to more"):
        load_settings(config, environ={})


def test_the_client_keys_file_is_read_by_the_bounded_loader(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("- " * 200 + "x\n")
    with pytest.raises(ValueError, match="nested deeper"):
        client_auth.read_keys_file(str(keys))
