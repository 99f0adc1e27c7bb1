"""Typed run configuration: presets, command-line overrides, validation.

A preset is a Python file ``configs/<name>.py`` whose ``get_config()`` returns a :class:`Config`
(found by name or path: ``diloco_jax/presets.py``).
Overrides look like ``--config.outer.sync_every=50``. :func:`validate` checks every value before
anything is compiled; a bad value raises :class:`ConfigError` naming the key, the value and what is
allowed. Library code never reads a Config: ``train`` and ``sim`` unpack it into named arguments.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import inspect
import pathlib
from typing import Any, get_type_hints

from diloco_jax import presets
from diloco_jax.algorithm import optim
from diloco_jax.algorithm.compress import CODECS, Codec
from diloco_jax.algorithm.core import Streaming
from diloco_jax.algorithm.dct import DctConfig
from diloco_jax.algorithm.optim import ALGORITHMS
from diloco_jax.tasks.model import COMPUTE_DTYPES

DEFAULT_PRESET = presets.DEFAULT
RUNTIMES = ("auto", "sim", "mesh")
WANDB_MODES = ("offline", "online")
_CODEC, _DCT, _STREAMING = Codec(), DctConfig(), Streaming()  # the library's defaults
_ADAMW = inspect.signature(optim.inner_adamw).parameters
_NESTEROV = inspect.signature(optim.outer_nesterov).parameters


class ConfigError(ValueError):
    """A config value, key or preset is invalid."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The Transformer (``diloco_jax/tasks/model.py``); size presets: ``configs/lm_*.py``."""

    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: int = 4
    tied_embeddings: bool = False  # the output head is the transposed token embedding
    dropout: float = 0.0  # after attention and MLP, in training only
    compute_dtype: str = "float32"  # float32 | bfloat16 (parameters stay float32)
    remat: bool = False  # recompute block activations in the backward pass (less memory)


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """The image model (``diloco_jax/tasks/vision.py``), used when ``data.corpus`` is an image
    dataset (``digits``)."""

    width: int = 16  # channels of the first stage (doubling per stage)
    stages: int = 2
    depth: int = 1  # residual blocks per stage


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # a shipped corpus name, a .txt / .txt.gz / .txt.xz path, tfds:NAME (a TFDS dataset in
    # array_record format under data.data_dir; see `python -m diloco_jax.data.prepare`), or an
    # image dataset (digits: image classification with a ResNet, see the resnet section). A TFDS
    # dataset with an image feature (data.image_feature) is image classification too.
    corpus: str = "shakespeare"
    data_dir: str = ""  # TFDS data dir; "": ~/tensorflow_datasets
    train_split: str = "train"  # TFDS splits, slices too (train[:90%] / train[90%:])
    eval_split: str = ""  # "": validation, else test
    text_feature: str = "text"  # the text feature of a TFDS dataset that has no 'tokens'
    image_feature: str = "image"  # TFDS image datasets: the image and label features
    label_feature: str = "label"
    image_size: int = 0  # > 0: resize TFDS images to this square size; 0: keep (one size)
    seq_len: int = 128
    batch_size: int = 16  # per replica, per inner step
    val_fraction: float = 0.05  # text files and digits; a TFDS dataset has its own splits
    eval_windows: int = 256  # validation windows per eval; <= 0 for the whole split


@dataclasses.dataclass(frozen=True)
class InnerConfig:
    """AdamW (``algorithm/optim.inner_adamw``); defaults past the schedule are the library's."""

    learning_rate: float = 3e-3
    warmup_steps: int = 50
    final_lr_fraction: float = _ADAMW["final_lr_fraction"].default
    weight_decay: float = _ADAMW["weight_decay"].default
    b1: float = _ADAMW["b1"].default
    b2: float = _ADAMW["b2"].default
    clip_norm: float = _ADAMW["clip_norm"].default


@dataclasses.dataclass(frozen=True)
class OuterConfig:
    sync_every: int = 50
    learning_rate: float = _NESTEROV["learning_rate"].default  # the paper's 0.7, 0.9, Nesterov
    momentum: float = _NESTEROV["momentum"].default
    nesterov: bool = _NESTEROV["nesterov"].default
    reset_inner_state: bool = False
    # sync: the paper; delayed: apply the previous sync's mean (its all-reduce overlaps the next
    # round); eager: the previous mean with this replica's fresh share (Kale et al., 2025)
    mode: str = "sync"


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    replicas: int = 4
    runtime: str = "auto"  # auto: mesh when there are several devices, else sim (vmap)
    replica_devices: int = 0  # 0: as many as divide `replicas` and the device count
    data_devices: int = 0  # 0: the remaining devices that divide the batch


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    total_steps: int = 1000  # inner steps per replica
    log_every: int = 25  # also the number of steps compiled into one call
    eval_every: int = 250
    sample_chars: int = 300  # printed at the end; 0 to skip
    sample_prompt: str = "ROMEO.\n"
    checkpoint: bool = True
    # inner steps between checkpoints, a multiple of log_every (and, for DiLoCo, of sync_every:
    # saves land on sync boundaries); 0: only at the end
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    init_from: str = ""  # a workdir of an earlier run: start from its final outer params
    # debug: after every call, check that every shared field (anchor, outer state, step, pending
    # mean) is bitwise identical on all devices and processes (default: the anchor after syncs)
    check_replicated: bool = False


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """Simulated conditions: stragglers, failures, the network. See ``diloco_jax/schedule.py``
    and ``sim/clock.py``."""

    speeds: str = ""  # per-replica compute speed factors, e.g. "1,1,0.5,0.25"; "" = all 1
    dylu: bool = False  # Dynamic Local Updates: slow replicas take fewer inner steps per round
    drop_prob: float = 0.0  # each replica independently dropped at each sync
    drop: str = ""  # "r:a-b;...": replica r dropped for outer steps [a, b) (0-based)
    network: str = "datacenter"  # datacenter | wan_1gbit
    bandwidth_gbps: float = 0.0  # 0: the network preset's
    latency_ms: float = -1.0  # < 0: the network preset's
    topology: str = "ring"  # ring | parameter_server
    step_time_s: float = 0.0  # one replica's inner step on its own device; 0: measured
    diagnostics: bool = True  # mean pairwise cosine of pseudo-gradients at each sync


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """What a run reports besides ``metrics.jsonl`` and TensorBoard (``diloco_jax/records.py``)."""

    progress_bar: bool = True  # the bar on stderr (TQDM_DISABLE=1 turns it off too)
    wandb: bool = False  # also log to Weights & Biases (needs pip install 'diloco-jax[wandb]')
    wandb_project: str = "diloco-jax"
    wandb_mode: str = "offline"  # offline: files under workdir/wandb (wandb sync); online


@dataclasses.dataclass(frozen=True)
class CompressConfig:
    """How DiLoCo's pseudo-gradients travel; see ``diloco_jax/algorithm/compress.py``."""

    # defaults are the library's own (Codec, DctConfig): one source
    codec: str = _CODEC.name  # none | bf16 | int8 | fp8 | int4 | topk | dct (DCT momentum)
    block: int = _CODEC.block  # values per scale (int8, fp8, int4)
    topk_fraction: float = _CODEC.topk_fraction  # share of values topk sends
    min_size: int = _CODEC.min_size  # leaves with fewer values travel in float32
    error_feedback: bool = _CODEC.error_feedback  # keep what encoding lost; add it to the next
    dct_chunk: int = _DCT.chunk  # dct: values per DCT chunk
    dct_topk: int = _DCT.topk  # dct: coefficients each replica sends per chunk
    dct_beta: float = _DCT.beta  # dct: decay of the local momentum of pseudo-gradients


@dataclasses.dataclass(frozen=True)
class StreamingConfig:
    """Streaming DiLoCo (arXiv 2501.18512); see ``diloco_jax/algorithm/plan.py``."""

    fragments: int = _STREAMING.fragments  # F: fragment f syncs every outer.sync_every steps
    overlap: int = _STREAMING.overlap  # tau: inner steps from a fragment's sync to its landing
    mix: float = _STREAMING.mix  # alpha: weight of the local parameters when it lands


@dataclasses.dataclass(frozen=True)
class Config:
    algorithm: str = "diloco"  # diloco | ddp | single
    seed: int = 0
    model: ModelConfig = ModelConfig()
    resnet: ResNetConfig = ResNetConfig()
    data: DataConfig = DataConfig()
    inner: InnerConfig = InnerConfig()
    outer: OuterConfig = OuterConfig()
    compress: CompressConfig = CompressConfig()
    streaming: StreamingConfig = StreamingConfig()
    parallel: ParallelConfig = ParallelConfig()
    train: TrainConfig = TrainConfig()
    sim: SimConfig = SimConfig()
    log: LogConfig = LogConfig()


def load_preset(preset: str | pathlib.Path) -> Config:
    """Runs ``get_config()`` of a preset: a file, or the name of a preset that comes with
    diloco-jax (``tiny``; :func:`diloco_jax.presets.find`)."""
    try:
        path = presets.find(preset)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    spec = importlib.util.spec_from_file_location(f"diloco_preset_{path.stem}", path)
    if spec is None:  # importlib reads .py files only
        raise ConfigError(f"config preset {path} is not a Python file (.py) with get_config()")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(f"cannot load config preset {path}: {type(e).__name__}: {e}") from None
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config preset {path} has no get_config() function")
    cfg = module.get_config()
    if not isinstance(cfg, Config):
        raise ConfigError(f"get_config() of {path} returned {type(cfg).__name__}, not Config")
    return cfg


def keys(cfg: Any = Config(), prefix: str = "") -> dict[str, Any]:
    """Every leaf key of ``cfg`` (``"outer.sync_every"``) with its value."""
    out = {}
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if dataclasses.is_dataclass(value):
            out.update(keys(value, f"{prefix}{field.name}."))
        else:
            out[f"{prefix}{field.name}"] = value
    return out


def _parse(text: str, kind: type, key: str) -> Any:
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"config key {key}: {text!r} is not a bool (use true or false)")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"config key {key}: {text!r} is not a valid {kind.__name__}") from None


def override(cfg: Config, key: str, text: str) -> Config:
    """Returns ``cfg`` with dotted ``key`` set to ``text`` parsed as the field's type."""
    known = keys(cfg)
    if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"unknown config key {key!r}{hint} (`--help` lists every key)")
    *path, leaf = key.split(".")
    nodes = [cfg]
    for name in path:
        nodes.append(getattr(nodes[-1], name))
    kind = get_type_hints(type(nodes[-1]))[leaf]
    value = _parse(text, kind, key)
    for node, name in zip(reversed(nodes), reversed([*path, leaf]), strict=True):
        value = dataclasses.replace(node, **{name: value})
    return value


def apply_overrides(cfg: Config, overrides: list[tuple[str, str]]) -> Config:
    for key, text in overrides:
        cfg = override(cfg, key, text)
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


_POSITIVE = (
    "model.d_model", "model.num_layers", "model.num_heads", "model.mlp_ratio", "data.seq_len",
    "data.batch_size", "parallel.replicas", "train.total_steps", "train.log_every",
    "train.eval_every", "train.keep_checkpoints", "resnet.width", "resnet.stages", "resnet.depth",
)  # fmt: skip
_NON_NEGATIVE = (
    "parallel.replica_devices", "parallel.data_devices", "inner.warmup_steps", "train.sample_chars",
    "train.checkpoint_every", "data.image_size",
)  # fmt: skip


def _enforce(rules: list[tuple[str, bool, str]], flat: dict[str, Any]) -> None:
    """Raises for the first ``(key, ok, allowed)`` rule that fails, naming key, value and rule."""
    for key, ok, allowed in rules:
        if not ok:
            raise ConfigError(f"config key {key} = {flat[key]!r} is invalid: {allowed}")


def validate(cfg: Config) -> None:
    """Checks every value that does not depend on the devices; raises :class:`ConfigError`
    naming the first bad key, its value and what is allowed."""
    flat = keys(cfg)
    rules = [(key, flat[key] >= 1, "must be an integer >= 1") for key in _POSITIVE]
    rules += [(key, flat[key] >= 0, "must be >= 0") for key in _NON_NEGATIVE]
    _enforce(rules, flat)
    _validate_library_options(cfg)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    rules = [
        ("algorithm", cfg.algorithm in ALGORITHMS, f"must be one of {ALGORITHMS}"),
        ("seed", 0 <= cfg.seed < 2**31, "must be an integer in [0, 2**31)"),
        ("parallel.runtime", p.runtime in RUNTIMES, f"must be one of {RUNTIMES}"),
        ("model.d_model", m.d_model % m.num_heads == 0,
         f"must be divisible by model.num_heads = {m.num_heads}"),
        ("model.dropout", 0 <= m.dropout < 1, "must be in [0, 1)"),
        ("model.compute_dtype", m.compute_dtype in COMPUTE_DTYPES,
         f"must be one of {tuple(COMPUTE_DTYPES)}"),
        ("data.val_fraction", 0 < cfg.data.val_fraction < 1, "must be in (0, 1)"),
        ("data.train_split",
         cfg.data.corpus.startswith("tfds:") or (cfg.data.train_split, cfg.data.eval_split)
         == ("train", ""), "only TFDS datasets (data.corpus=tfds:NAME) have named splits "
         "(data.train_split, data.eval_split)"),
        ("parallel.replica_devices", p.replicas % max(p.replica_devices, 1) == 0,
         f"must divide parallel.replicas = {p.replicas}"),
        ("data.batch_size", cfg.data.batch_size % max(p.data_devices, 1) == 0,
         f"must be divisible by parallel.data_devices = {p.data_devices}"),
        ("train.checkpoint_every", t.checkpoint_every % t.log_every == 0,
         f"must be a multiple of train.log_every = {t.log_every} (saves happen between calls)"),
        ("train.checkpoint_every",
         cfg.algorithm != "diloco" or t.checkpoint_every % cfg.outer.sync_every == 0,
         f"must be a multiple of outer.sync_every = {cfg.outer.sync_every} (saves happen at "
         "sync boundaries)"),
        ("log.wandb_mode", cfg.log.wandb_mode in WANDB_MODES, f"must be one of {WANDB_MODES}"),
        ("log.wandb_project", bool(cfg.log.wandb_project.strip()), "must name a project"),
        ("log.wandb", not cfg.log.wandb or importlib.util.find_spec("wandb") is not None,
         "needs the wandb package: pip install 'diloco-jax[wandb]' (uv sync --extra wandb)"),
    ]  # fmt: skip
    _enforce(rules, flat)
    _validate_variants(cfg)
    _validate_sim(cfg)


def _validate_library_options(cfg: Config) -> None:
    """The library's own checks of DiLoCo's arguments (``check_options``: ranges and what
    combines), reported with config keys."""
    from diloco_jax import recipe
    from diloco_jax.algorithm import OptionError

    codecs = (*CODECS, "dct")  # the config's codec key also chooses DCT momentum
    _enforce([("compress.codec", cfg.compress.codec in codecs, f"must be one of {codecs}")],
             keys(cfg))  # fmt: skip
    try:
        recipe.check(cfg)
    except OptionError as e:
        key = recipe.KEY_OF_OPTION[e.option]
        allowed = e.render(recipe.KEY_OF_OPTION)
        raise ConfigError(f"config key {key} = {keys(cfg)[key]!r} is invalid: {allowed}") from None


def _validate_variants(cfg: Config) -> None:
    """What the config adds to the library's checks: which variants need DiLoCo, fragments
    against the model's layers, one error-feedback key shared by codecs and DCT momentum."""
    c, st, o = cfg.compress, cfg.streaming, cfg.outer
    diloco, plain = cfg.algorithm == "diloco", st.fragments == 1 and st.overlap == 0
    sim = cfg.sim
    rules = [
        ("compress.codec", c.codec == "none" or diloco,
         f"compresses DiLoCo's pseudo-gradients; algorithm is {cfg.algorithm!r}"),
        ("outer.mode", o.mode == "sync" or diloco,
         f"overlaps DiLoCo's outer step; algorithm is {cfg.algorithm!r}"),
        ("streaming.fragments", st.fragments == 1 or diloco,
         f"streams DiLoCo's syncs; algorithm is {cfg.algorithm!r}"),
        ("streaming.fragments", st.fragments <= cfg.model.num_layers,
         f"must be <= model.num_layers = {cfg.model.num_layers} (fragments are strided layers)"),
        ("compress.error_feedback", c.codec != "dct" or not c.error_feedback,
         "dct keeps what it does not send in its momentum already; set it to false"),
        ("streaming.fragments", plain or not (sim.speeds or sim.dylu or sim.drop or sim.drop_prob),
         "streaming does not combine with simulated stragglers or failures (sim.speeds, "
         "sim.dylu, sim.drop, sim.drop_prob)"),
    ]  # fmt: skip
    _enforce(rules, keys(cfg))


def _validate_sim(cfg: Config) -> None:
    from diloco_jax import comms, schedule

    sim = cfg.sim
    try:
        schedule.parse_speeds(sim.speeds, cfg.parallel.replicas)
        schedule.parse_drops(sim.drop, cfg.parallel.replicas)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    rules = [
        ("sim.drop_prob", 0 <= sim.drop_prob < 1, "must be in [0, 1)"),
        ("sim.network", sim.network in comms.NETWORKS, f"must be one of {tuple(comms.NETWORKS)}"),
        ("sim.topology", sim.topology in comms.TOPOLOGIES, f"must be one of {comms.TOPOLOGIES}"),
        ("sim.step_time_s", sim.step_time_s >= 0, "must be >= 0 (0: measured)"),
        ("sim.bandwidth_gbps", sim.bandwidth_gbps >= 0, "must be >= 0 (0: the network preset's)"),
    ]  # fmt: skip
    _enforce(rules, keys(cfg))
