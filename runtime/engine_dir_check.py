"""The runtime's trust check of an engine dir before it loads anything from it: every file the
format needs is listed and inside the dir, every listed file's size and sha256 match, side files
are the build's, and each rank graph reads weights from its own listed data files only."""
from __future__ import annotations

from pathlib import Path

from ..contract.manifest import MANIFEST, SIDE_FILES, ManifestError, rank_files, sha256_file
from ..contract.paths import path_inside


def check_engine_dir(engine_dir: Path, manifest: dict, verify_hashes: bool = True) -> None:
    """Every file the format needs is listed and inside the dir, every listed file is inside the
    dir, each rank graph's weights are its own listed file, and (by default) every listed
    file's size and sha256 match. Integrity, not authenticity: anyone who can edit the files
    can edit the manifest too."""
    root = Path(engine_dir).resolve()
    files = manifest["files"]
    for name, entry in files.items():
        if path_inside(root, name) is None:
            raise ManifestError(f"{MANIFEST}: file {name!r} is not inside the engine dir")
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and isinstance(entry.get("bytes"), int)):
            raise ManifestError(f"{MANIFEST}: files[{name!r}] needs sha256 and bytes")
    for name in rank_files(manifest):
        if name not in files:
            raise ManifestError(f"{root / name}: needed by the engine dir but not listed (hashed) in {MANIFEST}")
    _check_side_files(root, manifest)
    for name, entry in files.items():
        file = root / name
        if not file.is_file():
            raise ManifestError(f"{file}: missing (listed in the manifest)")
        if verify_hashes and (file.stat().st_size != entry["bytes"] or sha256_file(file) != entry["sha256"]):
            raise ManifestError(f"{file}: sha256 differs from the manifest; the engine dir is corrupt or was "
                                "modified: rebuild or re-copy it")
    for rank in manifest["ranks"]:
        if rank.get("onnx") is None:
            continue  # cpu_graphs: false — the engines alone
        check_graph_data(root / rank["onnx"], {rank.get("onnx_data")})
        if rank.get("paged_onnx") is not None:  # the paged engine's graph: the rank's weights, none of its own
            model = check_graph_data(root / rank["paged_onnx"], {rank.get("onnx_data")})
            _check_io(root / rank["paged_onnx"], model, rank.get("io"))
        if rank.get("cpu_onnx") is not None:  # it shares the rank's weights, and may add its own
            check_graph_data(root / rank["cpu_onnx"], {rank.get("onnx_data"), rank.get("cpu_onnx_data")})


def _check_side_files(root: Path, manifest: dict) -> None:
    """Each runtime-read side file is written by the build (listed, so hashed) or recorded absent;
    one absent at build time but present now (a generation_config.json dropped in later would change
    the end-of-sequence ids) is refused, never read."""
    written = manifest["side_files"]
    if not (isinstance(written, dict) and set(written) == set(SIDE_FILES)
            and all(isinstance(v, bool) for v in written.values())):
        raise ManifestError(f"{root / MANIFEST}: side_files must say true or false for each of "
                            f"{', '.join(SIDE_FILES)}")
    for name in SIDE_FILES:
        if written[name] and name not in manifest["files"]:
            raise ManifestError(f"{root / name}: side_files says the build wrote it, but it is not listed (hashed) "
                                f"in {MANIFEST}")
        if not written[name] and (root / name).exists():
            raise ManifestError(f"{root / name}: not written by the build ({MANIFEST} records it absent), and the "
                                "runtime would read it; remove it, or rebuild from a checkpoint that has it")


def check_graph_data(graph: Path, allowed: set[str | None]):
    """A rank's graph may read weights from its own listed data files only (subgraphs included);
    the graph (without its weights)."""
    import onnx

    try:
        model = onnx.load(graph, load_external_data=False)
    except Exception as exc:  # noqa: BLE001  (protobuf raises several kinds)
        raise ManifestError(f"{graph}: not a readable ONNX graph ({type(exc).__name__})") from None
    files = sorted(name for name in allowed if name is not None)
    _check_initializers(graph, model, files)
    return model


def _check_io(graph: Path, model, io) -> None:
    """The graph a rank's engine was compiled from has the inputs and outputs, names and shapes, that
    the manifest's I/O table (what the runtime binds) says."""
    values = [*model.graph.input, *model.graph.output]
    have = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}
    listed = {row.get("name"): row.get("shape") for row in io or () if isinstance(row, dict)}
    if have != listed:
        differ = sorted(str(name) for name in set(have) | set(listed) if have.get(name) != listed.get(name))
        raise ManifestError(f"{graph}: its inputs and outputs differ from the manifest's I/O table "
                            f"({', '.join(differ[:3])}{' …' if len(differ) > 3 else ''}); rebuild the engine dir")


def _check_initializers(graph: Path, model, files: list[str]) -> None:
    """Every external tensor of ``model`` (subgraphs included) lies in one of ``files``."""
    import onnx

    for tensor in _initializers(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = {e.key: e.value for e in tensor.external_data}.get("location")
            if location not in files:
                raise ManifestError(f"{graph}: tensor {tensor.name} reads weights from {location!r}, not the "
                                    f"rank's data file{'s' if len(files) > 1 else ''} "
                                    f"{', '.join(map(repr, files)) or 'None'}")


def _initializers(graph):
    """Every initializer of ``graph`` and of the subgraphs its nodes hold (If branches)."""
    import onnx

    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):  # a Constant's value can be external data too
                yield attribute.t
            yield from attribute.tensors
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _initializers(attribute.g)
            for sub in attribute.graphs:
                yield from _initializers(sub)
