"""Manifests read as kubectl reads them (YAML 1.2 core-schema values, merge keys, duplicate
keys refused) and hostile input refused with the line it is on, on PyYAML's pure-Python
SafeLoader with its resolvers and constructors replaced. docs/architecture.md, "The spec and
its validation, part by part"."""

from __future__ import annotations

import math
import re
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import BaseResolver
from yaml.scanner import Scanner

from pipejob.core.k8s import KubeObject

MAX_BYTES = 1024 * 1024  # a manifest file; the API server's own request limit is 3 MiB
MAX_DEPTH = 64  # nesting of mappings and lists: Kubernetes objects need about 15
MAX_NODES = 100_000  # values after expanding aliases: a billion laughs stops here

STR = "tag:yaml.org,2002:str"
INT = "tag:yaml.org,2002:int"
FLOAT = "tag:yaml.org,2002:float"
BOOL = "tag:yaml.org,2002:bool"
NULL = "tag:yaml.org,2002:null"
SEQ = "tag:yaml.org,2002:seq"
MAP = "tag:yaml.org,2002:map"
MERGE = "tag:yaml.org,2002:merge"


class YamlError(ValueError):
    """Why a document cannot be read; `line` is 1-based, or None for the whole file."""

    def __init__(self, reason: str, line: int | None = None):
        self.reason = reason
        self.line = line
        super().__init__(f"line {line}: {reason}" if line else reason)


class Resolver12(BaseResolver):
    """The YAML 1.2 core schema's plain-scalar meanings, nothing from YAML 1.1."""


_RESOLVERS = [
    (BOOL, r"true|True|TRUE|false|False|FALSE", "tTfF"),
    (INT, r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", "-+0123456789"),
    (FLOAT, r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?", "-+.0123456789"),
    (FLOAT, r"[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)", "-+."),
    (NULL, r"~|null|Null|NULL|", ["~", "n", "N", ""]),
    (MERGE, r"<<", "<"),  # not YAML 1.2, but kubectl's YAML reads merge keys
]
for _tag, _pattern, _first in _RESOLVERS:
    Resolver12.add_implicit_resolver(_tag, re.compile(f"^(?:{_pattern})$"), list(_first))


class Constructor12(SafeConstructor):
    """JSON values only: strings, numbers, booleans, null, lists and string-keyed maps."""

    yaml_constructors: dict = {}

    def construct_mapping(self, node: Node, deep: bool = False) -> KubeObject:
        """A mapping of string keys, each once; YAML merge keys (<<) as kubectl reads them."""
        if not isinstance(node, MappingNode):
            raise ConstructorError(None, None, "expected a mapping", node.start_mark)
        own = sum(1 for key_node, _ in node.value if key_node.tag != MERGE)
        self.flatten_mapping(node)  # merged pairs first: the mapping's own keys override them
        merged = len(node.value) - own
        out: KubeObject = {}
        own_keys: set[str] = set()
        for i, (key_node, value_node) in enumerate(node.value):
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):
                got = repr(key) if isinstance(key_node, ScalarNode) else "a list or mapping"
                raise ConstructorError(
                    None, None, f"keys must be strings, got {got}", key_node.start_mark
                )
            if i >= merged:  # the mapping's own key: once only
                if key in own_keys:
                    where = key_node.start_mark
                    raise ConstructorError(None, None, f"duplicate key {key!r}", where)
                own_keys.add(key)
            out[key] = self.construct_object(value_node, deep=deep)
        return out


def _int(loader: Constructor12, node: ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text.startswith("0o"):
        return int(text[2:], 8)
    if text.startswith("0x"):
        return int(text[2:], 16)
    return int(text, 10)  # "012" is twelve in YAML 1.2


def _float(loader: Constructor12, node: ScalarNode) -> float:
    text = loader.construct_scalar(node).lower()
    if text.lstrip("+-") == ".inf":
        return -math.inf if text.startswith("-") else math.inf
    if text == ".nan":
        return math.nan
    return float(text)


def _bool(loader: Constructor12, node: ScalarNode) -> bool:
    return loader.construct_scalar(node).lower() == "true"


def _unsupported(loader: Constructor12, node: Node) -> None:
    tag = node.tag.replace("tag:yaml.org,2002:", "!!")
    raise ConstructorError(
        None,
        None,
        f"the tag {tag} is not supported: a manifest holds strings, numbers, booleans,"
        " null, lists and mappings (as JSON does)",
        node.start_mark,
    )


Constructor12.add_constructor(STR, SafeConstructor.construct_yaml_str)
Constructor12.add_constructor(INT, _int)
Constructor12.add_constructor(FLOAT, _float)
Constructor12.add_constructor(BOOL, _bool)
Constructor12.add_constructor(NULL, SafeConstructor.construct_yaml_null)
Constructor12.add_constructor(SEQ, SafeConstructor.construct_yaml_seq)
Constructor12.add_constructor(MAP, SafeConstructor.construct_yaml_map)
Constructor12.add_constructor(None, _unsupported)


class BoundedComposer(Composer):
    """Refuses nesting deeper than MAX_DEPTH and aliases that refer to themselves."""

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0
        self._open: set[str] = set()  # anchors whose node is still being composed

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            if event.anchor in self._open:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"alias *{event.anchor} refers to itself (a recursive value)",
                    event.start_mark,
                )
            return super().compose_node(parent, index)
        event = self.peek_event()
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_DEPTH} levels", event.start_mark
            )
        anchor = getattr(event, "anchor", None)
        if anchor:
            self._open.add(anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
            if anchor:
                self._open.discard(anchor)


class Loader12(Reader, Scanner, Parser, BoundedComposer, Constructor12, Resolver12):
    def __init__(self, stream: str) -> None:
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)
        BoundedComposer.__init__(self)
        Constructor12.__init__(self)
        Resolver12.__init__(self)


def _expanded_size(node: Node, sizes: dict[int, int]) -> int:
    """Values `node` stands for once every alias is expanded (shared nodes counted each time)."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    size = 1
    if isinstance(node, SequenceNode):
        size += sum(_expanded_size(n, sizes) for n in node.value)
    elif isinstance(node, MappingNode):
        size += sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    sizes[id(node)] = size
    return size


def decode(data: bytes) -> str:
    """The file's text: UTF-8 (a byte-order mark is allowed), nothing else."""
    if len(data) > MAX_BYTES:
        raise YamlError(f"the file is larger than {MAX_BYTES} bytes, the most a manifest may be")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise YamlError(
            f"not UTF-8 text (byte 0x{data[e.start]:02x} cannot start a character)", line
        ) from None


def load_all(text: str) -> list[Any]:
    """Every non-empty document of `text` as JSON-like values; YamlError says what is wrong."""
    docs = []
    loader = None
    try:
        loader = Loader12(text)
        while loader.check_node():
            node = loader.get_node()
            if _expanded_size(node, {}) > MAX_NODES:
                raise YamlError(
                    f"the document expands to more than {MAX_NODES} values (aliases that multiply)",
                    node.start_mark.line + 1,
                )
            value = loader.construct_document(node)
            if value is not None:
                docs.append(value)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise YamlError(e.problem or str(e), mark.line + 1 if mark else None) from None
    except yaml.YAMLError as e:  # a reader error: a character YAML does not allow
        raise YamlError(str(e).splitlines()[0]) from None
    except RecursionError:  # deep flow nesting inside a single scalar context
        raise YamlError(f"nested deeper than {MAX_DEPTH} levels") from None
    finally:
        if loader is not None:
            loader.dispose()
    return docs
