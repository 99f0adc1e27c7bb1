"""The config's schema: every key, its type, default and one-line description. Presets and
command-line overrides are read into it by :mod:`~diloco_jax.config.dotted`.

A preset is a Python file ``configs/<name>.py`` whose ``get_config()`` returns a :class:`Config`
(found by name or path: ``diloco_jax/config/presets.py``). Overrides look like
``--config.outer.sync_every=50``. :func:`diloco_jax.config.validate` checks every value before
anything is compiled; a bad value raises :class:`ConfigError` naming the key, the value and
what is allowed. Library code never reads a Config: ``train`` and ``sim`` unpack it into named
arguments.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from diloco_jax.algorithm import optim
from diloco_jax.algorithm.compress import Codec
from diloco_jax.algorithm.dct import SPARSELOCO, DctConfig
from diloco_jax.algorithm.gossip import Gossip
from diloco_jax.algorithm.robust import ATTACKS, RULES, Merge
from diloco_jax.algorithm.variants import Streaming
from diloco_jax.config import presets

DEFAULT_PRESET = presets.DEFAULT
RUNTIMES = ("auto", "sim", "mesh")
WANDB_MODES = ("offline", "online")
_CODEC, _DCT, _STREAMING = Codec(), DctConfig(), Streaming()  # the library's defaults
_SPARSE = SPARSELOCO
_GOSSIP = Gossip(replicas=2)
_MERGE = Merge()
_INNER = inspect.signature(optim.inner_optimizer).parameters
_OUTER = inspect.signature(optim.outer_optimizer).parameters


def _key(default: Any, about: str) -> Any:
    """A config field with its one-line description (``--help`` shows it)."""
    return dataclasses.field(default=default, metadata={"about": about})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The Transformer (``diloco_jax/tasks/model.py``); size presets: ``configs/lm_*.py``."""

    d_model: int = _key(128, "width of the residual stream")
    num_layers: int = _key(2, "Transformer blocks")
    num_heads: int = _key(4, "attention heads (must divide model.d_model)")
    mlp_ratio: int = _key(4, "MLP hidden width over model.d_model")
    tied_embeddings: bool = _key(False, "the output head is the transposed token embedding")
    dropout: float = _key(0.0, "dropout after attention and MLP, in training only; in [0, 1)")
    compute_dtype: str = _key("float32", "float32 | bfloat16 (parameters stay float32)")
    remat: bool = _key(False, "recompute block activations in the backward pass (less memory)")


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """The image model (``diloco_jax/tasks/vision.py``), used when ``data.corpus`` is an image
    dataset (``digits``)."""

    width: int = _key(16, "image model: channels of the first stage (doubling per stage)")
    stages: int = _key(2, "image model: stages")
    depth: int = _key(1, "image model: residual blocks per stage")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The training data (``diloco_jax/data/``): a built-in corpus, a text file, a prepared
    TFDS dataset or images; each replica's batch."""

    corpus: str = _key("shakespeare", "shakespeare | digits | a .txt/.txt.gz/.txt.xz file | "
                       "tfds:NAME (diloco-prepare; in data.data_dir)")  # fmt: skip
    data_dir: str = _key("", "TFDS data dir; empty: ~/tensorflow_datasets")
    train_split: str = _key("train", "TFDS training split; slices too (train[:90%])")
    eval_split: str = _key("", "TFDS eval split; empty: validation, else test")
    text_feature: str = _key("text", "TFDS text datasets without 'tokens': the text feature")
    image_feature: str = _key("image", "TFDS image datasets: the image feature")
    label_feature: str = _key("label", "TFDS image datasets: the label feature")
    image_size: int = _key(0, "TFDS images: resize to this square size; 0: keep (one size)")
    seq_len: int = _key(128, "tokens per training window")
    batch_size: int = _key(16, "windows per replica per inner step")
    val_fraction: float = _key(0.05, "text files and digits: held-out share; in (0, 1)")
    eval_windows: int = _key(256, "validation windows per eval; <= 0: the whole split")
    max_memory_mib: float = _key(0.0, "a training split (text or TFDS) larger than this "
                                 "streams from disk, never loaded; 0: no limit")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class InnerConfig:
    """The inner optimizer (``algorithm/optim.inner_optimizer``); defaults past the schedule
    are the library's."""

    optimizer: str = _key(_INNER["name"].default, "adamw (the paper) | muon (MuLoCo) | "
                          "package.module:function returning your optax transform")  # fmt: skip
    args: str = _key("", "keyword arguments of an import-path inner.optimizer, as a JSON object")
    learning_rate: float = _key(3e-3, "inner peak learning rate (Muon's scaled to AdamW's RMS)")
    warmup_steps: int = _key(50, "linear warmup steps, then cosine decay")
    final_lr_fraction: float = _key(_INNER["final_lr_fraction"].default,
                                    "learning rate at the end over the peak")  # fmt: skip
    weight_decay: float = _key(_INNER["weight_decay"].default, "decoupled weight decay; >= 0")
    b1: float = _key(_INNER["b1"].default, "Adam beta1; in [0, 1)")
    b2: float = _key(_INNER["b2"].default, "Adam beta2; in [0, 1)")
    clip_norm: float = _key(_INNER["clip_norm"].default, "global gradient norm clip; 0: none")
    momentum: float = _key(_INNER["momentum"].default, "muon: Nesterov momentum; in [0, 1)")


@dataclasses.dataclass(frozen=True)
class OuterConfig:
    """DiLoCo's outer loop: the sync period, the outer optimizer (the paper's Nesterov SGD)
    and when its step applies (``diloco_jax/algorithm/timing.py``)."""

    sync_every: int = _key(50, "inner steps between syncs (H)")
    optimizer: str = _key(_OUTER["name"].default, "sgd (the paper's Nesterov) | adam | adamw "
                          "| package.module:function returning your optax transform")  # fmt: skip
    args: str = _key("", "keyword arguments of an import-path outer.optimizer, as a JSON object")
    learning_rate: float = _key(_OUTER["learning_rate"].default,
                                "outer learning rate (the paper: 0.7)")  # fmt: skip
    momentum: float = _key(_OUTER["momentum"].default, "sgd's outer momentum (the paper: 0.9)")
    overlap_momentum: float = _key(-1.0, "outer.momentum's stand-in where outer.mode is delayed "
                                   "or eager; < 0: 0.5 eager, 0 delayed")  # fmt: skip
    nesterov: bool = _key(_OUTER["nesterov"].default, "Nesterov outer momentum (sgd)")
    b1: float = _key(_OUTER["b1"].default, "adam(w): first-moment decay")
    b2: float = _key(_OUTER["b2"].default, "adam(w): second-moment decay")
    eps: float = _key(_OUTER["eps"].default, "adam(w): epsilon")
    weight_decay: float = _key(_OUTER["weight_decay"].default, "adamw: decay of the anchor")
    schedule: str = _key(_OUTER["schedule"].default, "outer lr over outer steps: constant | "
                         "cosine | linear (to final_lr_fraction at the last sync)")  # fmt: skip
    warmup: int = _key(_OUTER["warmup"].default, "outer steps of linear outer-lr warmup from 0")
    final_lr_fraction: float = _key(
        _OUTER["final_lr_fraction"].default, "cosine/linear: last outer lr / outer.learning_rate"
    )
    reset_inner_state: bool = _key(False, "reset AdamW's state at every sync")
    mode: str = _key("sync", "sync (the paper) | delayed (the previous sync's mean) | eager "
                     "(previous mean + own fresh share)")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Where the replicas run (``diloco_jax/runtime/``): the simulator (``vmap`` on one device)
    or a mesh of devices and processes, with a data axis or FSDP within a replica."""

    replicas: int = _key(4, "DiLoCo replicas (R)")
    runtime: str = _key("auto", "auto (mesh on several devices, CPU cores too; else sim) | sim "
                        "(vmap) | mesh")  # fmt: skip
    replica_devices: int = _key(0, "devices along the replica axis; 0: as many as divide")
    data_devices: int = _key(0, "devices per replica (data axis); 0: the rest that divide")
    fsdp: bool = _key(False, "split each replica's parameters, inner and outer state over its "
                      "data devices (FSDP; mesh runtime)")  # fmt: skip
    cpu_devices: int = _key(0, "XLA devices the CPU is split into before JAX starts; 0: one per "
                            "core dividing the replicas")  # fmt: skip
    device_memory_gib: float = _key(0.0, "one device's memory for the memory plan; 0: the "
                                    "device's own (CPU: RAM / CPU devices)")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The run's length, logs, evaluations and checkpoints (``diloco_jax/run/loop.py``)."""

    total_steps: int = _key(1000, "inner steps per replica")
    log_every: int = _key(25, "steps between logs; also steps compiled into one call")
    eval_every: int = _key(250, "steps between evaluations")
    eval_at_start: str = _key("auto", "evaluate the initial parameters at step 0: auto (a "
                              "user's task) | true | false")  # fmt: skip
    sample_chars: int = _key(300, "characters sampled at the end; 0: none")
    sample_prompt: str = _key("ROMEO.\n", "prompt of the final sample")
    checkpoint: bool = _key(True, "save checkpoints (and resume from the workdir's)")
    compile_cache: str = _key("", "JAX's compilation cache dir; empty: $DILOCO_COMPILE_CACHE, "
                              "else ~/.cache/diloco_jax/xla; off: none")  # fmt: skip
    checkpoint_every: int = _key(0, "steps between saves, a multiple of train.log_every (and "
                                 "outer.sync_every); 0: none by steps")  # fmt: skip
    checkpoint_minutes: float = _key(2.0, "minutes between saves (at the next sync); 0: none "
                                     "by time")  # fmt: skip
    keep_checkpoints: int = _key(3, "checkpoints kept")
    init_from: str = _key("", "start from the final outer params of this earlier workdir")
    check_replicated: bool = _key(False, "debug: check every shared field is identical on every "
                                  "device after every call")  # fmt: skip
    deterministic: bool = _key(True, "GPU: equal bits run to run (XLA's deterministic ops, "
                               "set before JAX starts); CPU always is")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """Simulated conditions: stragglers, failures, the network. See
    ``diloco_jax/simulated/schedule.py`` and ``sim/clock.py``."""

    speeds: str = _key("", "per-replica speed factors, e.g. 1,1,0.5,0.25; empty: all 1")
    dylu: bool = _key(False, "Dynamic Local Updates: slow replicas take fewer inner steps")
    drop_prob: float = _key(0.0, "chance each replica is dropped at each sync; in [0, 1)")
    drop: str = _key("", "r:a-b;...: replica r dropped for outer steps [a, b) (0-based)")
    quorum: int = _key(0, "a sync waits for this many replicas, then sim.grace; late ones join "
                       "the next; 0: all")  # fmt: skip
    grace: float = _key(0.0, "with sim.quorum: the wait for more replicas, in rounds at speed 1")
    network: str = _key("datacenter", "datacenter | wan_1gbit")
    bandwidth_gbps: float = _key(0.0, "link bandwidth; 0: the network preset's")
    latency_ms: float = _key(-1.0, "link latency; < 0: the network preset's")
    topology: str = _key("ring", "ring | parameter_server")
    step_time_s: float = _key(0.0, "one replica's inner step on its own device; 0: measured")
    attack: str = _key("none", " | ".join(ATTACKS) + ": what the hostile replicas send")
    attackers: int = _key(0, "f: hostile replicas, chosen from the seed")
    attack_strength: float = _key(0.0, "the attack's factor (scale, z, epsilon, ...); 0: its own")
    diagnostics: bool = _key(True, "mean pairwise cosine of pseudo-gradients at each sync")
    chunk: int = _key(0, "inner steps of this many replicas at a time (more replicas than fit); "
                      "0: all at once")  # fmt: skip
    offload: bool = _key(False, "with sim.chunk: the replicas' state waits in host memory and "
                         "syncs run on the host")  # fmt: skip
    plot_metric: str = _key("eval_loss", "what a sweep's figures plot: eval_loss or another "
                            "value the evaluation returns (accuracy)")  # fmt: skip
    plot_label: str = _key("", "what the figures' axis calls it (validation MSE); empty: "
                           "validation loss, or sim.plot_metric's name")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """What a run reports besides ``metrics.jsonl`` and TensorBoard
    (``diloco_jax/watch/records.py``)."""

    progress_bar: bool = _key(True, "the progress bar on stderr (TQDM_DISABLE=1 turns it off)")
    figures: bool = _key(True, "drift.png and cosine.png at the end (matplotlib: ~2 s on CPU)")
    wandb: bool = _key(
        False, "also log to Weights & Biases (the wandb extra: uv sync --extra wandb)"
    )
    wandb_project: str = _key("diloco-jax", "the W&B project")
    wandb_mode: str = _key("offline", "offline (files under workdir/wandb; wandb sync) | online")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """The run's HTTP status, metrics, dashboard and control (``diloco_jax/watch/serve.py``)."""

    port: int = _key(0, "serve /status, /metrics, the dashboard and /control on this port; 0: off")
    host: str = _key("127.0.0.1", "the address to bind; any but loopback needs a token")
    token_file: str = _key("", "a file holding the token; empty: $DILOCO_SERVE_TOKEN, else a new "
                           "one in WORKDIR/serve_token")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SyncerConfig:
    """Independent learners and a syncer (``diloco_jax/learners/``): a run with
    ``syncer.address`` is a learner; ``python -m diloco_jax.syncer`` serves at it."""

    address: str = _key("", "HOST:PORT of the syncer (shards: each one's, comma-separated); "
                        "a run with it is a learner")  # fmt: skip
    shards: int = _key(1, "syncer shards: the anchor split over this many syncer processes, "
                       "shard 0 deciding each round")  # fmt: skip
    shard: int = _key(0, "the syncer process's shard in [0, syncer.shards); learners ignore "
                      "it")  # fmt: skip
    learner: int = _key(0, "this learner's index in [0, syncer.learners): its data shards")
    learners: int = _key(1, "the learners declared: the data is split into this many parts")
    drop: str = _key("", "learner indices removed from the run (comma-separated): refused from "
                     "then on, even without this key")  # fmt: skip
    timeout: float = _key(60.0, "seconds a round waits after its first push for the others; "
                          "then it closes without them")  # fmt: skip
    dead_after: float = _key(30.0, "seconds of silence after which a learner is dropped")
    heartbeat: float = _key(2.0, "seconds between a learner's heartbeats")
    quorum: int = _key(0, "0: rounds wait for every learner; K: a round closes once K pushed "
                       "on time and the grace passed")  # fmt: skip
    grace: float = _key(10.0, "quorum rounds: seconds a round waits after its quorum for the "
                        "others (at most)")  # fmt: skip
    adaptive_grace: bool = _key(True, "quorum rounds: the grace follows how late learners came "
                                "in the last 8 rounds")  # fmt: skip
    max_late: int = _key(4, "quorum rounds: pushes up to this many rounds late are merged; later "
                         "ones refused")  # fmt: skip
    rounds: int = _key(0, "the run's outer steps: after this many rounds each learner ends at its "
                       "next sync; 0: off")  # fmt: skip
    examples: int = _key(0, "the run's budget: once this many examples have been merged each "
                         "learner ends; 0: off")  # fmt: skip
    stay: bool = _key(False, "the syncer serves on after every declared learner has left at the "
                      "run's end; false: it exits 0")  # fmt: skip
    weigh_rounds: bool = _key(True, "the outer step takes the mean x the round's examples / a "
                              "full round's: thin rounds move less")  # fmt: skip
    late_weight: float = _key(0.5, "quorum rounds: a late push's merge weight x this per round "
                              "late")  # fmt: skip
    status_port: int = _key(0, "the syncer's status page, /status and /metrics on this port; "
                            "0: off")  # fmt: skip
    token_file: str = _key("", "a file holding the token; empty: $DILOCO_SERVE_TOKEN, else the "
                           "credentials' token")  # fmt: skip
    credentials: str = _key("", "this host's folder of `diloco-syncer certs` (DIR/syncer, "
                            "DIR/learner_I): TLS and token; empty: none")  # fmt: skip
    mutual_tls: bool = _key(False, "the syncer requires each learner's certificate, its name the "
                            "one its credential claims")  # fmt: skip
    insecure: bool = _key(False, "allow a syncer address off loopback without TLS (credentials "
                          "and tensors in clear)")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CompressConfig:
    """How DiLoCo's pseudo-gradients travel; see ``diloco_jax/algorithm/compress.py``. The
    defaults are the library's own (Codec, DctConfig): one source."""

    codec: str = _key(_CODEC.name, "none | bf16 | int8 | fp8 | int4 | topk | dct (DCT momentum) "
                      "| sparseloco")  # fmt: skip
    block: int = _key(_CODEC.block, "values per scale (int8, fp8, int4)")
    topk_fraction: float = _key(_CODEC.topk_fraction, "share of values topk sends")
    min_size: int = _key(_CODEC.min_size, "leaves with fewer values travel in float32")
    error_feedback: bool = _key(_CODEC.error_feedback,
                                "keep what encoding lost; add it to the next")  # fmt: skip
    answers: bool = _key(False, "learners: the syncer answers with the anchor's change "
                         "through the codec, keeping the error")  # fmt: skip
    dct_chunk: int = _key(_DCT.chunk, "dct: values per DCT chunk")
    dct_topk: int = _key(_DCT.topk, "dct: coefficients each replica sends per chunk")
    dct_beta: float = _key(_DCT.beta, "dct: decay of the local momentum of pseudo-gradients")
    sparse_chunk: int = _key(_SPARSE.chunk, "sparseloco: values per top-k chunk")
    sparse_topk: int = _key(_SPARSE.topk, "sparseloco: values each replica sends per chunk")
    sparse_beta: float = _key(_SPARSE.beta, "sparseloco: decay of the error-feedback accumulator")
    sparse_bits: int = _key(_SPARSE.bits, "sparseloco: bits per sent value: 2 or 32 (float32)")


@dataclasses.dataclass(frozen=True)
class StreamingConfig:
    """Streaming DiLoCo (arXiv 2501.18512); see ``diloco_jax/algorithm/plan.py``."""

    fragments: int = _key(_STREAMING.fragments, "F: parameter fragments, syncs staggered")
    overlap: int = _key(_STREAMING.overlap, "tau: inner steps from a fragment's sync to landing")
    mix: float = _key(_STREAMING.mix, "alpha: weight of the local parameters when it lands")


@dataclasses.dataclass(frozen=True)
class MergeConfig:
    """How a sync merges the pseudo-gradients, against replicas or learners that send harmful
    values (issue 63); see ``diloco_jax/algorithm/robust.py``."""

    rule: str = _key(_MERGE.rule, " | ".join(RULES) + ": how a sync merges the replicas' "
                     "pseudo-gradients")  # fmt: skip
    trim: int = _key(_MERGE.trim, "trimmed_mean: values dropped from each side, per coordinate")
    clip: float = _key(_MERGE.clip, "> 0: first clip each pseudo-gradient's norm to clip x the "
                       "round's median norm; 0: off")  # fmt: skip
    radius: float = _key(_MERGE.radius, "centered_clip: its radius, times the median distance "
                         "to the last merge")  # fmt: skip
    iterations: int = _key(_MERGE.iterations, "centered_clip: clipping steps per sync")


@dataclasses.dataclass(frozen=True)
class DeslocConfig:
    """DES-LOC (arXiv 2505.22549): the inner optimizer's moments averaged across replicas on
    their own periods (``diloco_jax/algorithm/moments.py``)."""

    first_moment_every: int = _key(0, "steps between averages of first moments (mu); a "
                                   "multiple of outer.sync_every; 0: never")  # fmt: skip
    second_moment_every: int = _key(0, "the same for the second moments (nu)")


@dataclasses.dataclass(frozen=True)
class NolocoConfig:
    """NoLoCo (arXiv 2506.10911): pairwise averaging, no all-reduce
    (``diloco_jax/algorithm/gossip.py``)."""

    enabled: bool = _key(False, "each replica averages with one seeded partner per sync, keeping "
                         "its own anchor")  # fmt: skip
    pull: float = _key(_GOSSIP.pull, "gamma / outer lr: pull of a replica's anchor to its pair's")
    pairings: int = _key(_GOSSIP.pairings, "seeded pairings compiled; sync n uses n mod this")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """A user's task in place of the built-in ones (``diloco_jax/tasks/arrays.py``,
    ``diloco_jax/tasks/pipeline.py``)."""

    factory: str = _key("", "package.module:function giving a diloco_jax.ArrayTask or "
                        "GrainTask; empty: data.corpus's task")  # fmt: skip
    args: str = _key("", "keyword arguments of task.factory, as a JSON object")


@dataclasses.dataclass(frozen=True)
class Config:
    """A run's whole configuration: one section per part of the run (``model``, ``data``,
    ``inner``, ``outer``, ``train``, ``sim``, ...), each a frozen dataclass of keys. Build it
    from a preset (``load_preset``, ``get_config()``) with overrides; the
    :doc:`configuration reference </_generated/configuration>` lists every key with its type,
    default and what it does."""

    algorithm: str = _key("diloco", "diloco | ddp (data parallel) | single (one worker)")
    seed: int = _key(0, "seed of parameters, data order and simulated failures; in [0, 2**31)")
    model: ModelConfig = ModelConfig()
    resnet: ResNetConfig = ResNetConfig()
    data: DataConfig = DataConfig()
    task: TaskConfig = TaskConfig()
    inner: InnerConfig = InnerConfig()
    outer: OuterConfig = OuterConfig()
    compress: CompressConfig = CompressConfig()
    streaming: StreamingConfig = StreamingConfig()
    merge: MergeConfig = MergeConfig()
    desloc: DeslocConfig = DeslocConfig()
    noloco: NolocoConfig = NolocoConfig()
    parallel: ParallelConfig = ParallelConfig()
    train: TrainConfig = TrainConfig()
    sim: SimConfig = SimConfig()
    log: LogConfig = LogConfig()
    serve: ServeConfig = ServeConfig()
    syncer: SyncerConfig = SyncerConfig()
