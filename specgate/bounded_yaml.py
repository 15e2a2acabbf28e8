"""The one YAML loader for every file specgate reads: resources, the router's config, client keys.

YAML lets a kilobyte describe gigabytes (aliases of aliases: the "billion laughs") and nest deep
enough to exhaust Python's stack, and a file can simply be huge. This loader refuses all three
before building anything: the text is capped in bytes, the node graph in nesting depth and in the
nodes it would expand to, each alias counted at its full size. Every refusal, and every syntax
error, is one line naming the file, the line and the column.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

MAX_BYTES = 4 * 1024 * 1024
"""Largest file read (the API server's own request limit is 3 MiB)."""
MAX_DEPTH = 64
"""Deepest nesting (Kubernetes objects nest about 12 deep)."""
MAX_NODES = 1_000_000
"""Most nodes a document may expand to, aliases counted at their full size."""


class YamlError(ValueError):
    """A file that is not YAML, or that breaks a bound: one line."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts depth while composing (the composer recurses) and refuses a
    document deeper than MAX_DEPTH before Python's stack would."""

    def __init__(self, stream: str, max_depth: int) -> None:
        super().__init__(stream)
        self._depth = 0
        self._max_depth = max_depth

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self._depth += 1
        try:
            if self._depth > self._max_depth:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise YamlError(
                    f"line {mark.line + 1}, column {mark.column + 1}: nested deeper than"
                    f" {self._max_depth} levels"
                )
            node: Node | None = super().compose_node(parent, index)
            return node
        finally:
            self._depth -= 1


def _expanded_size(node: Node, limit: int) -> int:
    """Nodes `node` stands for once every alias is expanded (memoised, so a shared node costs
    one visit), stopping as soon as the count passes `limit`."""
    sizes: dict[int, int] = {}

    def size(n: Node) -> int:
        key = id(n)
        if key in sizes:
            return sizes[key]
        sizes[key] = limit + 1  # a node reached again while it is being counted: a cycle
        total = 1
        if isinstance(n, SequenceNode):
            for child in n.value:
                total += size(child)
                if total > limit:
                    break
        elif isinstance(n, MappingNode):
            for k, v in n.value:
                total += size(k) + size(v)
                if total > limit:
                    break
        sizes[key] = min(total, limit + 1)
        return sizes[key]

    return size(node)


def load_all(
    text: str,
    source: str,
    *,
    max_bytes: int = MAX_BYTES,
    max_depth: int = MAX_DEPTH,
    max_nodes: int = MAX_NODES,
) -> list[Any]:
    """Every document in `text`, or YamlError naming `source` and what is wrong."""
    if len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise YamlError(f"{source}: larger than {max_bytes} bytes")
    loader = _BoundedLoader(text, max_depth)
    docs: list[Any] = []
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            if _expanded_size(node, max_nodes) > max_nodes:
                raise YamlError(
                    f"{source}: document {len(docs) + 1} expands to more than {max_nodes}"
                    " nodes (aliases of aliases?)"
                )
            docs.append(loader.construct_document(node))
    except YamlError as exc:
        message = str(exc)
        raise YamlError(message if message.startswith(source) else f"{source}: {message}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = exc.problem or exc.context or "not valid YAML"
        raise YamlError(f"{source}: {where}{problem}") from None
    except (yaml.YAMLError, RecursionError) as exc:
        raise YamlError(f"{source}: not valid YAML ({type(exc).__name__})") from None
    finally:
        loader.dispose()
    return docs


def load(text: str, source: str, **bounds: int) -> Any:
    """The one document in `text` (None for an empty file), bounded as load_all."""
    docs = load_all(text, source, **bounds)
    if len(docs) > 1:
        raise YamlError(f"{source}: {len(docs)} YAML documents where one is expected")
    return docs[0] if docs else None


def read_text(path: str | Path, max_bytes: int = MAX_BYTES) -> str:
    """A file's text, refusing one larger than `max_bytes` without reading it all (OSError
    for one that cannot be read, YamlError for one too large or not UTF-8)."""
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise YamlError(f"{path}: larger than {max_bytes} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise YamlError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def load_file(path: str | Path, **bounds: int) -> Any:
    """The one document in the file at `path`, bounded as load_all."""
    return load(read_text(path, bounds.get("max_bytes", MAX_BYTES)), str(path), **bounds)


__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_NODES", "YamlError", "load", "load_all", "load_file"]
