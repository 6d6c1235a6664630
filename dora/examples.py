"""The example specs shipped with dora (inside the wheel as ``dora/_data/specs``; ``specs/`` in a checkout)."""

from __future__ import annotations

from pathlib import Path


def examples_dir() -> Path:
    package = Path(__file__).resolve().parent
    for candidate in (package / "_data" / "specs", package.parent / "specs"):
        if (candidate / "local-tiny.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"example specs not found next to {package}")


def list_examples() -> list[tuple[str, str]]:
    """(name, first comment line) of every shipped example."""
    out = []
    for path in sorted(examples_dir().glob("*.yaml")):
        first = path.read_text(encoding="utf-8").splitlines()[0].lstrip("# ").strip()
        out.append((path.stem, first))
    return out


def example_text(name: str) -> str | None:
    """The example spec called ``name`` (with or without ``.yaml``), or ``None``: only the shipped examples."""
    name = name.removesuffix(".yaml")
    if name not in {n for n, _ in list_examples()}:
        return None
    return (examples_dir() / f"{name}.yaml").read_text(encoding="utf-8")
