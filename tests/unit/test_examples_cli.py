"""`dora examples`: the shipped example specs can be listed and copied out."""

from __future__ import annotations

from dora.cli import main
from dora.examples import example_text, list_examples


def test_list_and_print(capsys) -> None:
    names = [n for n, _ in list_examples()]
    assert "local-tiny" in names and len(names) >= 6
    assert main(["examples"]) == 0
    assert "local-tiny" in capsys.readouterr().out
    assert main(["examples", "local-tiny"]) == 0
    assert capsys.readouterr().out == example_text("local-tiny")


def test_unknown_example_suggests(capsys) -> None:
    assert main(["examples", "local-tin"]) == 2
    assert "did you mean 'local-tiny'" in capsys.readouterr().err
