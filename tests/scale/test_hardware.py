"""Hardware profiles of the step-time model (hpc_rlhf/scale/hardware.py): the GPU presets against their datasheets,
lookups by name, and where the measured `cpu` profile is kept."""

import json

import pytest

from hpc_rlhf.scale import hardware

MEASURED_CPU = hardware.Profile("cpu", peak_flops=2e10, memory_bytes_per_s=1e10, intra_node_bytes_per_s=5e9,
                                inter_node_bytes_per_s=5e9, latency_s=1e-5, memory_gb=64, mfu_train=0.3,
                                mfu_score=0.4, mfu_decode=0.2, memory_efficiency=0.5, decode_step_overhead_s=1e-3,
                                pass_overhead_s=2e-3, optimizer_step_overhead_s=5e-3, cores=2, bytes_per_param=4)


@pytest.mark.parametrize("name, tflops, memory_gb, hbm_tb_s, nvlink_both_ways_gb_s, adapter_gbit_s", [
    ("h100", 989, 80, 3.35, 900, 400),   # 8 x ConnectX-7 400 Gb/s for 8 GPUs
    ("h200", 989, 141, 4.8, 900, 400),
    ("a100", 312, 80, 2.039, 600, 200),  # 8 x ConnectX-6 200 Gb/s for 8 GPUs
])
def test_the_gpu_presets_are_their_datasheets_figures(name, tflops, memory_gb, hbm_tb_s, nvlink_both_ways_gb_s,
                                                      adapter_gbit_s):
    profile = hardware.load(name)
    assert profile.name == name and profile.memory_gb == memory_gb
    assert profile.peak_flops == pytest.approx(tflops * 1e12)
    assert profile.memory_bytes_per_s == pytest.approx(hbm_tb_s * 1e12)
    assert profile.intra_node_bytes_per_s == pytest.approx(nvlink_both_ways_gb_s / 2 * 1e9)  # one direction
    assert profile.inter_node_bytes_per_s == pytest.approx(adapter_gbit_s / 8 * 1e9)  # bits to bytes
    assert (profile.bytes_per_param, profile.cores) == (2, None)  # bf16, one device per rank
    assert f"{tflops} TFLOPS" in profile.source


def test_a_profile_is_found_by_name_in_any_case():
    assert hardware.load("H100") is hardware.load("h100") is hardware.PRESETS["h100"]
    assert hardware.load("A100").name == "a100"
    assert hardware.NAMES == ("h100", "h200", "a100", "cpu")


def test_an_unknown_profile_is_refused_naming_the_known_ones():
    with pytest.raises(hardware.ProfileError, match=r"unknown hardware profile 'tpu-v5'; profiles: h100, h200, "
                                                    r"a100, cpu$"):
        hardware.load("tpu-v5")


def test_the_cpu_profile_is_kept_in_the_users_cache_unless_a_file_is_named(monkeypatch, tmp_path):
    monkeypatch.delenv("HPC_RLHF_CPU_PROFILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hardware.cpu_profile_path() == tmp_path / "xdg" / "hpc_rlhf" / "cpu_profile.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # set but empty: as if unset
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hardware.cpu_profile_path() == tmp_path / "home" / ".cache" / "hpc_rlhf" / "cpu_profile.json"
    monkeypatch.setenv("HPC_RLHF_CPU_PROFILE", str(tmp_path / "mine.json"))
    assert hardware.cpu_profile_path() == tmp_path / "mine.json"


def test_a_saved_cpu_profile_loads_back_with_its_measurements_beside_it(monkeypatch, tmp_path):
    monkeypatch.delenv("HPC_RLHF_CPU_PROFILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = {"matmul_flops": [1.9e10, 2.1e10], "threads": 1}
    path = hardware.save_cpu_profile(MEASURED_CPU, measured)
    assert path == tmp_path / "hpc_rlhf" / "cpu_profile.json"  # its folder made on the way
    assert hardware.load("cpu") == MEASURED_CPU
    assert json.loads(path.read_text())["measured"] == measured
    assert [p.name for p in path.parent.iterdir()] == ["cpu_profile.json"]  # no temporary file left behind


@pytest.mark.parametrize("text", ["not json", json.dumps({"profile": {"name": "cpu", "peak_flops": 1e10}})])
def test_a_cpu_profile_file_of_another_shape_is_refused(monkeypatch, tmp_path, text):
    path = tmp_path / "cpu.json"
    path.write_text(text)
    monkeypatch.setenv("HPC_RLHF_CPU_PROFILE", str(path))
    with pytest.raises(hardware.ProfileError, match="is not a cpu profile written by `hpc-rlhf plan --calibrate`.*"
                                                    "calibrate again"):
        hardware.load("cpu")
