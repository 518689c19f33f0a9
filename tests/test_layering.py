"""The layering the shared tool does not know: the foundation package imports none of the
product's packages (the contracts it holds, metric names, the series format, the bounded
server..., are read by every package without a circle), and the vLLM-only tier never imports the
proxy's package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("exporter", "detector", "rules", "dashboard", "reproduce", "retrywatch")


def _imported(path: Path) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
    return out


def test_foundation_imports_no_product_package() -> None:
    files = sorted((ROOT / "foundation").rglob("*.py"))
    assert files
    upward = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in files
        for module, line in _imported(path)
        if module.split(".")[0] in PRODUCT
    ]
    assert upward == []


def test_the_detector_rules_and_dashboard_never_import_the_proxy() -> None:
    """The vLLM-only tier (the detector's signals and alerts, the rules, the dashboard) runs where
    no proxy is deployed: nothing of it imports the proxy's package, lazily or not."""
    files = [p for top in ("detector", "rules", "dashboard") for p in sorted((ROOT / top).rglob("*.py"))]
    assert files
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in files
        for module, line in _imported(path)
        if module.split(".")[0] == "exporter"
    ]
    assert found == []
