"""Which GPUs an engine serves: the TensorRT flavour and compute capabilities a build records in
the manifest, and the one check the runtime makes before TensorRT sees an engine.

TensorRT builds for the GPU it builds on; TensorRT-RTX builds ahead of time, without a GPU, for
the compute capabilities it is given (none: a portable engine). The RTX runtime does not serve
datacenter Hopper or Blackwell: measured on an H200 with TensorRT-RTX 1.7.1, deserializing an
engine fails with "Supported compute capabilities: 8.0 8.6 8.9 12.0 12.1 >12.0".
"""
from __future__ import annotations

# Manifest flavour name → the Python module that runs it (both have the same API).
MODULES = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}
INSTALL = {"tensorrt": "pip install tensorrt=={version} (the version that built it)",
           "tensorrt-rtx": 'pip install "trtbuild[rtx]" (tensorrt-rtx=={version})'}

# Compute capabilities each flavour can be told to target ahead of time.
RTX_TARGETS = ("sm75", "sm80", "sm86", "sm89", "sm120", "sm121")
TENSORRT_TARGETS = ("sm75", "sm80", "sm86", "sm87", "sm89", "sm90", "sm100", "sm103", "sm110", "sm120", "sm121")
# What a portable RTX engine runs on (the measured list above; ">12.0": later 12.x too).
RTX_PORTABLE = ("sm80", "sm86", "sm89", "sm120", "sm121")
# GPU classes only TensorRT serves, named for the refusal users read.
TENSORRT_ONLY = {"sm90": "H100/H200", "sm100": "B200", "sm103": "B300", "sm110": "Jetson Thor"}


def sm(major: int, minor: int) -> str:
    return f"sm{major}{minor}"


def rtx_serves(compute_capability: str) -> bool:
    """Whether a portable TensorRT-RTX engine runs on this compute capability."""
    return compute_capability in RTX_PORTABLE or compute_capability.startswith("sm12")  # ">12.0"


def tensorrt_only_refusal(targets: tuple[str, ...] | list[str]) -> str | None:
    """One line for targets TensorRT-RTX cannot serve, naming the GPUs and what to do instead."""
    bad = [t for t in targets if t in TENSORRT_ONLY]
    if not bad:
        return None
    gpus = ", ".join(f"{t} ({TENSORRT_ONLY[t]})" for t in bad)
    return (f"{gpus} cannot run TensorRT-RTX engines (its runtime refuses them); build these with "
            "build.backend: tensorrt on a GPU of that class")


def built_for(flavor: str, targets: tuple[str, ...], building_gpu: str | None) -> dict:
    """The manifest's record of what an engine serves: RTX its targets (or portable), TensorRT
    the compute capability of the GPU that built it."""
    if flavor == "tensorrt":
        return {"compute_capabilities": [building_gpu], "portable": False}
    if targets:
        return {"compute_capabilities": list(targets), "portable": False}
    return {"compute_capabilities": list(RTX_PORTABLE), "portable": True}


def describe(built: dict) -> str:
    """The GPUs an engine serves, for logs and ``inspect``: "sm89" or "portable (sm80, …)"."""
    ccs = ", ".join(built["compute_capabilities"])
    return f"portable ({ccs}, later sm12x)" if built.get("portable") else ccs


def serves(built: dict, compute_capability: str) -> bool:
    """Whether an engine recorded as ``built`` (the manifest's ``tensorrt`` entry) runs on this GPU."""
    if built.get("portable"):
        return rtx_serves(compute_capability)
    return compute_capability in built["compute_capabilities"]


def runtime_refusal(built: dict, installed: dict[str, str | None], compute_capability: str) -> str | None:
    """Why this machine cannot run an engine (None: it can). ``installed``: flavour → the version
    importable here (None: absent). Names what to install or rebuild."""
    flavor, version = built["flavor"], built["version"]
    have = installed.get(flavor)
    if have is None:
        return (f"the engines were built with {flavor} {version}, which is not installed here: "
                + INSTALL[flavor].format(version=version))
    if have.split(".")[:2] != version.split(".")[:2]:
        return (f"the engines were built with {flavor} {version}; this machine has {have}: "
                + INSTALL[flavor].format(version=version) + ", or rebuild with the installed version")
    if not serves(built, compute_capability):
        targets = describe(built)
        if flavor == "tensorrt-rtx" and compute_capability in TENSORRT_ONLY:
            return (f"this GPU is {compute_capability} ({TENSORRT_ONLY[compute_capability]}), which TensorRT-RTX "
                    "does not serve; rebuild with build.backend: tensorrt on a GPU of that class")
        if flavor == "tensorrt":
            return (f"the engines were built by TensorRT on an {targets} GPU and run only there; this GPU is "
                    f"{compute_capability}: rebuild on this GPU class")
        return (f"the engines were built for {targets}; this GPU is {compute_capability}: rebuild with "
                f"build.targets including {compute_capability}")
    return None
