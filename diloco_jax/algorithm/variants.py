"""DiLoCo's variant arguments and the one place where they are checked, alone and together:
:class:`Streaming` (fragments, overlap, mix) and :func:`check_options` (every argument of
:func:`~diloco_jax.diloco` that selects a piece)."""

from __future__ import annotations

from typing import NamedTuple

from diloco_jax.algorithm import compress, dct, gossip, moments, robust
from diloco_jax.algorithm.options import require
from diloco_jax.algorithm.plan import SyncPlan
from diloco_jax.algorithm.timing import OUTER_MODES


class Streaming(NamedTuple):
    """Streaming DiLoCo (Douillard et al., 2025, arXiv 2501.18512), the ``streaming`` of
    :func:`~diloco_jax.diloco`. ``Streaming()`` is plain DiLoCo.

    Args:
      fragments: the parameters are split into F fragments, which sync in turn, one every
        ``sync_every / F`` steps (F must divide ``sync_every``).
      overlap: tau, inner steps between a fragment's sync and its landing, while training
        goes on (``< sync_every / F``; 0: at once).
      mix: alpha, in ``[0, 1)``: the local parameters' weight when the merged fragment lands
        (0: the replica takes the merged value).
    """

    fragments: int = 1
    overlap: int = 0
    mix: float = 0.0


_STREAMING = "streaming ({streaming.fragments} > 1 or {streaming.overlap} > 0)"


def check_options(
    *,
    sync_every: int,
    streaming: Streaming | None = None,
    outer_mode: str = "sync",
    codec: compress.Codec | None = None,
    dct_config: dct.DctConfig | None = None,
    reset_inner_state: bool = False,
    moment_sync: moments.MomentSync | None = None,
    gossip_config: gossip.Gossip | None = None,
    late_merge: bool = False,
    merge: robust.Merge | None = None,
    attack: robust.Attack | None = None,
) -> None:
    """The one place where :func:`~diloco_jax.diloco`'s arguments are checked, each alone and
    together: :func:`~diloco_jax.diloco` calls it; call it yourself to check a setting before
    building anything.

    Args:
      sync_every: as for :func:`~diloco_jax.diloco`.
      streaming: as for :func:`~diloco_jax.diloco`.
      outer_mode: as for :func:`~diloco_jax.diloco`.
      codec: as for :func:`~diloco_jax.diloco`.
      dct_config: as for :func:`~diloco_jax.diloco`.
      reset_inner_state: as for :func:`~diloco_jax.diloco`.
      moment_sync: as for :func:`~diloco_jax.diloco`.
      gossip_config: as for :func:`~diloco_jax.diloco`.
      late_merge: as for :func:`~diloco_jax.diloco`.
      merge: as for :func:`~diloco_jax.diloco`.
      attack: as for :func:`~diloco_jax.diloco`.

    Raises:
      OptionError: naming the first bad argument (the config layer maps the name to its key).
    """
    streaming = Streaming() if streaming is None else Streaming(*streaming)
    plan = SyncPlan(sync_every, streaming.fragments, streaming.overlap)
    plan.validate()
    require(0 <= streaming.mix < 1, "streaming.mix", streaming.mix, "must be in [0, 1)")
    require(outer_mode in OUTER_MODES, "outer_mode", outer_mode, f"must be one of {OUTER_MODES}")
    require(outer_mode == "sync" or not plan.streaming, "outer_mode", outer_mode,
            f"must be 'sync' with {_STREAMING}")  # fmt: skip
    require(not reset_inner_state or plan.fragments == 1, "reset_inner_state", reset_inner_state,
            "does not combine with {streaming.fragments} > 1")  # fmt: skip
    if codec is not None:
        compress.validate(codec)
    if dct_config is not None:
        require(codec is None or codec.name == "none", "dct_config", dct_config,
                "choose a codec or DCT momentum, not both")  # fmt: skip
        require(not plan.streaming, "dct_config", dct_config,
                f"DCT momentum does not combine with {_STREAMING}")  # fmt: skip
        dct.validate(dct_config)
    if moment_sync is not None:
        moments.validate(moments.MomentSync(*moment_sync), sync_every, reset_inner_state)
    if gossip_config is not None:
        gossip.validate(gossip_config)
        alone = (codec is None or codec.name == "none") and dct_config is None
        require(alone and not plan.streaming and outer_mode == "sync", "gossip", "noloco",
                "sends float32 to one partner at every sync: it does not combine with codecs, "
                f"DCT momentum, SparseLoCo, {_STREAMING} or {{outer_mode}} != 'sync'")  # fmt: skip
        require(moment_sync is None or not moments.MomentSync(*moment_sync).active, "gossip",
                "noloco", "has no all-reduce: it does not combine with DES-LOC's moment "
                "averages")  # fmt: skip
    if late_merge:
        require(not plan.streaming and outer_mode == "sync" and gossip_config is None,
                "late_merge", late_merge, "late replicas merge whole rounds into the all-"
                f"replica mean: it does not combine with {_STREAMING}, {{outer_mode}} != "
                "'sync' or NoLoCo")  # fmt: skip
        require(moment_sync is None or not moments.MomentSync(*moment_sync).active,
                "late_merge", late_merge, "leaves late replicas out of syncs: it does not "
                "combine with DES-LOC's moment averages")  # fmt: skip
    merge = robust.Merge() if merge is None else robust.Merge(*merge)
    robust.validate(merge)
    attack = robust.Attack() if attack is None else robust.Attack(*attack)
    robust.validate_attack(attack)
    plain = (codec is None or codec.name == "none") and dct_config is None
    plain = plain and gossip_config is None
    require(merge.plain or plain, "merge.rule", merge.rule,
            "merges float32 pseudo-gradients gathered from every replica: it does not combine "
            "with codecs, DCT momentum, SparseLoCo or NoLoCo yet")  # fmt: skip
    require(not attack.active or plain, "attack.kind", attack.kind,
            "replaces float32 pseudo-gradients gathered from every replica: it does not combine "
            "with codecs, DCT momentum, SparseLoCo or NoLoCo yet")  # fmt: skip
