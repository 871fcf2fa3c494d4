"""The CLI: JSON doctor report on a tiny model, clear errors without tracebacks."""

import json

from fusionrag.cli import main


def test_doctor_on_tiny_model_prints_json(capsys):
    assert main(["doctor", "--model", "tiny-llama", "--compact"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["model"] == "tiny-llama"


def test_unknown_model_is_one_line_error(capsys, fusionrag_home):
    assert main(["doctor", "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusionrag: error: unknown model") and "Traceback" not in err
