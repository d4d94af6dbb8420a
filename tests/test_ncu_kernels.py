"""benchmarks/ncu_kernels.py: the driver Nsight Compute profiles runs each kernel on CPU too."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import ncu_kernels  # noqa: E402


@pytest.mark.parametrize(
    "argv",
    [
        ["quantize", "--tokens", "64", "--options", '{"num_warps": 4}'],
        ["decode", "--tokens", "384", "--options", '{"blocks_per_split": 2}'],
    ],
)
def test_runs_each_kernel(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ncu_kernels.py", *argv])
    ncu_kernels.main()
    out = capsys.readouterr().out
    assert f"{argv[0]} call 0 done" in out and f"{argv[0]} call 1 done" in out


def test_rejects_unknown_options(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ncu_kernels.py", "quantize", "--tokens", "64",
                                      "--options", '{"num_warps": 3}'])  # fmt: skip
    with pytest.raises(ValueError, match="num_warps"):
        ncu_kernels.main()
