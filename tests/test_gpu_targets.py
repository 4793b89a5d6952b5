"""Which GPUs an engine dir serves: the manifest's record for each flavour, the runtime's choice
of TensorRT module with either flavour absent or present, and the refusals users read."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from trtbuild.builder.emit.tensorrt import Flavor, check_targets
from trtbuild.builder.errors import SpecError
from trtbuild.contract.gpu_targets import built_for, rtx_serves
from trtbuild.runtime.engine_dir import EngineDir, EngineDirError
from trtbuild.runtime.engine_factory import resolve_backend
from trtbuild.runtime.backends.tensorrt.library import load_flavor, tensorrt_available

from simulated_device import SimulatedDevice

RTX = {"flavor": "tensorrt-rtx", "version": "1.7.1.116", **built_for("tensorrt-rtx", ("sm80", "sm86", "sm89"), None)}
RTX_PORTABLE = {"flavor": "tensorrt-rtx", "version": "1.7.1.116", **built_for("tensorrt-rtx", (), None)}
TRT_H200 = {"flavor": "tensorrt", "version": "10.13.2", **built_for("tensorrt", (), "sm90")}


def machine(monkeypatch, gpu: str | None, **versions: str) -> None:
    """This machine: a GPU of compute capability ``gpu`` (None: none) and the TensorRT modules in
    ``versions`` (module name → version; the others absent)."""
    if gpu is None:
        cudart = SimulatedDevice().module()
        cudart.cudaGetDeviceCount = lambda: (cudart.cudaError_t.cudaSuccess, 0)
    else:
        cudart = SimulatedDevice(compute_capability=gpu).module()
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", cudart)
    for name in ("tensorrt", "tensorrt_rtx"):
        module = None
        if name in versions:
            module = types.ModuleType(name)
            module.__version__ = versions[name]
        monkeypatch.setitem(sys.modules, name, module)


def engine_dir(built: dict, stages: int = 1) -> EngineDir:
    return EngineDir(path=Path("/engines/x"), manifest={"tensorrt": built, "ranks": [{"weight_bytes": 1 << 20}] * stages,
                                                        "tensor_parallel": 1, "pipeline_parallel": stages,
                                                        "spec": {"model": {"dtype": "float32"}}})


def test_manifest_records_what_each_flavour_serves():
    assert RTX["compute_capabilities"] == ["sm80", "sm86", "sm89"] and not RTX["portable"]
    assert RTX_PORTABLE["portable"] and "sm90" not in RTX_PORTABLE["compute_capabilities"]
    # TensorRT builds for the GPU it builds on, whatever the spec listed.
    assert TRT_H200["compute_capabilities"] == ["sm90"]
    trt = Flavor("tensorrt", types.SimpleNamespace(__version__="10.13.2"), gpu="sm90")
    assert trt.built_for(())["compute_capabilities"] == ["sm90"]


def test_rtx_engines_load_through_tensorrt_rtx(monkeypatch):
    machine(monkeypatch, "sm89", tensorrt_rtx="1.7.1.116")
    assert tensorrt_available(engine_dir(RTX)) is None
    assert load_flavor(engine_dir(RTX)).__name__ == "tensorrt_rtx"
    assert resolve_backend(engine_dir(RTX), "auto") == "tensorrt"


def test_pipeline_stages_run_on_tensorrt_where_it_serves_them(monkeypatch):
    machine(monkeypatch, "sm89", tensorrt_rtx="1.7.1.116")
    staged = engine_dir(RTX, stages=2)
    assert resolve_backend(staged, "auto") == resolve_backend(staged, "tensorrt") == "tensorrt"
    machine(monkeypatch, "sm90", tensorrt_rtx="1.7.1.116")  # the usual refusals still hold for stages
    with pytest.raises(EngineDirError, match="--backend tensorrt: .*this GPU is sm90"):
        resolve_backend(staged, "tensorrt")


def test_each_flavour_runs_only_its_own_engines(monkeypatch):
    machine(monkeypatch, "sm89", tensorrt="10.13.2")  # TensorRT present, RTX absent
    reason = tensorrt_available(engine_dir(RTX))
    assert reason == ('the engines were built with tensorrt-rtx 1.7.1.116, which is not installed here: '
                      'pip install "trtbuild[rtx]" (tensorrt-rtx==1.7.1.116)')
    assert resolve_backend(engine_dir(RTX), "auto") == "onnxruntime"  # auto falls back to the CPU
    with pytest.raises(EngineDirError, match="--backend tensorrt: the engines were built with tensorrt-rtx"):
        resolve_backend(engine_dir(RTX), "tensorrt")
    machine(monkeypatch, "sm90", tensorrt_rtx="1.7.1.116")
    assert "built with tensorrt 10.13.2, which is not installed here: pip install tensorrt==10.13.2" in \
        tensorrt_available(engine_dir(TRT_H200))


def test_versions_must_agree_to_the_minor(monkeypatch):
    machine(monkeypatch, "sm89", tensorrt_rtx="1.8.0.1")
    assert "built with tensorrt-rtx 1.7.1.116; this machine has 1.8.0.1" in tensorrt_available(engine_dir(RTX))
    machine(monkeypatch, "sm89", tensorrt_rtx="1.7.3.2")
    assert tensorrt_available(engine_dir(RTX)) is None


@pytest.mark.parametrize("gpu, expected", [
    ("sm90", "this GPU is sm90 (H100/H200), which TensorRT-RTX does not serve; rebuild with build.backend: "
             "tensorrt on a GPU of that class"),
    ("sm100", "this GPU is sm100 (B200), which TensorRT-RTX does not serve"),
    ("sm120", "the engines were built for sm80, sm86, sm89; this GPU is sm120: rebuild with build.targets "
              "including sm120"),
])
def test_rtx_engines_refuse_gpus_they_do_not_serve(monkeypatch, gpu, expected):
    machine(monkeypatch, gpu, tensorrt_rtx="1.7.1.116")
    assert expected in tensorrt_available(engine_dir(RTX))


def test_portable_rtx_engines_serve_ampere_ada_and_blackwell_rtx_only(monkeypatch):
    assert [rtx_serves(cc) for cc in ("sm80", "sm86", "sm89", "sm120", "sm121", "sm90", "sm100", "sm103")] == \
        [True, True, True, True, True, False, False, False]
    machine(monkeypatch, "sm100", tensorrt_rtx="1.7.1.116")
    assert "sm100 (B200)" in tensorrt_available(engine_dir(RTX_PORTABLE))


def test_tensorrt_engines_run_only_on_the_gpu_class_that_built_them(monkeypatch):
    machine(monkeypatch, "sm89", tensorrt="10.13.2")
    assert tensorrt_available(engine_dir(TRT_H200)) == (
        "the engines were built by TensorRT on an sm90 GPU and run only there; this GPU is sm89: "
        "rebuild on this GPU class")
    machine(monkeypatch, "sm90", tensorrt="10.13.2")
    assert tensorrt_available(engine_dir(TRT_H200)) is None


def test_no_gpu_means_the_cpu_backend(monkeypatch):
    machine(monkeypatch, None, tensorrt_rtx="1.7.1.116")
    assert tensorrt_available(engine_dir(RTX)) == "no CUDA GPU is visible"
    assert resolve_backend(engine_dir(RTX), "auto") == "onnxruntime"
    machine(monkeypatch, "sm89")
    assert "no TensorRT flavour is installed" in tensorrt_available(None)


def spec_with(tmp_path, **build):
    from trtbuild.builder.spec.resolve import spec_from_dict

    from conftest import TINY_CODE

    return spec_from_dict({"model": {"checkpoint": str(TINY_CODE), "dtype": "float16"}, "build": {"max_seq_len": 512, **build}}, tmp_path)


def test_datacenter_targets_need_tensorrt_built_on_that_gpu(tmp_path):
    rtx = Flavor("tensorrt-rtx", types.SimpleNamespace(__version__="1.7.1.116"))
    with pytest.raises(SpecError) as err:
        check_targets(spec_with(tmp_path, backend="auto", targets=["sm89", "sm90", "sm100"]), rtx)
    assert str(err.value) == ("build.targets: sm90 (H100/H200), sm100 (B200) cannot run TensorRT-RTX engines "
                              "(its runtime refuses them); build these with build.backend: tensorrt on a GPU of "
                              "that class (backend auto resolved to TensorRT-RTX here)")
    trt = Flavor("tensorrt", types.SimpleNamespace(__version__="10.13.2"), gpu="sm89")
    with pytest.raises(SpecError, match="TensorRT builds for the GPU it runs on, which is sm89"):
        check_targets(spec_with(tmp_path, backend="tensorrt", targets=["sm90"]), trt)
    check_targets(spec_with(tmp_path, backend="tensorrt", targets=["sm89"]), trt)  # no error


def test_build_cli_refuses_sm90_without_a_gpu_before_any_work(tmp_path):
    import subprocess

    import yaml

    from conftest import TINY_CODE

    spec = tmp_path / "h200.yaml"
    spec.write_text(yaml.safe_dump({"model": {"checkpoint": str(TINY_CODE)},
                                    "build": {"backend": "tensorrt-rtx", "targets": ["sm90"],
                                              "max_seq_len": 512}}))
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(spec), "-o",
                           str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: build.targets: sm90 (H100/H200) cannot run TensorRT-RTX engines (its runtime refuses them); "
        "build these with build.backend: tensorrt on a GPU of that class (backend tensorrt-rtx resolved to "
        "TensorRT-RTX here)")
    assert not (tmp_path / "out").exists()
