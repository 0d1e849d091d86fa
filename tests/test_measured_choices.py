"""Choices measured once per machine and kept on disk (asyncengine/measured_choices.py): a later process reads
them instead of timing again (so every process on a machine multiplies the same way), another machine's are not
used, a broken file or an unwritable directory costs a measurement, never a crash, and two processes measuring at
once measure once."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest


@pytest.fixture
def choices_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCENGINE_CACHE_DIR", str(tmp_path / "choices"))
    return tmp_path / "choices"


def counting(value):
    calls = []
    return calls, lambda: calls.append(1) or value


def test_a_choice_is_measured_once_and_read_back_by_a_fresh_table(choices_dir):
    from asyncengine.measured_choices import MeasuredChoices, machine_fingerprint

    calls, measure = counting(True)
    assert MeasuredChoices("demo").get_or_measure("a", measure) is True
    assert MeasuredChoices("demo").get_or_measure("a", measure) is True  # a new table reads the file, as a process
    assert len(calls) == 1
    assert MeasuredChoices("demo").get_or_measure("b", counting(7)[1]) == 7
    table = json.loads((choices_dir / "demo.json").read_text())
    assert table == {machine_fingerprint(): {"a": True, "b": 7}}


def test_another_machines_choice_is_not_used(choices_dir):
    from asyncengine.measured_choices import MeasuredChoices, machine_fingerprint

    choices_dir.mkdir()
    (choices_dir / "demo.json").write_text(json.dumps({"another CPU | 64 cpus | torch 0": {"a": False}}))
    calls, measure = counting(True)
    assert MeasuredChoices("demo").get_or_measure("a", measure) is True and len(calls) == 1
    table = json.loads((choices_dir / "demo.json").read_text())
    assert table[machine_fingerprint()] == {"a": True} and table["another CPU | 64 cpus | torch 0"] == {"a": False}


def test_a_broken_file_is_measured_again_and_rewritten(choices_dir, caplog):
    from asyncengine.measured_choices import MeasuredChoices, machine_fingerprint

    choices_dir.mkdir()
    (choices_dir / "demo.json").write_text('{"torn')
    with caplog.at_level(logging.WARNING, logger="asyncengine.measured_choices"):
        assert MeasuredChoices("demo").get_or_measure("a", lambda: 3) == 3
    assert "not valid JSON" in caplog.text
    assert json.loads((choices_dir / "demo.json").read_text()) == {machine_fingerprint(): {"a": 3}}


def test_an_unusable_directory_measures_in_the_process_and_warns_once(tmp_path, monkeypatch, caplog):
    from asyncengine.measured_choices import MeasuredChoices

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("ASYNCENGINE_CACHE_DIR", str(blocker / "choices"))  # under a file: cannot be created
    monkeypatch.setattr(MeasuredChoices, "_warned", set())
    calls, measure = counting(5)
    with caplog.at_level(logging.WARNING, logger="asyncengine.measured_choices"):
        assert [MeasuredChoices("demo").get_or_measure("a", measure) for _ in range(2)] == [5, 5]
    assert len(calls) == 2
    assert caplog.text.count("not kept on disk") == 1 and "ASYNCENGINE_CACHE_DIR" in caplog.text


SLOW_MEASURE = """
import sys, time
from asyncengine.measured_choices import MeasuredChoices
def measure():
    with open(sys.argv[1], "a") as marker:
        marker.write("measured\\n")
    time.sleep(1.0)
    return "slow"
print(MeasuredChoices("demo").get_or_measure("a", measure))
"""


def test_two_processes_measuring_at_once_measure_once_and_agree(choices_dir, tmp_path):
    marker = tmp_path / "marker"
    env = {**os.environ, "ASYNCENGINE_CACHE_DIR": str(choices_dir)}
    procs = [subprocess.Popen([sys.executable, "-c", SLOW_MEASURE, str(marker)], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outs == ["slow", "slow"] and [p.returncode for p in procs] == [0, 0]
    assert marker.read_text().count("measured") == 1


def test_a_new_process_takes_the_recorded_cpu_gemm_choice_instead_of_timing(choices_dir):
    """quantization/cpu_prepacked.onednn_is_faster: whatever the file says for this machine is what a new process
    uses (both answers written by hand here), so the engine process and an offline run multiply alike."""
    from asyncengine.measured_choices import machine_fingerprint
    from asyncengine.quantization import cpu_prepacked

    if not cpu_prepacked.onednn_available():
        pytest.skip("torch built without oneDNN")
    key = f"onednn faster than MKL: 48x32, {cpu_prepacked.DECODE_ROWS} rows, 1 threads, gain {cpu_prepacked.MIN_GAIN}"
    script = "from asyncengine.quantization import cpu_prepacked; print(cpu_prepacked.onednn_is_faster(48, 32, 1))"
    env = {**os.environ, "ASYNCENGINE_CACHE_DIR": str(choices_dir)}
    choices_dir.mkdir()
    for recorded in (True, False):
        (choices_dir / "cpu_gemm.json").write_text(json.dumps({machine_fingerprint(): {key: recorded}}))
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == str(recorded), (out.stdout, out.stderr[-2000:], time.monotonic() - start)


def test_the_gpu_start_up_choices_are_kept_per_gpu_and_kernel_fingerprint(choices_dir, monkeypatch):
    """ops._kept (the decode GEMV and FP8 GEMM thresholds measured at start-up on CUDA): a second process (the
    in-process memo cleared) reads the recorded threshold; another GPU model, activation dtype or kernel source
    (the fingerprint) is measured afresh."""
    import torch

    from asyncengine import ops

    gpu = ["NVIDIA H200"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu[0])
    monkeypatch.setattr(ops, "_kept_choices", {})
    assert ops._kernels_fingerprint().startswith("triton ") and "kernels " in ops._kernels_fingerprint()
    calls, measure = counting(16)
    key, device = ("dense", 6144, 4096, torch.bfloat16), torch.device("cuda")
    assert ops._kept("decode GEMV", key, torch.bfloat16, device, measure) == 16
    ops._kept_choices.clear()  # as a new process
    assert ops._kept("decode GEMV", key, torch.bfloat16, device, measure) == 16 and len(calls) == 1
    for change in ("dtype", "gpu", "kernels"):
        ops._kept_choices.clear()
        if change == "gpu":
            gpu[0] = "NVIDIA H100 80GB HBM3"
        if change == "kernels":
            monkeypatch.setattr(ops, "_kernels_fingerprint", lambda: "triton 9, kernels edited")
        dtype = torch.float16 if change == "dtype" else torch.bfloat16
        assert ops._kept("decode GEMV", key, dtype, device, counting(8)[1]) == 8, change
