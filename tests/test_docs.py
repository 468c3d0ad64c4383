"""The docs stay true: the API reference is what its generator makes of crds/ and the env
contract, and every relative link in docs/ and the chart's NOTES points at a real file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipejob.core import contract
from pipejob.operator import apidoc

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_api_reference_is_current() -> None:
    committed = (DOCS / "api-reference.md").read_text()
    assert committed == apidoc.render(), (
        "docs/api-reference.md is stale: python -m pipejob.operator.apidoc > docs/api-reference.md"
    )


def test_api_reference_documents_every_field_and_variable() -> None:
    text = apidoc.render()
    for crd in apidoc.load_crds():
        kind = crd["spec"]["names"]["kind"]
        assert f"## {kind}" in text
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for field in schema["properties"]["spec"]["properties"]:
            assert f"| `spec.{field}`" in text, (kind, field)
    for name, meaning in contract.DOCS.items():
        assert f"| `{name}` | {meaning} |" in text


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CODE = re.compile(r"`[^`]*`")  # regexes and CEL in code spans are not links


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    for target in LINK.findall(CODE.sub("", page.read_text())):
        if "://" not in target:
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_paths_named_in_the_guide_exist() -> None:
    """Files the user guide tells a user to apply or read are there."""
    guide = (DOCS / "user-guide.md").read_text()
    named = set(re.findall(r"(?:examples|crds|charts)/[\w./-]+\.ya?ml", guide))
    assert named
    for path in named:
        assert (ROOT / path).exists(), path
