import pytest

from bsrkit.cli import main


def test_demo_runs_and_checks_its_result(capsys):
    assert main(["demo", "--size", "128", "--blocksize", "16", "--density", "0.3", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "OK" in text
    assert "plan cache: hits=" in text
    assert "after `del bsr`: entries=0" in text


@pytest.mark.parametrize(
    "argv", [["demo", "--size", "100", "--blocksize", "16"], ["demo", "--density", "-1"], ["nope"]]
)
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
