"""A trained draft head (EAGLE-3 style): its dir's config, and its graph's I/O in an engine dir.

A draft head dir holds ``draft_head.json`` (``DraftHeadConfig``) and ``draft_head.safetensors``:
``fuse.weight`` [H, 3H] (the target's hidden states after the three ``taps`` layers, concatenated,
to one feature), ``embed_norm.weight``/``feature_norm.weight`` [H], ``combine.weight`` [H, 2H]
(the normed embedding of the next token beside the normed feature, to the layer's input), one
decoder layer of the target's architecture under ``layer.`` (transformers' LlamaDecoderLayer
names), ``norm.weight`` [H], ``lm_head.weight`` [K, H] over the draft vocabulary, and
``draft_to_target`` int64 [K]: each draft id's target id. The token embedding is the target's
(not stored).

At position p the draft reads (embedding of token p + 1, feature of position p) and predicts
token p + 2. The feature is ``fuse(taps)`` where the target computed position p, and the draft's
own ``draft_hidden`` at p − 1 where it drafted p (EAGLE's feature reuse), so a chain of k tokens
costs k draft steps of one decoder layer and a K-wide LM head.

In an engine dir (built with ``speculative.draft_head``) the target's step graphs output
DRAFT_FEATURES = fuse(taps) [B, S, H] at every new position (the fuse projection is built into the
target graph), and ``draft.onnx`` is the draft's step: the step contract's inputs (one layer's
cache) plus FEATURES, outputs DRAFT_LOGITS/DRAFT_HIDDEN at ``logits_index`` rows.
``draft.cpu.onnx`` beside it is the same step in the CPU stage's form (builder/draft_head/
cpu_graph.py: GroupQueryAttention, the caches taken with their rows folded into heads, bound in
place), its large weights read from ``draft.onnx.data``: what the CPU runtime opens.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

CONFIG_FILE = "draft_head.json"
WEIGHTS_FILE = "draft_head.safetensors"
FORMAT = "trtbuild-draft-head"
VERSION = 1

DRAFT_FEATURES = "draft_features"   # target output, float [B, S, H]
FEATURES = "features"               # draft input, float [B, S, H]
DRAFT_LOGITS = "draft_logits"       # draft output, float32 [B, R, K]
DRAFT_HIDDEN = "draft_hidden"       # draft output, float [B, R, H]: the next draft step's feature
DRAFT_GRAPH = "draft.onnx"
# The engine dir's draft-to-target ids: one int64 tensor MAP_TENSOR [K] (the draft dir's own map).
DRAFT_MAP_FILE = "draft_to_target.safetensors"
MAP_TENSOR = "draft_to_target"
DRAFT_CPU_GRAPH = "draft.cpu.onnx"  # the CPU form (builder/draft_head/cpu_graph.py), beside draft.onnx
NUM_HEADS, NUM_KV_HEADS = "draft_num_heads", "draft_num_kv_heads"  # draft.onnx metadata: the layer's heads
NUM_TAPS = 3


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers (0-based decoder layers whose output is tapped):
    layers 2, L/2 and L-3 where the target is deep enough, moved apart on shallow targets so that
    no layer is tapped twice while L ≥ 3 (a repeated tap would spend a third of the fused input on
    a copy)."""
    last = num_layers - 1
    middle = min(num_layers // 2, last)
    low = max(min(2, middle - 1), 0)
    high = min(max(num_layers - 3, middle + 1), last)
    return (low, middle, high)


@dataclass(frozen=True)
class DraftLayerShape:
    """The draft's decoder layer: the target's shapes (a draft from another target does not fit)."""
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float


@dataclass(frozen=True)
class DraftHeadConfig:
    taps: tuple[int, ...]               # target decoder layers whose outputs feed the draft
    target_vocab_size: int
    target_num_layers: int
    draft_vocab_size: int               # K
    layer: DraftLayerShape
    accuracy: dict = field(default_factory=dict)   # held-out: top1, top5, unigram_top1, by_depth, ...
    training: dict = field(default_factory=dict)   # text, tokens, steps, seconds, peak_rss_mib, ...

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "taps": list(self.taps),
                "target_vocab_size": self.target_vocab_size, "target_num_layers": self.target_num_layers,
                "draft_vocab_size": self.draft_vocab_size, "layer": asdict(self.layer),
                "accuracy": self.accuracy, "training": self.training}

    @classmethod
    def from_json(cls, data: dict, where: str) -> "DraftHeadConfig":
        """From an untrusted ``draft_head.json``: every field checked, one line naming it."""
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"{where}: not a draft head config (format {FORMAT!r} version {VERSION} expected; "
                             "make one with `trtbuild draft train`)")
        layer = data.get("layer")
        if not isinstance(layer, dict):
            raise ValueError(f"{where}: layer: an object of the decoder layer's shapes expected")
        ints = {k: layer.get(k) for k in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")}
        floats = {k: layer.get(k) for k in ("rms_norm_eps", "rope_theta")}
        for name, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 20:
                raise ValueError(f"{where}: layer.{name} {value!r}: a positive integer expected")
        for name, value in floats.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{where}: layer.{name} {value!r}: a positive number expected")
        if ints["num_heads"] % ints["num_kv_heads"]:
            raise ValueError(f"{where}: layer.num_heads {ints['num_heads']} is not a multiple of "
                             f"num_kv_heads {ints['num_kv_heads']}")
        for name in ("target_vocab_size", "target_num_layers", "draft_vocab_size"):
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 24:
                raise ValueError(f"{where}: {name} {value!r}: a positive integer expected")
        if data["draft_vocab_size"] > data["target_vocab_size"]:
            raise ValueError(f"{where}: draft_vocab_size {data['draft_vocab_size']} exceeds target_vocab_size "
                             f"{data['target_vocab_size']}")
        taps = data.get("taps")
        if (not isinstance(taps, list) or len(taps) != NUM_TAPS
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in taps)
                or not all(0 <= t < data["target_num_layers"] for t in taps)):
            raise ValueError(f"{where}: taps {taps!r}: {NUM_TAPS} layer indices in [0, target_num_layers "
                             f"{data['target_num_layers']}) expected")
        for name in ("accuracy", "training"):
            if not isinstance(data.get(name, {}), dict):
                raise ValueError(f"{where}: {name}: an object expected")
        return cls(taps=tuple(taps), target_vocab_size=data["target_vocab_size"],
                   target_num_layers=data["target_num_layers"], draft_vocab_size=data["draft_vocab_size"],
                   layer=DraftLayerShape(**ints, **{k: float(v) for k, v in floats.items()}),
                   accuracy=dict(data.get("accuracy", {})), training=dict(data.get("training", {})))

    def fit_problem(self, hidden_size: int, num_layers: int, vocab_size: int) -> str | None:
        """Why this draft does not fit a target of these shapes (None: it fits); names both sides."""
        if self.layer.hidden_size != hidden_size:
            return f"the draft's hidden size {self.layer.hidden_size} != the target's {hidden_size}"
        if self.target_num_layers != num_layers:
            return (f"the draft was trained on a target of {self.target_num_layers} layers (taps "
                    f"{list(self.taps)}); this target has {num_layers}")
        if self.target_vocab_size != vocab_size:
            return f"the draft's target vocabulary {self.target_vocab_size} != the target's {vocab_size}"
        return None


@dataclass(frozen=True)
class DraftHeadEntry:
    """The manifest's ``draft_head`` entry: the draft's graph in the engine dir (its weights in
    ``graph`` + ".data"), the target layers its features fuse, its vocabulary and hidden size, its
    held-out accuracy (the runtime's prior) and the longest chain it drafts."""

    graph: str
    taps: tuple[int, ...]
    draft_vocab_size: int
    hidden: int
    accuracy: dict
    num_tokens: int

    def to_manifest(self) -> dict:
        return {"graph": self.graph, "taps": list(self.taps), "draft_vocab_size": self.draft_vocab_size,
                "hidden": self.hidden, "accuracy": self.accuracy, "num_tokens": self.num_tokens}

    @classmethod
    def from_manifest(cls, entry: object, where: str, num_layers: int, hidden_size: int,
                      vocab_size: int) -> "DraftHeadEntry":
        """From an untrusted manifest, checked against its model's shapes; ValueError naming the field."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{where}: draft_head.{name} {why}")

        fields = set(cls.__dataclass_fields__)
        if not isinstance(entry, dict) or set(entry) != fields:
            raise bad("", f"must be an object with {', '.join(sorted(fields))}")
        # A bare name: ONNX Runtime reads a graph's weights relative to the graph's own folder,
        # and the dir's checks name files relative to the dir.
        if not isinstance(entry["graph"], str) or not entry["graph"] or "/" in entry["graph"] or "\\" in entry["graph"]:
            raise bad("graph", f"{entry['graph']!r}: a file name in the engine dir's top folder expected")
        taps = entry["taps"]
        if (not isinstance(taps, list) or len(taps) != NUM_TAPS
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < num_layers for t in taps)):
            raise bad("taps", f"{taps!r}: {NUM_TAPS} layer indices in [0, {num_layers}) expected")
        for name, top in (("draft_vocab_size", vocab_size), ("hidden", 1 << 20), ("num_tokens", 64)):
            value = entry[name]
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
                raise bad(name, f"{value!r}: an integer in [1, {top}] expected")
        if entry["hidden"] != hidden_size:
            raise bad("hidden", f"{entry['hidden']} != the model's hidden_size {hidden_size}")
        if not isinstance(entry["accuracy"], dict):
            raise bad("accuracy", "must be an object")
        return cls(graph=entry["graph"], taps=tuple(taps), draft_vocab_size=entry["draft_vocab_size"],
                   hidden=entry["hidden"], accuracy=dict(entry["accuracy"]), num_tokens=entry["num_tokens"])
