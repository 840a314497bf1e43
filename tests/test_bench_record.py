"""pi-bench's result records (bench/record.py): the machine kind, the schema, and files from before it."""

import json

import pytest

from bench import record


def test_result_record_schema(tmp_path):
    info = {"hostname": "h", "gpu": "NVIDIA H200", "gpu_count": 1, "nproc": 16}
    assert record.machine_kind(info) == "nvidia-h200"
    assert record.machine_kind({**info, "gpu_count": 2}) == "nvidia-h200-x2"
    assert record.machine_kind({**info, "gpu": "NVIDIA H100 80GB HBM3"}) == "nvidia-h100"
    assert record.machine_kind({"gpu": None}) == "cpu"
    rec = record.write_result(tmp_path / "r.json", {"tok_s": 1.5}, machine_info=info, commit="abc1234",
                              command="pi-bench --stage bench")
    back = json.loads((tmp_path / "r.json").read_text())
    assert back == rec and set(back) == {*record.HEADER, "figures"} and back["machine_kind"] == "nvidia-h200"
    assert back["figures"] == {"tok_s": 1.5} and record.read(tmp_path / "r.json") == back
    assert record.flat(back)["tok_s"] == 1.5 and record.flat(back)["commit"] == "abc1234"
    with pytest.raises(ValueError):
        record.write(tmp_path / "bad.json", {"figures": {}})
    # a file from before the schema: its flat keys become figures, its header keys the header
    (tmp_path / "old.json").write_text(json.dumps({"machine": info, "command": "python x", "created": "2026-01-01",
                                                   "systems": {}}))
    old = record.read(tmp_path / "old.json")
    assert old["machine_kind"] == "nvidia-h200" and old["figures"] == {"systems": {}} and old["commit"] == "unknown"
    assert record.make({}, machine_info=info)["commit"] != ""  # this checkout's commit (or "unknown")
