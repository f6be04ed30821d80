"""The one ``--json`` tail: every result file carries the machine that measured it."""

import json

from echo_rl.core.machine import machine_info, write_result


def test_a_result_carries_its_machine(tmp_path):
    doc = write_result(tmp_path / "r.json", {"runs": [1, 2], "path": tmp_path}, indent=1)
    back = json.loads((tmp_path / "r.json").read_text())
    assert back == {**doc, "path": str(tmp_path)}  # not JSON-native values are written as text
    assert list(back) == ["machine", "runs", "path"]
    assert back["machine"]["cpu_count"] == machine_info()["cpu_count"]
