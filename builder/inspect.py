"""``trtbuild inspect``: read an engine dir's manifest and pass log."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ..contract.gpu_targets import describe
from ..contract.manifest import ManifestError, has_cpu_graphs, read_manifest
from ..contract.speculation import SpeculationConfig
from .errors import UserError
from .progress import dir_size, human_bytes, table
from ..checkpoint.layer_count import layer_spans


def load_engine_dir(out: Path) -> tuple[dict, list[dict]]:
    out = Path(out)
    try:
        manifest = read_manifest(out)
    except ManifestError as exc:
        raise UserError(str(exc)) from None
    log = out / "passes.jsonl"
    try:
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{log}: not a pass log (JSON lines)") from None
    return manifest, records


def select(records: list[dict], rank: int | None, pass_name: str | None) -> list[dict]:
    known = sorted({r["pass"] for r in records})
    if pass_name is not None and pass_name not in known:
        raise UserError(f"--pass: no pass {pass_name!r} in this build's log; passes: {', '.join(known)}")
    ranks = sorted({r["rank"] for r in records if r["rank"] is not None})
    if rank is not None and rank not in ranks:
        raise UserError(f"--rank: {rank} is not a rank of this build; ranks: {', '.join(map(str, ranks))}")
    # Passes before the tensor-parallel split ran once for every rank (rank None, "all").
    return [r for r in records if (rank is None or r["rank"] in (rank, None))
            and (pass_name is None or r["pass"] == pass_name)]


def render(out: Path, manifest: dict, records: list[dict], detail: bool, bad: str | None) -> str:
    model, limits = manifest["model"], manifest["limits"]
    lines = [
        f"engine dir   {out}",
        f"model        {model['architecture']}: {model['num_layers']} layers, hidden {model['hidden_size']}, "
        f"heads {model['num_heads']}/{model['num_kv_heads']} kv, vocab {model['vocab_size']}",
        f"dtype        {manifest['spec']['model']['dtype']}",
        f"tensorrt     {manifest['tensorrt']['flavor']} {manifest['tensorrt']['version']}, "
        f"serves {describe(manifest['tensorrt'])}",
        f"limits       batch ≤ {limits['max_batch_size']}, input ≤ {limits['max_input_len']}, "
        f"sequence ≤ {limits['max_seq_len']}; CUDA-graph buckets {manifest['cuda_graph_batch_sizes']}",
        f"spec sha256  {manifest['spec_sha256'][:16]}…",
        f"ranks        {_grid_line(manifest)}",
        *rank_grid(manifest).splitlines(),
        *([f"medusa       {m['num_heads']} heads × {m['num_layers']} block(s); tree of {len(m['tree'])} guesses "
           f"(verification S = {m['tree_size']}); output {m['output']}"] if (m := manifest.get("medusa")) else []),
        *([f"speculation  {_speculation_line(out, s)}"] if (s := manifest.get("speculation")) is not None else []),
        *([f"draft head   {_draft_head_line(d)}"] if (d := manifest.get("draft_head")) else []),
        f"kv cache     {_kv_cache_line(manifest)}",
        f"quantization {(q := manifest['spec'].get('quantization', {})).get('mode', 'none')}"
        + (f" ({q.get('algorithm')})" if q.get("mode") == "int4_weight_only" else ""),
        *_gguf_sources(records),
        f"files        {len(manifest['files'])}, "
        f"{human_bytes(sum(f['bytes'] for f in manifest['files'].values()))}, "
        + ("all hashes verify" if not bad else f"MISMATCH: {bad}"),
        f"dir size     {_dir_sizes(out, manifest)}",
        f"numerics     {_check_ran(records)}",
        "",
    ]
    rows = []
    for r in records:
        numerics = r.get("numerics") or {}
        rows.append([_rank_label(r, len(manifest["ranks"])), r["pass"], f"{r['ms']:.1f}", "yes" if r["modified"] else "no",
                     r.get("matches", "-"), f"{r['nodes_before']}→{r['nodes_after']}",
                     _stat(numerics.get("vs_previous")),
                     _stat(numerics.get("vs_torch")) if "vs_rank_graph" not in numerics
                     else f"{_stat(numerics['vs_rank_graph'])} (rank graph, {numerics['step']} step)"])
    lines.append(table(rows, ["rank", "pass", "ms", "modified", "matches", "nodes",
                              "max_abs vs prev", "max_abs vs torch"]))
    if len(manifest["ranks"]) > 1:
        lines.append("rank column: rank:s<pipeline stage>/t<tensor rank>; \"all\": once, on the whole model, before the split")
    if any(r.get("numerics", {}).get("step") == "decode" for r in records):
        lines.append("cpu_* passes make rankN.cpu.onnx: the decode graph ONNX Runtime runs at plain decode steps "
                     "and, with any draft source, the graph it verifies one row's guesses on (the verify passes); each "
                     "checked at a step of its kind against the finished rank graph")
    if any(r["pass"] == "page_kv_cache" for r in records):
        lines.append("page_kv_cache makes rankN.paged.onnx, the graph the paged engine is compiled from (rankN.onnx "
                     "keeps the slot caches for ONNX Runtime)")
    if detail:
        for r in records:
            lines += ["", f"rank {'all' if r['rank'] is None else r['rank']} {r['pass']}: op counts before → after"]
            ops = sorted(set(r["ops_before"]) | set(r["ops_after"]))
            changed = [[op, r["ops_before"].get(op, 0), r["ops_after"].get(op, 0)] for op in ops
                       if r["ops_before"].get(op, 0) != r["ops_after"].get(op, 0)]
            lines.append(table(changed, ["op", "before", "after"]) if changed else "  (no op changed)")
            if r.get("skipped"):
                lines.append(f"  skipped sites: {r['skipped']}")
            if r.get("dump"):
                lines.append(f"  graph after this pass: {r['dump']}")
    return "\n".join(lines)


def gguf_source_layers(records: list[dict]) -> dict[str, list[str]]:
    """Each GGUF source note (the file's codes kept: type, bits, group; or re-quantized and why) →
    the layers that have it: the quantization report's ``source`` entries, as the quantize_weights
    record holds them."""
    layers = next((r.get("layers") or {} for r in records if r["pass"] == "quantize_weights"), {})
    named: dict[str, list[str]] = {}
    for name, entry in layers.items():
        if entry.get("source"):
            named.setdefault(entry["source"], []).append(name)
    return named


def _gguf_sources(records: list[dict]) -> list[str]:
    return [f"{'gguf codes' if i == 0 else '':<12} {source}: {len(names)} layer{'s' if len(names) > 1 else ''} "
            f"({_layer_list(names)})" for i, (source, names) in enumerate(gguf_source_layers(records).items())]


def _layer_list(names: list[str]) -> str:
    """``layers.0.mlp.up_proj``, ``layers.1.mlp.up_proj`` → ``mlp.up_proj in layers 0-1``: each
    module with the layers it is in (ranges where consecutive)."""
    by_module: dict[str, list[int]] = {}
    others = []
    for name in names:
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
            by_module.setdefault(parts[2], []).append(int(parts[1]))
        else:
            others.append(name)
    shown = [f"{module} in layers {layer_spans(sorted(at))}" for module, at in by_module.items()]
    return "; ".join(shown + others)


def _speculation_line(out: Path, entry) -> str:
    """The draft sources a request gets by default, the verification S the engine was built for,
    and each host-side source's settings (the manifest's entry, checked as the runtime checks it)."""
    try:
        config = SpeculationConfig.from_manifest(entry, str(Path(out) / "manifest.json"))
    except ValueError as exc:
        return f"INVALID: {exc}"
    settings = [f"{name} ({', '.join(f'{k} {v}' for k, v in asdict(c).items())})"
                for name, c in (("prompt_lookup", config.prompt_lookup), ("suffix", config.suffix),
                                ("draft_head", config.draft_head)) if c is not None]
    return "; ".join([f"{', '.join(s.value for s in config.sources)} (verification S = {config.verify_tokens})",
                      *settings])


def _draft_head_line(entry: dict) -> str:
    """The draft head's graph, the target layers its features fuse, its vocabulary and accuracy."""
    accuracy = entry.get("accuracy") or {}
    held_out = ", ".join(f"{k} {v:.3f}" for k, v in accuracy.items() if isinstance(v, (int, float)))
    return (f"{entry.get('graph')}: features of layers {entry.get('taps')}, draft vocabulary "
            f"{entry.get('draft_vocab_size')}, chains of up to {entry.get('num_tokens')}; held-out "
            f"{held_out or 'accuracy not recorded'}")


def _grid_line(manifest: dict) -> str:
    tensor, pipeline = manifest["tensor_parallel"], manifest["pipeline_parallel"]
    return (f"{len(manifest['ranks'])} = {pipeline} pipeline stage{'s' if pipeline > 1 else ''} × {tensor} tensor "
            f"rank{'s' if tensor > 1 else ''} (rank = stage · {tensor} + tensor rank)")


def rank_grid(manifest: dict) -> str:
    """The stage × tensor-rank grid: a row per stage (its decoder layers), a column per tensor
    rank (its rank, KV heads and weights), indented under the header lines."""
    tensor = manifest["tensor_parallel"]
    rows = []
    for start in range(0, len(manifest["ranks"]), tensor):
        stage = manifest["ranks"][start:start + tensor]
        first, stop = stage[0]["layers"]
        rows.append([stage[0]["stage"], _span(first, stop, "layer"),
                     *(f"rank{r['rank']}: KV {_span(*r['kv_heads'], 'head')}, {human_bytes(r['weight_bytes'])}"
                       for r in stage)])
    grid = table(rows, ["stage", "decoder layers (and their KV caches)", *(f"tensor rank {t}" for t in range(tensor))])
    return "\n".join(f"  {line}" for line in grid.splitlines())


def _kv_cache_line(manifest: dict) -> str:
    """The engines' KV layout: pools of blocks (each rank's [N, block_size, H_kv, D]) or slots."""
    kv = manifest["kv_cache"]
    if kv["layout"] == "slots":
        return f"slots: [B, H_kv, {manifest['limits']['max_seq_len']}, D] per layer; runtime blocks of {kv['block_size']}"
    pools = ", ".join(f"[N, {', '.join(map(str, pool))}]" for pool in dict.fromkeys(map(tuple, kv["pool"])))
    return f"paged: a pool of {kv['block_size']}-position blocks per layer, {pools}, read through block_table"


def _span(start: int, stop: int, what: str) -> str:
    """[start, stop) in words: "head 1", "heads 0–3"."""
    return f"{what} {start}" if stop - start == 1 else f"{what}s {start}–{stop - 1}"


def _rank_label(record: dict, ranks: int) -> str:
    """The pass log's rank column: "all" before the split, else the rank, and with more than one
    its stage and tensor rank ("2:s1/t0")."""
    if record["rank"] is None:
        return "all"
    if ranks == 1 or "stage" not in record:
        return str(record["rank"])
    return f"{record['rank']}:s{record['stage']}/t{record['tensor_rank']}"


def node_origin(out: Path, rank: int, node_name: str) -> str:
    """Which pass created a node of the rank graph, or of the CPU decode graph (rankN.cpu.onnx's
    decode branch): its ``created_by`` metadata."""
    import onnx

    graph = Path(out) / f"rank{rank}.onnx"
    if not graph.is_file():
        raise UserError(f"--node: {out} was built with build.cpu_graphs: false and holds no rank{rank}.onnx; "
                        "its node provenance is in a build with cpu_graphs: true")
    graphs = [("", onnx.load(graph, load_external_data=False).graph)]
    cpu = Path(out) / f"rank{rank}.cpu.onnx"
    if cpu.is_file():
        step = onnx.load(cpu, load_external_data=False)
        graphs += [(" (CPU decode graph)", a.g) for node in step.graph.node if node.op_type == "If"
                   for a in node.attribute if a.name == "then_branch"]
    for where, graph in graphs:
        for node in graph.node:
            if node.name == node_name:
                meta = {p.key: p.value for p in node.metadata_props}
                return (f"{node.name}{where}: {node.op_type}, created by {meta.get('created_by', 'unknown')}; "
                        f"inputs {list(node.input)}; outputs {list(node.output)}")
    close = [n.name for _, graph in graphs for n in graph.node if node_name.lower() in n.name.lower()][:8]
    hint = f"; nodes containing it: {', '.join(close)}" if close else ""
    raise UserError(f"--node: no node named {node_name!r} in rank{rank}.onnx or its CPU decode graph{hint}")


def _dir_sizes(out: Path, manifest: dict) -> str:
    """The dir's bytes on disk, and how much of it is the engines and the CPU graphs."""
    files = manifest["files"]
    engines = sum(files[r["engine"]]["bytes"] for r in manifest["ranks"] if r["engine"] in files)
    if not has_cpu_graphs(manifest):
        return f"{human_bytes(dir_size(Path(out)))} (engines {human_bytes(engines)}; CPU graphs left out: build.cpu_graphs false)"
    cpu = sum(files[name]["bytes"] for r in manifest["ranks"]
              for name in (r.get("onnx"), r.get("onnx_data"), r.get("paged_onnx"), r.get("cpu_onnx"),
                           r.get("cpu_onnx_data")) if name in files)
    return (f"{human_bytes(dir_size(Path(out)))} (engines {human_bytes(engines)}, CPU graphs {human_bytes(cpu)})")


def _check_ran(records: list[dict]) -> str:
    """Which numerics check the build ran (numerics.CheckPlan.record), from the pass log."""
    label = next((r["numerics"] for r in records if r.get("numerics") and "check" in r["numerics"]), None)
    if label is None:
        return "not run (passes.numerics: false)" if records else "-"
    if label["check"] == "truncated":
        unchecked, alone = (next((r["structure"][key] for r in records if r.get("structure", {}).get(key)), None)
                            for key in ("layers_of_forms_not_in_the_check", "layers_compared_with_none"))
        return (f"on a graph of the first {label['layers']} of {label['of_layers']} decoder layers "
                f"({label['dtype']}), structure checked on all"
                + (f"; layers {layer_spans(unchecked)} keep quantized forms those layers lack (a GGUF mix): "
                   "checked by structure alone" if unchecked else "")
                + (f"; layers {layer_spans(alone)} have a form no other layer has: compared with none"
                   if alone else ""))
    return f"on the built graph ({label['dtype']})"


def _stat(entry: dict | None) -> str:
    return f"{entry['max_abs']:.2g}" if entry else "-"
