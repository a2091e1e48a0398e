"""The prepared GPU script runs end to end (here on CPU, with the tiny model's config and random weights)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from looped_kv import cli
from looped_kv.experiments import gpu_check


def test_gpu_check_on_cpu(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert cli.main(["gpu-check", "--config", "tiny", "--device", "cpu", "--batch-sizes", "1", "2", "3",
                     "--prompt-tokens", "8", "--new-tokens", "2", "--draft-loops", "1", "2", "--repeats", "1", "--out",
                     str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["weights"].startswith("random")
    for cache in ("full", "deepest"):
        cells = result[f"memory {cache}"]["cells"]
        assert [c["batch"] for c in cells] == [1, 2, 3]
        assert all(c["peak_bytes"] >= c["cache_bytes"] > 0 for c in cells)
    assert result["memory full"]["cache_per_seq"] > result["memory deepest"]["cache_per_seq"]
    assert [row["d"] for row in result["cost check"]] == [1, 2]
    assert all(0 < row["Eq. 8 c(d)/c(R)"] < 1 for row in result["cost check"])
    assert result["measurement mode"]["torch"] == torch.__version__ and "cudnn_sdp" in result["measurement mode"]
    assert result["environment"]["torch"] == torch.__version__ and "cuda" in result["environment"]
    tables = gpu_check.record_tables(result)
    assert list(tables["memory"].index) == [(c, b) for c in ("full", "deepest") for b in (1, 2, 3)]
    fitted = tables["memory"].xs(1, level="B")  # fitted cells: the model equals the measurement
    assert (fitted["error"].abs() < 1e-9).all()
    assert list(tables["cost"].index) == [1, 2] and (tables["cost"]["ratio measured / Eq. 8"] > 0).all()


TINY = ["--config", "tiny", "--device", "cpu", "--batch-sizes", "1", "2", "3", "--prompt-tokens", "8"]


@pytest.mark.parametrize("argv, message", [
    ([*TINY, "--repeats", "0"], "--repeats must be >= 1, got 0"),
    ([*TINY, "--draft-loops", "0"], r"--draft-loops must each be in \[1, 31\] .* got \[0\]"),
    ([*TINY, "--draft-loops", "4", "32", "40"], r"--draft-loops must each be in \[1, 31\] .* got \[32, 40\]"),
    ([*TINY, "--new-tokens", "0"], "--new-tokens must be >= 1"),
    (["--config", "tiny", "--device", "cpu", "--batch-sizes", "1", "2"], "at least 3 distinct sizes"),
    (["--config", "tiny", "--device", "cpu", "--batch-sizes", "1", "1", "2"], "at least 3 distinct sizes"),
    (["--config", "tiny", "--device", "cpu", "--batch-sizes", "0", "1", "2"], "--batch-sizes must all be >= 1"),
    ([*TINY, "--prompt-tokens", "1020", "--new-tokens", "8"], "exceeds the context of --config tiny"),
    ([*TINY, "--device", "foo"], "--device 'foo' is not a torch device name; available here: cpu"),
    ([*TINY, "--out", "no/such/folder/check.json"], "does not exist or is not writable"),
    pytest.param([*TINY, "--device", "cuda"], "--device 'cuda': no cuda device is available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
])
def test_bad_arguments_fail_before_any_work(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(gpu_check, "random_model", no_work)
    assert cli.main(["gpu-check", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert err.startswith("looped-kv gpu-check: error: ") and len(err.splitlines()) == 1


def test_bare_import_exposes_measurement_mode():
    """The GPU appendix calls looped_kv.measurement_mode() after a bare `import looped_kv`."""
    code = ("import looped_kv\n"
            "with looped_kv.measurement_mode() as record:\n"
            "    print(sorted(record))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "cudnn_sdp" in result.stdout
