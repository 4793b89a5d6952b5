"""Load and verify an engine dir written by ``trtbuild build`` (the manifest is the contract)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..contract.json_file import read_json_object
from ..contract.kv_budget import DEFAULT_BLOCK_SIZE, KvBudget, block_size_problem, parse_kv_cache_memory
from ..contract.manifest import (DEFAULT_MULTI_STEP, EOS_FILES, SIDE_FILES, ManifestError,
                                 eos_token_ids, has_cpu_graphs, read_manifest)
from ..contract.draft_head import DRAFT_CPU_GRAPH, DraftHeadEntry
from ..contract.paths import path_inside
from ..contract.speculation import Source, SpeculationConfig
from ..plugins.onnxruntime.session import CpuActivations
from .engine_dir_check import check_engine_dir, check_graph_data


@dataclass(frozen=True)
class KvCacheLayout:
    """The engines' KV caches: pools of ``block_size``-position blocks (paged) or a slot per row."""

    paged: bool
    block_size: int


class EngineDirError(ValueError):
    """The engine dir cannot be served here; the message says what to do."""


@dataclass(frozen=True)
class EngineDir:
    path: Path
    manifest: dict

    @property
    def model(self) -> dict:
        return self.manifest["model"]

    @property
    def num_layers(self) -> int:
        return self.model["num_layers"]

    @property
    def num_kv_heads(self) -> int:
        """KV heads in each rank's caches (the model's, split or replicated by tensor parallelism)."""
        return self.manifest["ranks"][0]["num_kv_heads"]

    @property
    def tensor_parallel(self) -> int:
        """Tensor-parallel ranks in each pipeline stage."""
        return self.manifest["tensor_parallel"]

    @property
    def pipeline_parallel(self) -> int:
        """Pipeline stages (each of tensor_parallel ranks)."""
        return self.manifest["pipeline_parallel"]

    @property
    def world_size(self) -> int:
        return len(self.manifest["ranks"])

    def rank_layers(self, rank: int) -> range:
        """The decoder layers (and KV caches) of ``rank``'s pipeline stage."""
        start, stop = self.manifest["ranks"][rank]["layers"]
        return range(start, stop)

    def rank_tensors(self, rank: int) -> frozenset[str]:
        """The names of ``rank``'s engine inputs and outputs (its manifest I/O table): a pipeline
        stage reads ``input_ids`` or ``hidden_states`` and writes ``hidden_states_out`` or the logits."""
        rows = self.manifest["ranks"][rank].get("io")
        if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("name"), str) for r in rows):
            raise EngineDirError(f"{self.path / 'manifest.json'}: ranks[{rank}].io is not a list of tensors "
                                 "with names; rebuild the engine dir")
        return frozenset(row["name"] for row in rows)

    @property
    def head_dim(self) -> int:
        return self.model["head_dim"]

    @property
    def vocab_size(self) -> int:
        return self.model["vocab_size"]

    @property
    def max_batch_size(self) -> int:
        return self.manifest["limits"]["max_batch_size"]

    @property
    def max_input_len(self) -> int:
        return self.manifest["limits"]["max_input_len"]

    @property
    def max_seq_len(self) -> int:
        return self.manifest["limits"]["max_seq_len"]

    @property
    def dtype(self) -> str:
        return self.manifest["spec"]["model"]["dtype"]

    @property
    def quantized(self) -> bool:
        """Whether the spec quantized the weights (quantization.mode other than none)."""
        return self.manifest["spec"].get("quantization", {}).get("mode", "none") != "none"

    @property
    def cpu_activations(self) -> CpuActivations:
        """What ONNX Runtime multiplies int4/int8 weights with (the spec's quantization.cpu_activations)."""
        value = self.manifest["spec"].get("quantization", {}).get("cpu_activations", "float")
        try:
            return CpuActivations(value)
        except ValueError:
            raise EngineDirError(f"{self.path / 'manifest.json'}: spec.quantization.cpu_activations {value!r} is "
                                 f"not one of {', '.join(a.value for a in CpuActivations)}") from None

    @property
    def cuda_graph_batch_sizes(self) -> list[int]:
        return self.manifest["cuda_graph_batch_sizes"]

    @property
    def medusa(self) -> dict | None:
        """num_heads, tree (likeliest path first), rank_accuracy; None without Medusa heads."""
        return self.manifest.get("medusa")

    @property
    def speculation(self) -> SpeculationConfig | None:
        """The draft sources this engine serves by default and the largest verification step
        (the manifest's ``speculation`` entry, checked); an engine dir written without the entry
        but with Medusa heads serves Medusa alone; None: no speculation by default."""
        entry = self.manifest.get("speculation")
        if entry is None:
            medusa = self.medusa
            return None if medusa is None else SpeculationConfig((Source.medusa,), 1 + len(medusa["tree"]))
        try:
            config = SpeculationConfig.from_manifest(entry, str(self.path / "manifest.json"))
        except ValueError as exc:
            raise EngineDirError(f"{exc}; rebuild the engine dir") from None
        if (Source.medusa in config.sources) != (self.medusa is not None):
            raise EngineDirError(f"{self.path / 'manifest.json'}: speculation.sources lists medusa exactly when the "
                                 "engine has Medusa heads (a medusa entry); rebuild the engine dir")
        if (Source.draft_head in config.sources) != (self.manifest.get("draft_head") is not None):
            raise EngineDirError(f"{self.path / 'manifest.json'}: speculation.sources lists draft_head exactly when "
                                 "the engine has a draft head (a draft_head entry); rebuild the engine dir")
        if config.draft_head is not None and config.draft_head.num_tokens != self.draft_head.num_tokens:
            raise EngineDirError(f"{self.path / 'manifest.json'}: speculation.draft_head.num_tokens "
                                 f"{config.draft_head.num_tokens} != draft_head.num_tokens "
                                 f"{self.draft_head.num_tokens}; rebuild the engine dir")
        return config

    @cached_property
    def draft_head(self) -> DraftHeadEntry | None:
        """The draft head built into the engine (its graph a listed file inside the dir, its
        weights in the graph's own listed data file), checked once (it reads the graph); None
        without one."""
        entry = self.manifest.get("draft_head")
        if entry is None:
            return None
        where = str(self.path / "manifest.json")
        try:
            draft = DraftHeadEntry.from_manifest(entry, where, self.num_layers, self.model["hidden_size"],
                                                 self.vocab_size)
        except ValueError as exc:
            raise EngineDirError(f"{exc}; rebuild the engine dir") from None
        files = self.manifest["files"]
        if path_inside(self.path, draft.graph) is None or draft.graph not in files:
            raise EngineDirError(f"{where}: draft_head.graph {draft.graph!r} is not a file the manifest lists inside "
                                 "the engine dir; rebuild the engine dir")
        data = f"{draft.graph}.data"
        try:  # its own weights, and the token embedding from rank 0's (the target's table, not written twice)
            check_graph_data(self.path / draft.graph, {data if data in files else None,
                                                       self.manifest["ranks"][0].get("onnx_data")})
        except ManifestError as exc:
            raise EngineDirError(str(exc)) from None
        return draft

    @property
    def draft_head_graph(self) -> Path:
        """The graph the CPU drafter runs: the CPU form (DRAFT_CPU_GRAPH: GroupQueryAttention over a
        cache bound in place) where the dir has it, else the draft's own graph; each reads only
        data files the manifest lists."""
        draft = self.draft_head
        files = self.manifest["files"]
        if DRAFT_CPU_GRAPH not in files:
            return self.path / draft.graph
        path = path_inside(self.path, DRAFT_CPU_GRAPH)
        if path is None:
            raise EngineDirError(f"{self.path / DRAFT_CPU_GRAPH}: a link leading outside the engine dir; rebuild")
        data = f"{draft.graph}.data"
        try:
            check_graph_data(path, {data if data in files else None, self.manifest["ranks"][0].get("onnx_data")})
        except ManifestError as exc:
            raise EngineDirError(str(exc)) from None
        return path

    @property
    def runtime_defaults(self) -> dict:
        return self.manifest["spec"].get("runtime", {})

    @property
    def multi_step(self) -> int:
        """Greedy decode steps the runtime runs back to back (spec runtime.multi_step; engine dirs
        built before the field had none, and get its default)."""
        value = self.runtime_defaults.get("multi_step", DEFAULT_MULTI_STEP)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise EngineDirError(f"{self.path / 'manifest.json'}: spec.runtime.multi_step {value!r} is not an "
                                 "integer ≥ 1")
        return value

    @property
    def kv_cache_memory(self) -> KvBudget | None:
        """The spec's KV budget (runtime.kv_cache_memory): bytes, a share of free memory, or None
        (dirs built before the field, or unset: every row's whole context)."""
        value = self.runtime_defaults.get("kv_cache_memory")
        try:
            return None if value is None else parse_kv_cache_memory(value)
        except ValueError as exc:
            raise EngineDirError(f"{self.path / 'manifest.json'}: spec.runtime.kv_cache_memory: {exc}") from None

    @property
    def kv_block_size(self) -> int:
        """Token positions per KV block (spec runtime.kv_block_size)."""
        value = self.runtime_defaults.get("kv_block_size", DEFAULT_BLOCK_SIZE)
        problem = ("not an integer" if not isinstance(value, int) or isinstance(value, bool)
                   else block_size_problem(value, self.max_seq_len))
        if problem is not None:
            raise EngineDirError(f"{self.path / 'manifest.json'}: spec.runtime.kv_block_size {value!r}: {problem}")
        return value

    @property
    def kv_cache(self) -> KvCacheLayout:
        """The engines' KV layout (manifest ``kv_cache``), checked against each rank's I/O table: a
        paged engine takes block_table and kv_slots and its caches are pools [N, block_size, H_kv, D]
        of the manifest's pool; a slot engine takes write_index and [B, H_kv, max_seq_len, D] caches."""
        where = f"{self.path / 'manifest.json'}: kv_cache"
        entry = self.manifest.get("kv_cache")
        if not isinstance(entry, dict) or entry.get("layout") not in ("slots", "paged"):
            raise EngineDirError(f"{where} {entry!r} does not say a layout of slots or paged; rebuild the engine dir")
        if entry.get("block_size") != self.kv_block_size:
            raise EngineDirError(f"{where}.block_size {entry.get('block_size')!r} is not the spec's "
                                 f"runtime.kv_block_size {self.kv_block_size}; rebuild the engine dir")
        paged = entry["layout"] == "paged"
        pools = entry.get("pool")
        if paged and not (isinstance(pools, list) and len(pools) == self.world_size):
            raise EngineDirError(f"{where}.pool must give each of the {self.world_size} ranks' pool; rebuild the "
                                 "engine dir")
        for rank, row in enumerate(self.manifest["ranks"]):
            io = {r.get("name"): r.get("shape") for r in row.get("io") or () if isinstance(r, dict)}
            want = ([self.kv_block_size, row.get("num_kv_heads"), self.head_dim] if paged
                    else [row.get("num_kv_heads"), self.max_seq_len, self.head_dim])
            caches = {name: shape for name, shape in io.items() if str(name).startswith(("past_", "present_"))}
            bad = next((name for name, shape in caches.items() if not isinstance(shape, list) or shape[1:] != want), None)
            inputs = {"block_table", "kv_slots"} if paged else {"write_index"}
            if (paged and pools[rank] != want) or bad is not None or not inputs <= set(io):
                raise EngineDirError(f"{where}: rank {rank}'s engine I/O is not the {entry['layout']} layout the "
                                     f"manifest claims (caches [.., {', '.join(map(str, want))}] with "
                                     f"{', '.join(sorted(inputs))}); rebuild the engine dir")
        return KvCacheLayout(paged=paged, block_size=self.kv_block_size)

    def require_cpu_graphs(self, why: str = "") -> None:
        """Refuses, in one line, to run on ONNX Runtime a dir built without its ONNX graphs
        (build.cpu_graphs: false); ``why`` says what wanted them."""
        if not has_cpu_graphs(self.manifest):
            raise EngineDirError(f"{self.path}: built with build.cpu_graphs: false, it holds the TensorRT engines alone "
                                 f"and cannot run on ONNX Runtime (CPU){why}; run it on a GPU with TensorRT, or "
                                 "rebuild with build.cpu_graphs: true")

    def rank_file(self, rank: int, kind: str) -> Path:
        return self.path / self.manifest["ranks"][rank][kind]

    def side_file(self, name: str) -> Path | None:
        """A file beside the ranks' (contract.manifest.SIDE_FILES) if the build wrote it: listed,
        so its hash was checked at load; else None, whatever lies in the dir under that name."""
        if name not in SIDE_FILES:
            raise KeyError(f"{name} is not one of the engine dir's side files ({', '.join(SIDE_FILES)})")
        return self.path / name if self.manifest["side_files"][name] else None

    def side_json(self, name: str) -> dict:
        """A JSON side file's object ({} where the build wrote none)."""
        path = self.side_file(name)
        if path is None:
            return {}
        try:
            return read_json_object(path)
        except ValueError as exc:
            raise EngineDirError(str(exc)) from None

    def eos_token_ids(self) -> tuple[int, ...]:
        try:
            return eos_token_ids({name: self.side_json(name) for name in EOS_FILES}, self.vocab_size)
        except ValueError as exc:
            raise EngineDirError(f"{self.path / str(exc)}") from None

    def chat_template(self) -> str | None:
        """The tokenizer's chat template: chat_template.jinja (transformers 5's layout) or
        tokenizer_config.json's ``chat_template`` (a string, or named templates: the default);
        None where the checkpoint had none."""
        path = self.side_file("chat_template.jinja")
        if path is not None:
            try:
                return path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise EngineDirError(f"{path}: not UTF-8 text") from None
        template = self.side_json("tokenizer_config.json").get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) and template else None

    def special_token(self, key: str) -> str:
        """tokenizer_config.json's ``bos_token``/``eos_token`` text (a chat template may print
        them), "" where it has none."""
        value = self.side_json("tokenizer_config.json").get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return value if isinstance(value, str) else ""


def load(engine_dir: Path, verify_hashes: bool = True) -> EngineDir:
    """Reads manifest.json and checks the dir as a trust boundary (contract.manifest): every file
    a rank needs listed and inside the dir, and (by default) every file's sha256."""
    path = Path(engine_dir)
    try:
        manifest = read_manifest(path)
        check_engine_dir(path, manifest, verify_hashes)
    except ManifestError as exc:
        raise EngineDirError(str(exc)) from None
    engine_dir = EngineDir(path=path, manifest=manifest)
    # Unknown values are refused here, in one line, not mid-load.
    engine_dir.cpu_activations  # noqa: B018
    engine_dir.multi_step  # noqa: B018
    engine_dir.speculation  # noqa: B018
    engine_dir.draft_head  # noqa: B018
    engine_dir.kv_cache_memory  # noqa: B018
    engine_dir.kv_block_size  # noqa: B018
    engine_dir.kv_cache  # noqa: B018
    return engine_dir
