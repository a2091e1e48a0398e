"""The prepared GPU script runs end to end (here on CPU, with the tiny model's config and random weights)."""

from __future__ import annotations

import json

from looped_kv import gpu_check


def test_gpu_check_on_cpu(tmp_path, capsys):
    out = tmp_path / "check.json"
    gpu_check.main(["--config", "tiny", "--device", "cpu", "--batch-sizes", "1", "2", "3", "--prompt-tokens", "8",
                    "--new-tokens", "2", "--draft-loops", "1", "2", "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["weights"].startswith("random")
    for cache in ("full", "deepest"):
        cells = result[f"memory {cache}"]["cells"]
        assert [c["batch"] for c in cells] == [1, 2, 3]
        assert all(c["peak_bytes"] >= c["cache_bytes"] > 0 for c in cells)
    assert result["memory full"]["cache_per_seq"] > result["memory deepest"]["cache_per_seq"]
    assert [row["d"] for row in result["cost check"]] == [1, 2]
    assert all(0 < row["Eq. 8 c(d)/c(R)"] < 1 for row in result["cost check"])
