"""The malformed-spec corpus: every file in tests/data/bad_specs/ declares the exact diagnostics it must produce.

A header line `# expect: <yaml path> | <message regex>` per expected diagnostic; the set of reported paths must
equal the declared set (nothing missing, nothing extra), and each message must match.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dora.spec import SpecError, load_spec
from dora.spec.diagnostics import format_path

CORPUS = Path(__file__).resolve().parent.parent / "data" / "bad_specs"
CASES = sorted(CORPUS.glob("*.yaml"))


def _expectations(path: Path) -> list[tuple[str, str]]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("# expect: "):
            where, _, regex = line[len("# expect: "):].partition(" | ")
            out.append((where.strip(), regex.strip()))
    return out


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_bad_spec_reports_exact_diagnostics(case: Path) -> None:
    expected = _expectations(case)
    assert expected, f"{case.name} declares no expectations"
    with pytest.raises(SpecError) as info:
        load_spec(str(case))
    got = {}
    for d in info.value.diagnostics:
        got.setdefault("" if not d.path else format_path(d.path), []).append(d)
    assert set(got) == {w for w, _ in expected}, "\n" + info.value.render()
    for where, regex in expected:
        assert any(re.search(regex, d.message) for d in got[where]), f"{where}: {regex!r} not in\n{info.value.render()}"
        for d in got[where]:
            assert d.hint, f"{where}: diagnostic has no fix hint"
            if where and case.stem != "alias_bomb":
                assert d.line is not None and d.line > 0, f"{where}: no line number"


def test_line_numbers_point_at_the_field() -> None:
    with pytest.raises(SpecError) as info:
        load_spec(str(CORPUS / "nodes_zero.yaml"))
    (diag,) = info.value.diagnostics
    text = (CORPUS / "nodes_zero.yaml").read_text().splitlines()
    assert text[diag.line - 1].strip() == "nodes: 0"


def test_cli_exit_code_and_no_traceback() -> None:
    bad = [str(CORPUS / "all_at_once.yaml"), str(CORPUS / "alias_bomb.yaml"), str(CORPUS / "not_yaml.yaml")]
    proc = subprocess.run([sys.executable, "-m", "dora.cli", "validate", *bad], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "did you mean 'preset'" in proc.stderr
    assert "to fix:" in proc.stderr


def test_missing_file_is_a_diagnostic() -> None:
    with pytest.raises(SpecError, match="file does not exist"):
        load_spec(str(CORPUS / "no-such-spec.yaml"))
