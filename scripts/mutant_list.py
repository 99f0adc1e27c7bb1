"""The planted bugs of scripts/mutants.py: each a snippet of one source file, its replacement and
the tests that should fail on it. Add one here; ``uv run python scripts/mutants.py --list`` checks
that every snippet applies exactly once and every named test exists."""

from __future__ import annotations

from typing import NamedTuple

AREAS = ("algorithm", "variants", "runtime", "checkpoint", "data", "command line", "randomness",
         "faults")  # fmt: skip


class Mutant(NamedTuple):
    """A planted bug: ``old`` (exactly once in ``path``) replaced by ``new``; ``tests``: pytest
    paths or node ids that should fail on it."""

    name: str
    area: str
    path: str
    old: str
    new: str
    tests: list[str]


CORE = "diloco_jax/algorithm/core.py"
EXCHANGE = "diloco_jax/algorithm/exchange.py"
PLAN = "diloco_jax/algorithm/plan.py"
TIMING = "diloco_jax/algorithm/timing.py"
STEP = "diloco_jax/runtime/step.py"
COMMS = "diloco_jax/simulated/comms.py"
SCHEDULE = "diloco_jax/simulated/schedule.py"
RESUME = "diloco_jax/run/resume.py"
CORPUS = "diloco_jax/data/corpus.py"
VALIDATION = "diloco_jax/config/validation.py"
ROBUST = "diloco_jax/algorithm/robust.py"

T_SEC = "tests/test_syncer_security.py::"
T_ROBUST = "tests/test_robust.py::"
T_DISTRUST = "tests/test_syncer_robust.py::"
T_DILOCO = "tests/test_diloco.py::"
T_HAND = T_DILOCO + "test_hand_computed_quadratic_trajectory"
T_SIGN = T_DILOCO + "test_pseudo_gradient_sign_mean_over_replicas_only_and_outer_step_not_a_noop"
T_SYNCS = T_DILOCO + "test_syncs_happen_only_every_sync_every_steps"
T_NAN = T_DILOCO + "test_nan_replica_is_left_out_and_restarts_from_the_anchor"
T_MESH = "tests/test_parallel.py::test_mesh_equals_simulator"
T_OPT = "tests/test_user_optimizers.py::test_"
T_DROPOUT = "tests/test_randomness.py::test_a_loss_with_dropout_trains_the_same_on_every_layout"
T_PLAN = "tests/test_variants.py::test_streaming_schedule_by_hand_on_device_and_host"
T_STREAMING = "tests/test_variants.py::test_streaming_hand_computed"
T_DELAYED = "tests/test_variants.py::test_delayed_and_eager_hand_computed"
T_DROPPED = "tests/test_sim.py::test_dropped_replica_keeps_params_then_rejoins_from_anchor"
T_HOST_BATCHES = "tests/test_stream.py::test_host_batches_equal_the_device_sampler"

MUTANTS = [
    # the algorithm
    Mutant("outer step with the wrong sign", "algorithm", CORE,
           "optax.apply_updates(anchor, updates)",
           "optax.apply_updates(anchor, [-u for u in updates])", [T_HAND, T_SIGN]),
    Mutant("pseudo-gradient params - anchor (points downhill)", "algorithm", CORE,
           "delta = [a - p for a, p in zip(start, params, strict=True)]",
           "delta = [p - a for a, p in zip(start, params, strict=True)]",
           [T_HAND, T_SIGN]),
    Mutant("replica mean divided by the weights' sum, not their mean", "algorithm", EXCHANGE,
           "total_w = replica_mean(w, axis_name)", "total_w = replica_sum(w, axis_name)",
           [T_SIGN]),
    Mutant("Nesterov momentum dropped from the paper's outer optimizer", "algorithm",
           "diloco_jax/algorithm/optim.py",
           "return optax.sgd(learning_rate, momentum=momentum or None, "
           "nesterov=nesterov and momentum > 0)",
           "return optax.sgd(learning_rate, momentum=momentum or None, nesterov=False)", [T_SIGN]),
    Mutant("a sync leaves each replica on its own parameters (anchor not assigned)", "algorithm",
           CORE, "            target = a\n            if self.mix > 0:",
           "            target = p\n            if self.mix > 0:", [T_SYNCS]),
    Mutant("sync period off by one", "algorithm", PLAN, "return step % self.period == 0,",
           "return (step + 1) % self.period == 0,", [T_SYNCS, T_PLAN]),
    # variants
    Mutant("late replica's pseudo-gradient measured from the anchor, not its base", "variants",
           CORE, "start = [rnd.base[i] for i in idx] if self.late_merge else anchor",
           "start = anchor", ["tests/test_quorum.py::test_late_merge_matches_a_hand_computed_run"]),
    Mutant("error feedback keeps no residual", "variants", EXCHANGE,
           "residual = [jnp.where(w > 0, n, jnp.where(finite, e, 0.0))",
           "residual = [jnp.where(w > 0, 0.0 * n, jnp.where(finite, e, 0.0))",
           ["tests/test_compress.py::test_error_feedback_keeps_exactly_what_encoding_lost"]),
    Mutant("int8 scale is max abs / 128: the largest value clips", "variants",
           "diloco_jax/algorithm/compress.py", '_LEVELS = {"int8": 127.0,',
           '_LEVELS = {"int8": 128.0,', ["tests/test_compress.py::test_roundtrip_error_bounds"]),
    Mutant("streaming: the fragment that syncs is off by one", "variants", PLAN,
           "(step // self.period) % self.fragments", "(step // self.period + 1) % self.fragments",
           [T_PLAN, T_STREAMING]),
    Mutant("streaming: a fragment lands before its first sync started", "variants", PLAN,
           "started & (step > self.overlap)", "started & (step >= self.overlap)",
           [T_PLAN, T_STREAMING]),
    Mutant("delayed outer step applies this sync's mean", "variants", TIMING,
           "lambda mean, delta, w, st, total_w=None: (st.pending, DelayedState(mean)),",
           "lambda mean, delta, w, st, total_w=None: (mean, DelayedState(mean)),", [T_DELAYED]),
    Mutant("eager outer step keeps the stale share", "variants", TIMING,
           "applied = [m + s - old for m, s, old in", "applied = [m + s - 0 * old for m, s, old in",
           [T_DELAYED]),
    Mutant("DCT momentum keeps what it sent", "variants", EXCHANGE,
           "momentum = jnp.where(w > 0, kept, jnp.where(finite, momentum, 0.0))",
           "momentum = jnp.where(w > 0, update, jnp.where(finite, momentum, 0.0))",
           ["tests/test_variants.py::test_dct_momentum_keeps_the_rest_and_averages_what_was_sent"]),
    # runtime: the simulator, the mesh, the chunked simulator, byte accounting
    Mutant("replica mean over the virtual replicas of a device only", "runtime", EXCHANGE,
           "    for name in names(axis_name):\n        tree = lax.pmean(tree, name)",
           "    for name in names(axis_name)[:1]:\n        tree = lax.pmean(tree, name)", [T_MESH]),
    Mutant("a data split trains on half of each replica's batch", "runtime", STEP,
           "            batch = fsdp.rows(batch, data_axis)",
           "            batch = fsdp.rows(jax.tree.map(lambda x: x[: len(x) // 2], batch), "
           "data_axis)", [T_MESH]),
    Mutant("a replica samples the next replica's batch", "runtime", STEP,
           "shard, seed=seed, replica=replica, step=state.step, batch_size=batch_size",
           "shard, seed=seed, replica=replica + 1, step=state.step, batch_size=batch_size",
           [T_DILOCO + "test_inner_sgd_sync1_outer_sgd1_is_synchronous_data_parallel_sgd"]),
    Mutant("chunked simulator's sync counts one inner step more", "runtime",
           "diloco_jax/runtime/chunked.py", "state = state._replace(step=state.step - 1)",
           "state = state._replace(step=state.step)",
           ["tests/test_chunked.py::test_chunks_train_bitwise_what_all_at_once_trains"]),
    Mutant("ring all-reduce bytes without the all-gather half", "runtime", COMMS,
           "return 2 * (replicas - 1) / replicas * payload",
           "return (replicas - 1) / replicas * payload",
           ["tests/test_sim.py::test_payload_and_bytes_hand_computed"]),
    Mutant("ring all-reduce time without the all-gather half", "runtime", COMMS,
           "return 2 * (replicas - 1) * (latency + payload / replicas / bytes_per_s)",
           "return (replicas - 1) * (latency + payload / replicas / bytes_per_s)",
           ["tests/test_sim.py::test_reduce_time_hand_computed"]),
    Mutant("small float32 leaves counted at 2 bytes in a codec's payload", "runtime", COMMS,
           "small = sum(4 * leaf.size for leaf in leaves if leaf.size < min_size)",
           "small = sum(2 * leaf.size for leaf in leaves if leaf.size < min_size)",
           ["tests/test_compress.py::test_sync_payload_by_hand"]),
    Mutant("quorum sync bytes counted over every replica, late ones too", "runtime",
           "sim/accounting.py", "comms.bytes_per_replica(payload, int(m.sum()), sim.topology)",
           "comms.bytes_per_replica(payload, replicas, sim.topology)",
           ["tests/test_quorum.py::test_quorum_bytes_and_clock"]),
    # randomness
    Mutant("batch seed depends on the data split (layout-dependent key)", "randomness", STEP,
           "        seed = control.seed\n",
           "        seed = control.seed if data_axis is None else control.seed + 1\n",
           [T_MESH]),
    Mutant("dropout key folds in whether the batch is split (layout-dependent key)",
           "randomness", STEP, "state.step, replica, randomness.DROPOUT)",
           "state.step, replica, randomness.DROPOUT, int(data_axis is not None))",
           [T_DROPOUT]),
    Mutant("dropout key folds in the device's index (layout-dependent key)", "randomness",
           STEP, "state.step, replica, randomness.DROPOUT)",
           "state.step, replica, randomness.DROPOUT, lax.axis_index('replica'))", [T_DROPOUT]),
    Mutant("keys depend on the devices a process holds (layout-dependent key)", "randomness",
           "diloco_jax/base/randomness.py", "    for stream in streams:",
           "    key = jax.random.fold_in(key, jax.local_device_count())\n"
           "    for stream in streams:",
           ["tests/test_multiprocess.py::"
            "test_two_processes_equal_the_simulator"]),
    Mutant("batch key ignores the step (the same windows every step)", "randomness",
           "diloco_jax/base/randomness.py", "jax.random.fold_in(jax.random.key(seed), step)",
           "jax.random.fold_in(jax.random.key(seed), 0)",
           ["tests/test_data.py::test_batch_is_a_pure_function_of_seed_replica_step"]),
    # the user's optimizers
    Mutant("a given inner optimizer ignored (the config's trains)", "command line",
           "diloco_jax/config/recipe.py",
           "    if given.inner is not None:\n        return given.inner",
           "    if False:\n        return given.inner", [T_OPT + "an_import_path_trains_what_the_"
                                                         "given_transform_trains_and_both_resume"]),
    Mutant("a given optimizer not recorded (a resume with another one accepted)", "checkpoint",
           "diloco_jax/config/user_optimizers.py",
           "            cfg = dotted.override(cfg, key, GIVEN + "
           "check_on(tx, probe_params, key))",
           "            check_on(tx, probe_params, key)", [T_OPT + "an_import_path_trains_what_the_"
                                                       "given_transform_trains_and_both_resume"]),
    Mutant("the config's outer learning rate scales a user's outer optimizer too", "algorithm",
           "diloco_jax/config/recipe.py", "    return cfg.algorithm == \"diloco\" and builtin and",
           "    return cfg.algorithm == \"diloco\" and", [T_OPT + "given_transforms_equal_to_the_"
                                                     "configs_own_train_the_same_bits"]),
    # checkpoints
    Mutant("checkpoint saved without the outer state (zeros)", "checkpoint",
           "diloco_jax/runtime/checkpoint.py",
           "    items = {_STATE: _StateSave(state), _META: ocp.args.JsonSave(meta)}",
           "    kept = state._replace(outer_state=jax.tree.map(lambda x: x * 0, "
           "state.outer_state)) if hasattr(state, 'outer_state') else state\n"
           "    items = {_STATE: _StateSave(kept), _META: ocp.args.JsonSave(meta)}",
           ["tests/test_checkpoint.py::test_resume_from_a_middle_checkpoint_is_bitwise_identical"]),
    Mutant("resume drops the data pipelines' saved position", "checkpoint", RESUME,
           "restored.controls, restored.data)", "restored.controls, None)",
           ["tests/test_grain_task.py::test_fit_on_a_pipeline_learns_and_resumes_bitwise"]),
    Mutant("resume accepts one changed training key (refuses only two)", "checkpoint", RESUME,
           "if locked and not allow_change:", "if len(locked) > 1 and not allow_change:",
           ["tests/test_checkpoint.py::"
            "test_changed_training_key_stops_with_one_line_exit_2_and_changes_nothing"]),
    Mutant("elastic restart drops the saved anchor, outer state and step", "checkpoint", RESUME,
           "state = state_lib.replace_shared(fresh, kinds, old)", "state = fresh",
           ["tests/test_checkpoint.py::test_elastic_restart_keeps_anchor_and_outer_state"]),
    # faults: non-finite replicas, simulated stragglers and failures, quorum and grace
    Mutant("NaN guard dropped: a NaN replica is averaged in", "faults", CORE,
           "finite = jnp.isfinite(optax.tree.norm(delta))",
           "finite = jnp.isfinite(optax.tree.norm(delta)) | True", [T_NAN]),
    Mutant("a left-out replica weighted by multiplying (0 * NaN = NaN)", "faults", EXCHANGE,
           "return [jnp.where(w > 0, w * d, 0.0) for d in delta]", "return [w * d for d in delta]",
           [T_NAN]),
    Mutant("a NaN replica restarts with its broken inner state", "faults", CORE,
           "reset = restart if self.reset_inner_state else bad",
           "reset = restart if self.reset_inner_state else jnp.zeros([], bool)", [T_NAN]),
    Mutant("failure span r:a-b drops the replica at outer step b too", "faults", SCHEDULE,
           "if a <= outer_step < b:", "if a <= outer_step <= b:", [T_DROPPED]),
    Mutant("a rejoining replica's stale pseudo-gradient is averaged in", "faults", SCHEDULE,
           "weight[i] = weight_R * (up & was_up)", "weight[i] = weight_R * up", [T_DROPPED]),
    Mutant("DyLU rounds a slow replica's steps up", "faults", SCHEDULE,
           "np.floor(sync_every * speeds / speeds.max() + 1e-9)",
           "np.ceil(sync_every * speeds / speeds.max() + 1e-9)",
           ["tests/test_sim.py::test_dylu_steps_and_masks"]),
    Mutant("quorum: a late replica weighs one round, not its tokens", "faults", SCHEDULE,
           "out.weight[k] = np.where(merged_R, done_R / H, 0.0)",
           "out.weight[k] = np.where(merged_R, 1.0, 0.0)",
           ["tests/test_quorum.py::test_a_slow_replica_is_late_then_merges_its_two_rounds",
            "tests/test_quorum.py::test_masks_are_a_pure_function_of_the_step"]),
    Mutant("quorum: grace counted in steps, not rounds", "faults", SCHEDULE,
           "wall = min(arrive_R.max(), ready + grace * H)",
           "wall = min(arrive_R.max(), ready + grace)",
           ["tests/test_quorum.py::test_grace_admits_a_replica_that_arrives_within_the_window"]),
    # data
    Mutant("validation split overlaps the training split by one token", "data",
           "diloco_jax/data/sources.py",
           "return Corpus(tokens[:-num_val], tokens[-num_val:], str(path))",
           "return Corpus(tokens[:-num_val], tokens[-num_val - 1 :], str(path))",
           ["tests/test_data.py::test_shipped_corpus",
            "tests/test_data.py::test_local_text_file_and_too_small"]),
    Mutant("device sampler's windows start one token late", "data", CORPUS,
           "idx_BxL1 = starts_B[:, None] + jnp.arange(",
           "idx_BxL1 = starts_B[:, None] + 1 + jnp.arange(", [T_HOST_BATCHES]),
    Mutant("streamed (host) windows start one token late", "data", "diloco_jax/data/stream.py",
           "cols = starts[..., None] + np.arange(self.seq_len + 1, dtype=np.int64)",
           "cols = starts[..., None] + np.arange(1, self.seq_len + 2, dtype=np.int64)",
           [T_HOST_BATCHES]),
    Mutant("evaluation windows start one token late", "data", CORPUS,
           "val_M[s : s + seq_len + 1] for s in starts",
           "val_M[s + 1 : s + seq_len + 2] for s in starts",
           ["tests/test_data.py::test_eval_windows_spread_over_validation"]),
    Mutant("TFDS evaluation reads the training split", "data", "diloco_jax/data/tfds_io.py",
           "split=[train_split, eval_split]", "split=[train_split, train_split]",
           ["tests/test_datasets.py::test_prepared_dataset_reads_back_as_the_exact_text"]),
    # command lines and config validation
    Mutant("validation: checkpoint_every need not be a multiple of log_every", "command line",
           VALIDATION, "t.checkpoint_every % t.log_every == 0,",
           "t.checkpoint_every % t.log_every >= 0,",
           ["tests/test_config.py::test_validate_names_key_value_and_rule"]),
    Mutant("validation: sim.drop_prob = 1 accepted", "command line", VALIDATION,
           '("sim.drop_prob", 0 <= sim.drop_prob < 1,',
           '("sim.drop_prob", 0 <= sim.drop_prob <= 1,',
           ["tests/test_sim.py::test_sim_config_errors"]),
    Mutant("override parser reads 'false' as true", "command line", "diloco_jax/config/dotted.py",
           'if lowered in ("1", "true", "yes", "on"):',
           'if lowered in ("1", "true", "yes", "on", "false"):',
           ["tests/test_config.py::test_overrides_parse_by_field_type"]),
    Mutant("command-line parser drops the last argument", "command line",
           "diloco_jax/base/commandline.py",
           "args = sys.argv[1:] if args is None else list(args)",
           "args = sys.argv[1:] if args is None else list(args)[:-1]",
           ["tests/test_config.py::test_overrides_on_the_command_line_equal_apply_overrides"]),
    # what the tests moved to the slow set or merged (issue 38) caught: the default suite's
    # stand-ins must still catch it (docs/testing.md's table)
    Mutant("the command skips the CPU split (parallel.cpu_devices ignored)", "runtime",
           "diloco_jax/run/placement.py", "parallel.split_cpu(p.cpu_devices, auto=auto)",
           "parallel.split_cpu(0, auto=1)", ["tests/test_cpu_devices.py"]),
    Mutant("DES-LOC averages the second moments on the first moments' period", "variants",
           "diloco_jax/algorithm/moments.py",
           '(("first", ms.first_every), ("second", ms.second_every))',
           '(("first", ms.first_every), ("second", ms.first_every))',
           ["tests/test_desloc.py::test_first_moments_averaged_without_second_ones_can_blow_up_"
            "sparse_rows"]),
    Mutant("a kept traced program is never loaded", "runtime",
           "diloco_jax/runtime/compile_cache.py",
           'if entry.get("format") != _FORMAT:\n            return None',
           'if True:\n            return None',
           ["tests/test_compile_cache.py", "tests/test_program_cache.py"]),
    Mutant("cache hits counted over every thread (a compiled step looks loaded)", "runtime",
           "diloco_jax/runtime/compile_cache.py", "    return _hits[threading.get_ident()]",
           "    return sum(_hits.values())",
           ["tests/test_compile_cache.py::test_a_load_is_counted_on_the_thread_that_loads"]),
    Mutant("the persistent compilation cache is never turned on", "runtime",
           "diloco_jax/runtime/compile_cache.py",
           "    path = directory(configured)\n    if path is None:",
           "    path = None\n    if path is None:", ["tests/test_compile_cache.py"]),
    Mutant("a sweep's server never shows a run as done", "runtime", "sim/sweep.py",
           "            server.sweep.finished(name, rows[-1])", "            pass",
           ["tests/test_sim.py::test_the_sweep_command_around_faked_runs_serves_tables_and_reruns_nothing"]),
    Mutant("a shape-changing key declared free of the kept program", "runtime",
           "diloco_jax/run/programs.py", '    "seed",  # an input of the step',
           '    "seed", "data.batch_size",  # an input of the step',
           ["tests/test_program_cache.py"]),
    Mutant("streamed images drawn one step ahead", "data", "diloco_jax/data/stream.py",
           '"""int32 ``[N, len(replicas), B]``: the examples of ``num_steps`` steps."""\n'
           "        steps = np.arange(first_step,",
           '"""int32 ``[N, len(replicas), B]``: the examples of ``num_steps`` steps."""\n'
           "        steps = 1 + np.arange(first_step,",
           ["tests/test_tfds_images.py::test_host_image_batches_equal_the_device_sampler"]),
    Mutant("a warm run reads every executable from disk (the in-process memory never used)",
           "runtime", "diloco_jax/runtime/compile_cache.py", "    keep_loaded()\n    return path",
           "    return path",
           ["tests/test_compile_cache.py::test_an_executable_read_again_comes_from_memory_and_a_"
            "changed_program_does_not"]),
    Mutant("a rewritten compressed corpus is served from memory", "data", CORPUS,
           "key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)",
           "key = (str(path.resolve()), 0, 0)",
           ["tests/test_data.py::test_a_rewritten_compressed_file_is_read_anew"]),
    Mutant("models that differ in a value's type share one traced initialisation", "runtime",
           "diloco_jax/tasks/model.py", "return tuple((k, type(v).__name__, v) for k, v in",
           "return tuple((k, v) for k, v in",
           ["tests/test_model.py::test_equal_models_share_one_trace_and_each_call_gets_its_own_"
            "arrays"]),
    Mutant("every learner trains on learner 0's data", "faults", "diloco_jax/run/setup.py",
           "first, everyone = cfg.syncer.learner * replicas,",
           "first, everyone = 0 * replicas,",
           ["tests/test_learners.py::test_a_learners_data_is_its_part_of_every_learners",
            "tests/test_learners.py::test_two_learners_of_one_replica_train_what_the_mesh_trains_"
            "with_two"]),
    Mutant("the syncer merges a push that is not finite", "faults",
           "diloco_jax/learners/syncer.py",
           "        finite = all(bool(np.isfinite(x).all()) for x in leaves)",
           "        finite = True",
           ["tests/test_learners.py::test_the_syncer_refuses_what_does_not_fit_and_leaves_a_bad_"
            "push_out"]),
    Mutant("the syncer merges a stale push", "faults", "diloco_jax/learners/syncer.py",
           "        if late and (not self.quorum or late > self.max_late):",
           "        if False:",
           ["tests/test_learners.py::test_the_syncer_refuses_what_does_not_fit_and_leaves_a_bad_"
            "push_out"]),
    Mutant("the syncer takes any credential", "command line", "diloco_jax/learners/identity.py",
           "    return who if hmac.compare_digest(credential.encode(), want.encode()) else None",
           "    return who",
           ["tests/test_learners.py::test_over_grpc_a_wrong_token_is_unauthenticated_and_changes_"
            "nothing"]),
    Mutant("a learner never restarts from the syncer's anchor", "faults",
           "diloco_jax/run/loop.py",
           "        return learner.sync(state, last=last), True",
           "        return learner.sync(state, last=last) and state, True",
           ["tests/test_learners.py::test_a_learner_in_this_process_trains_what_one_replica_"
            "trains"]),
    Mutant("a quorum round closes at its quorum, without the grace window", "faults",
           "diloco_jax/learners/syncer.py",
           "        elif self._quorum_at is not None and now >= self._quorum_at + self._grace_now:",
           "        elif self._quorum_at is not None:",
           ["tests/test_learners.py::test_quorum_rounds_wait_the_grace_then_merge_a_late_push_by_"
            "its_weight"]),
    Mutant("a late push counts towards the quorum of the round it joins", "faults",
           "diloco_jax/learners/syncer.py", "sum(not p.late for p in self.pending.values())",
           "len(self.pending)",
           ["tests/test_learners.py::test_quorum_rounds_wait_the_grace_then_merge_a_late_push_by_"
            "its_weight"]),
    Mutant("a late learner goes on from the open round's anchor at once", "faults",
           "diloco_jax/learners/service.py", "        joined = base + late",
           "        joined = base",
           ["tests/test_learners.py::test_over_grpc_a_late_learner_waits_for_the_round_its_push_"
            "joined"]),
    Mutant("a late push enters the merge with no weight", "faults",
           "diloco_jax/learners/syncer.py",
           "Push(generation, float(weight), leaves, finite, late,",
           "Push(generation, float(weight) * (late == 0), leaves, finite, late,",
           ["tests/test_learners.py::test_quorum_rounds_wait_the_grace_then_merge_a_late_push_by_"
            "its_weight"]),
    Mutant("a learner joining mid-round is handed the open round's anchor", "faults",
           "diloco_jax/learners/syncer.py",
           "            waits = bool(self.pending) and learner not in self.expected",
           "            waits = False",
           ["tests/test_learners.py::test_a_learner_joining_while_a_round_is_open_joins_the_next_"
            "round"]),
    Mutant("a synchronous run's first round leaves out declared learners not yet joined",
           "faults", "diloco_jax/learners/syncer.py",
           "                    self.expected |= set(range(self.learners)) - self.removed",
           "                    pass",
           ["tests/test_learners.py::test_a_learner_joining_while_a_round_is_open_joins_the_next_"
            "round"]),
    Mutant("a restarted syncer forgets its members", "faults", "diloco_jax/learners/keeping.py",
           '        for i, generation in meta.get("members", {}).items():',
           "        for i, generation in {}.items():",
           ["tests/test_learners.py::test_four_learners_through_a_syncer_equal_four_replicas_of_"
            "the_core"]),
    Mutant("a learner trains on after the syncer's last round", "faults",
           "diloco_jax/run/loop.py", "    return r.learner is not None and r.learner.finished",
           "    return False",
           ["tests/test_learners.py::test_a_learner_ends_when_the_syncer_closes_the_runs_last_"
            "round"]),
    Mutant("a learner's push ignores the codec and travels in float32", "faults",
           "diloco_jax/learners/learner.py",
           "payload.encode(names, mean, self.codec, replicas)",
           "payload.encode(names, mean, None, replicas)",
           ["tests/test_learners.py::test_a_learners_push_travels_through_its_codec"]),
    Mutant("streaming learners sync their fragments in another order than the simulator",
           "variants", PLAN, "return self.starting((rnd + 1) * self.period)[1]",
           "return self.starting(rnd * self.period)[1]",
           ["tests/test_learners.py::test_streaming_learners_through_a_syncer_equal_the_cores_"
            "streaming_replicas"]),
    Mutant("the syncer leaves a streaming fragment's outer state where it was (no momentum)",
           "variants", "diloco_jax/learners/keeping.py",
           "outer = tuple(outer if f == fragment else s for f, s in enumerate(self.outer_state))",
           "outer = self.outer_state",
           ["tests/test_learners.py::test_streaming_learners_through_a_syncer_equal_the_cores_"
            "streaming_replicas"]),
    Mutant("a streaming learner lands every fragment from the anchor at each sync", "variants",
           CORE, "landing = range(fragment, fragment + 1)", "landing = range(len(groups))",
           ["tests/test_learners.py::test_streaming_learners_through_a_syncer_equal_the_cores_"
            "streaming_replicas"]),
    Mutant("the syncer accepts a top-k push with a position sent twice", "faults",
           "diloco_jax/learners/payload.py",
           "        if np.unique(positions).size != positions.size:",
           "        if False:",
           ["tests/test_learners.py::test_a_push_travels_through_the_cores_codec_and_costs_the_"
            "simulators_payload"]),
    Mutant("an overlapped learner restarts from its own anchor, never the syncer's answer",
           "faults", "diloco_jax/learners/learner.py",
           "            state = self._land(state, previous.result(), start)",
           "            state = self._restart(state, state.anchor)",
           ["tests/test_learners.py::test_a_learner_in_this_process_trains_what_one_replica_"
            "trains"]),
    Mutant("an overlapped learner pushes every round for the same round", "faults",
           "diloco_jax/learners/learner.py",
           "        self.round = int(f[\"round\"]) + (self._inflight is not None)",
           "        self.round = int(f[\"round\"])",
           ["tests/test_learners.py::test_a_learner_in_this_process_trains_what_one_replica_"
            "trains"]),
    Mutant("a thin round takes the whole outer step", "faults", "diloco_jax/learners/keeping.py",
           "                share = np.float32(total_w / full)",
           "                share = np.float32(1.0)",
           ["tests/test_learners.py::test_weighed_rounds_move_the_anchor_by_the_examples_"
            "merged"]),
    Mutant("a learner's other processes restart from their own anchor", "faults",
           "diloco_jax/learners/learner.py",
           "        return reply, {n: np.asarray(a) for n, a in arrays.items()}",
           "        return reply, {n: np.asarray(a) for n, a in (arrays if self.lead else like)"
           ".items()}",
           ["tests/test_learners.py::test_a_learner_of_two_processes_trains_what_two_replicas_"
            "train"]),
    Mutant("a late push's merge weight ignores syncer.late_weight", "faults",
           "diloco_jax/learners/rounds.py", "return [w * late_weight**k for w, k in zip(",
           "return [w for w, k in zip(",
           ["tests/test_learners.py::test_quorum_rounds_wait_the_grace_then_merge_a_late_push_by_"
            "its_weight"]),
    Mutant("a learner's streamed batches are drawn as replicas 0.., not its own", "data",
           "diloco_jax/data/stream.py",
           "np.asarray(replicas, np.int32) + np.int32(self.first_replica),",
           "np.asarray(replicas, np.int32),",
           ["tests/test_learners.py::test_a_learners_streamed_data_is_its_part_of_every_"
            "learners"]),
    Mutant("an eager learner's share is of its own replicas' mean, not every learner's", "faults",
           "diloco_jax/algorithm/core.py",
           "        total_w = exchange.replica_sum(w, self.axis_name) * learners",
           "        total_w = exchange.replica_sum(w, self.axis_name)",
           ["tests/test_learners.py::test_four_learners_through_a_syncer_equal_four_replicas_of_"
            "the_core"]),
    Mutant("an eager learner applies the mean of two rounds before", "faults",
           "diloco_jax/algorithm/core.py",
           "            timing_state = timing_state._replace(pending=mean)", "            pass",
           ["tests/test_learners.py::test_four_learners_through_a_syncer_equal_four_replicas_of_"
            "the_core"]),
    Mutant("an eager syncer answers with the anchor, not the round's mean", "faults",
           "diloco_jax/learners/syncer.py",
           "            if not self.answer_mean:\n                return self.round",
           "            if True:\n                return self.round",
           ["tests/test_learners.py::test_four_learners_through_a_syncer_equal_four_replicas_of_"
            "the_core"]),
    Mutant("an FSDP learner pushes its first device's slice of the anchor", "faults",
           "diloco_jax/learners/learner.py",
           "        anchor = state.anchor if self._whole is None else self._whole(state.anchor)",
           "        anchor = state.anchor",
           ["tests/test_learners.py::test_a_learner_in_this_process_trains_what_one_replica_"
            "trains"]),
    Mutant("a learner's grain pipelines are replicas 0.., not its own", "data",
           "diloco_jax/tasks/pipeline.py",
           "            it = _open(self.pipeline, self.first_replica + replica, self.pipelines,",
           "            it = _open(self.pipeline, replica, self.pipelines,",
           ["tests/test_learners.py::test_a_learners_grain_pipelines_are_its_replicas_of_every_"
            "learners"]),
    Mutant("the syncer merges a copy of a push already merged", "faults",
           "diloco_jax/learners/ledger.py", "        done = self.records.get(push_id)",
           "        done = None",
           [T_SEC + "test_a_push_is_merged_once_whatever_the_copies_and_a_forged_one_is_refused",
            T_SEC + "test_over_grpc_a_retried_push_is_answered_again_not_merged_again"]),
    Mutant("a different push for a taken slot replaces the first", "faults",
           "diloco_jax/learners/syncer.py", "            if taken:", "            if False:",
           [T_SEC + "test_a_push_is_merged_once_whatever_the_copies_and_a_forged_one_is_refused"]),
    Mutant("a learner's credential acts as any learner", "command line",
           "diloco_jax/learners/service.py",
           "        if who != identity.Identity(identity.LEARNER, learner):",
           "        if who.kind != identity.LEARNER:",
           [T_SEC + "test_a_learners_credential_acts_only_as_itself"]),
    Mutant("mutual TLS does not compare the certificate's name", "command line",
           "diloco_jax/learners/service.py",
           "            if [n.decode() for n in names] != [want]:",
           "            if False:",
           [T_SEC + "test_a_learners_credential_acts_only_as_itself"]),
    Mutant("a push's dtypes are not checked", "faults", "diloco_jax/learners/payload.py",
           "        if got[name][1] not in _float_dtypes(dtype):", "        if False:",
           [T_SEC + "test_a_push_of_another_dtype_or_size_is_refused_before_its_data_is_read"]),
    Mutant("a push's header is not checked before its data is read", "faults",
           "diloco_jax/learners/syncer.py", "            if leaves is not None:",
           "            if False:",
           [T_SEC + "test_a_push_of_another_dtype_or_size_is_refused_before_its_data_is_read"]),
    Mutant("a damaged newest syncer checkpoint stops the syncer", "checkpoint",
           "diloco_jax/learners/store.py",
           "        return checkpoint.newest_readable(self.mngr, read, report, "
           "fatal=(checkpoint.SchemaError,))",
           "        return checkpoint.newest_readable(self.mngr, read, report, fatal=(Exception,))",
           [T_SEC + "test_a_damaged_newest_checkpoint_falls_back_to_the_round_before"]),
    Mutant("a partitioned learner is not admitted again", "faults",
           "diloco_jax/learners/syncer.py",
           "        if (member.status == \"dropped\" and self.quorum",
           "        if (False and self.quorum",
           [T_SEC + "test_a_partitioned_learner_is_admitted_again_under_a_quorum"]),
    Mutant("the round's checkpoint is written under the lock", "faults",
           "diloco_jax/learners/keeping.py", "    background = True", "    background = False",
           [T_SEC + "test_heartbeats_and_status_are_answered_while_a_round_is_written"]),
    Mutant("every failed authentication is a line in the log", "command line",
           "diloco_jax/learners/identity.py",
           "            due = n & (n - 1) == 0  # 1, 2, 4, 8, ...",
           "            due = True",
           [T_SEC + "test_failed_authentication_is_refused_at_once_and_logged_in_counted_lines"]),
    Mutant("the syncer listens in clear off loopback", "command line",
           "diloco_jax/learners/service.py",
           "        if tls is None and not is_loopback(host) and not insecure:",
           "        if False:",
           [T_SEC + "test_the_syncer_refuses_to_listen_in_clear_off_loopback"]),
    Mutant("the status page takes a learner's credential", "command line",
           "diloco_jax/learners/answering.py",
           "            if who is None or who.kind != identity.OPERATOR:",
           "            if who is None:",
           ["tests/test_learners.py::test_the_status_page_and_metrics_show_the_learners_and_"
            "rounds"]),
]  # fmt: skip

# sampling by definition on every data path (issue 54, item 15: tests/test_sampling.py): (a)
# replicas and steps draw independently, (b) only from their own shard, (c) no window past its
# shard's end (and every start drawn), (d) one batch per (seed, replica, step) on every layout
T_SAMPLING = "tests/test_sampling.py::"
T_ARRAYS = T_SAMPLING + "test_arrays_rows_come_from_their_own_shard_independently"
T_WINDOWS = T_SAMPLING + "test_corpus_windows_stay_in_their_shard_and_reach_its_end"
T_LAYOUTS = T_SAMPLING + "test_the_step_trains_on_one_batch_per_seed_replica_step_on_every_layout"
T_STREAMED = T_SAMPLING + "test_streamed_windows_stay_in_their_shard_and_reach_its_end"
T_STREAMED_D = T_SAMPLING + "test_streamed_batches_are_the_steps_batches_whatever_reads_them"
T_GRAIN = T_SAMPLING + "test_grain_replicas_read_their_own_shard_independently_each_epoch"
T_GRAIN_D = T_SAMPLING + "test_grain_batches_are_the_same_on_every_layout_and_resume"
ARRAYS = "diloco_jax/tasks/arrays.py"
STREAM = "diloco_jax/data/stream.py"
PIPELINE = "diloco_jax/tasks/pipeline.py"

MUTANTS += [
    # arrays (ArrayTask)
    Mutant("an ArrayTask replica draws replica 0's rows of its shard (replica not in the key)",
           "data", ARRAYS, "example_indices(seed=seed, replica=replica, step=step,",
           "example_indices(seed=seed, replica=0, step=step,", [T_ARRAYS]),
    Mutant("an ArrayTask replica draws the same rows at every step (step not in the key)",
           "data", ARRAYS, "example_indices(seed=seed, replica=replica, step=step,",
           "example_indices(seed=seed, replica=replica, step=0,", [T_ARRAYS]),
    Mutant("ArrayTask shards interleaved, not contiguous", "data", ARRAYS,
           "x[:keep].reshape(replicas, per_replica, *x.shape[1:])",
           "x[:keep].reshape(per_replica, replicas, *x.shape[1:]).swapaxes(0, 1)",
           [T_ARRAYS, T_LAYOUTS]),
    # arrays and corpus windows in the compiled step
    Mutant("the batch key folds in the device's index (layout-dependent batches)", "randomness",
           STEP, "shard, seed=seed, replica=replica, step=state.step, batch_size=batch_size",
           "shard, seed=seed, replica=replica + lax.axis_index('replica'), step=state.step, "
           "batch_size=batch_size", [T_LAYOUTS]),
    # corpus windows
    Mutant("a replica's windows start where replica 0's do (replica not in the key)", "data",
           CORPUS, "key = replica_key(seed, step, replica)", "key = replica_key(seed, step, 0)",
           [T_WINDOWS]),
    Mutant("corpus shards interleaved, not contiguous", "data", CORPUS,
           "return train_N[: replicas * shard_len].reshape(replicas, shard_len)",
           "return train_N[: replicas * shard_len].reshape(shard_len, replicas).T",
           [T_WINDOWS]),
    Mutant("a window may run past its shard's end (one start too many)", "data", CORPUS,
           "0, shard_len - seq_len, dtype=jnp.int32)",
           "0, shard_len - seq_len + 1, dtype=jnp.int32)", [T_WINDOWS]),
    Mutant("windows never reach their shard's end (one start too few)", "data", CORPUS,
           "0, shard_len - seq_len, dtype=jnp.int32)",
           "0, shard_len - seq_len - 1, dtype=jnp.int32)", [T_WINDOWS]),
    # the streamed corpus
    Mutant("streamed windows drawn as the first replica's for every replica", "data", STREAM,
           "np.asarray(replicas, np.int32) + np.int32(self.first_replica),",
           "np.zeros(len(replicas), np.int32) + np.int32(self.first_replica),", [T_STREAMED]),
    Mutant("a process's streamed windows read from shards 0.., not its replicas'", "data",
           STREAM, "rows = np.asarray(replicas, dtype=np.int64)[None, :, None, None]",
           "rows = np.arange(len(replicas))[None, :, None, None]", [T_STREAMED]),
    Mutant("streamed windows drawn as if each shard were a token longer", "data", STREAM,
           "shard_len=self.shards_RxS.shape[1],", "shard_len=self.shards_RxS.shape[1] + 1,",
           [T_STREAMED]),
    Mutant("every streamed call draws the first call's steps", "data", STREAM,
           '``first_step``, computed on the host CPU (compiled once per shape)."""\n'
           "        steps = np.arange(first_step, first_step + self.num_steps, dtype=np.int32)",
           '``first_step``, computed on the host CPU (compiled once per shape)."""\n'
           "        steps = np.arange(0, self.num_steps, dtype=np.int32)", [T_STREAMED_D]),
    Mutant("each device reads the first replicas' batches, not its own", "data", STREAM,
           "replicas = range(*index[1].indices(shape.shape[1]))",
           "replicas = range(len(range(*index[1].indices(shape.shape[1]))))",
           [T_STREAMED_D, T_GRAIN_D]),
    # grain
    Mutant("grain replicas shuffle alike (the same offsets of their shards every step)", "data",
           PIPELINE, "own_seed = int(np.random.SeedSequence((seed, replica)).generate_state(1)[0])",
           "own_seed = seed", [T_GRAIN]),
    Mutant("a grain replica reads the dataset from its index on (shards overlap)", "data",
           PIPELINE, "shard = dataset[replica::replicas]", "shard = dataset[replica:]",
           [T_GRAIN]),
    Mutant("a restored grain pipeline starts from its first batch", "data", PIPELINE,
           "            if self.position and self._saved is not None:", "            if False:",
           [T_GRAIN_D]),
]  # fmt: skip

# the emulated link of the bench (issue 55, item 1: tests/test_link.py), checked against its own
# definition: B bytes take B / bandwidth + latency, each direction on its own
LINK = "sim/link.py"
T_LINK = "tests/test_link.py::"
T_TRANSFER = (T_LINK + "test_bytes_take_their_size_over_the_bandwidth_plus_the_latency_each_way_"
              "on_its_own")  # fmt: skip
T_SMALL = (T_LINK + "test_a_small_message_takes_the_latency_each_way_and_a_new_connection_a_"
           "round_trip_more")  # fmt: skip
T_JITTER = T_LINK + "test_jitter_is_a_function_of_its_seed_and_never_reorders"
T_OUTAGE = (T_LINK + "test_an_outage_resets_open_connections_refuses_new_ones_then_the_link_"
            "works_again")  # fmt: skip

MUTANTS += [
    Mutant("a link sends each chunk as it comes, not queued behind the bytes before it",
           "runtime", LINK, "self.free_at = max(now, self.free_at) + send_s",
           "self.free_at = now + send_s", [T_TRANSFER]),
    Mutant("both directions of a link share one queue and the up direction's profile",
           "runtime", LINK, "self.up, self.down = Shaper(up, seed, UP), Shaper(down, seed, DOWN)",
           "self.up = self.down = Shaper(up, seed, UP)", [T_TRANSFER]),
    Mutant("a new connection's first bytes leave at once (no handshake's round trip)", "runtime",
           LINK, "now = max(time.monotonic(), self.conn.ready_at)", "now = time.monotonic()",
           [T_SMALL]),
    Mutant("a link's jitter drawn from an unseeded generator", "randomness", LINK,
           'self._rng = random.Random(f"{seed}:{direction}")', "self._rng = random.Random()",
           [T_JITTER]),
    Mutant("jitter lets a delivery come before the one before it", "randomness", LINK,
           "self.last = max(self.free_at + latency + u, self.last)",
           "self.last = self.free_at + latency + u", [T_JITTER]),
    Mutant("an outage leaves open connections up", "faults", LINK,
           "self.resets += self._cut_all()", "self.resets += 0", [T_OUTAGE]),
    Mutant("a link takes new connections during an outage", "faults", LINK,
           "return any(a <= t < b for a, b in self.outages)", "return False", [T_OUTAGE]),
    Mutant("a link's 100mbit read as 100 MB/s", "command line", LINK, '"mbit": 1e6 / 8',
           '"mbit": 1e6', [T_LINK + "test_the_command_line_reads_units_and_refuses_a_bad_value_"
                                   "in_one_line"]),
]  # fmt: skip

# compressed answers (issue 55, item 3: tests/test_answers.py): the anchor's change through the
# codec, the error kept on the syncer, the learners' anchor the same everywhere and restored
ANSWERS = "diloco_jax/learners/answers.py"
T_ANSWERS = "tests/test_answers.py::"
T_BOUND = (T_ANSWERS + "test_an_answer_decodes_to_the_anchor_within_the_codecs_bound_and_keeps_"
           "what_it_lost")  # fmt: skip
T_COPY = (T_ANSWERS + "test_a_copy_gets_the_same_bytes_a_joiner_the_learners_anchor_and_a_"
          "restart_keeps_it")  # fmt: skip
T_REBUILT = T_ANSWERS + "test_a_learner_restarts_from_the_rebuilt_anchor_and_receives_a_quarter"

MUTANTS += [
    Mutant("the syncer takes the true anchor for the learners' (the error is not kept)",
           "algorithm", ANSWERS,
           "    leaves = [plus(s, d) for s, d in zip(sent.leaves, decoded, strict=True)]",
           "    leaves = host", [T_BOUND, T_REBUILT]),
    Mutant("every answer is the learners' anchor whole, never the change", "variants", ANSWERS,
           "    if sent.delta is not None and holds == sent.round - 1:", "    if False:",
           [T_COPY, T_REBUILT]),
    Mutant("a learner does not say which round's anchor it holds", "faults", ANSWERS,
           '        return {} if self.codec is None or self.round is None else {"holds": '
           "self.round}", "        return {}", [T_REBUILT]),
    Mutant("a restarted syncer takes its anchor for the learners' (sent not restored)",
           "checkpoint", "diloco_jax/learners/keeping.py",
           '        if self.compress_answers and "sent" in saved:', "        if False:",
           [T_COPY]),
]  # fmt: skip

# the stale outer step's momentum (issue 55, item 5) and the replay of a link (item 6)
T_OVERLAP = "tests/test_outer.py::"
T_REPLAY = "tests/test_replay.py::"
MUTANTS += [
    Mutant("a delayed or eager step takes the synchronous momentum (0.9)", "algorithm",
           "diloco_jax/config/recipe.py", "    if o.mode not in OVERLAP_MOMENTUM:",
           "    if True:", [T_OVERLAP + "test_a_stale_outer_step_takes_the_overlap_momentum"]),
    Mutant("the replay forgets a push's way up the link", "runtime", "sim/replay.py",
           '                return self.at(self.now + self.pace.up_s, "arrive", i)',
           '                return self.at(self.now, "arrive", i)',
           [T_REPLAY + "test_a_link_adds_each_pushs_way_up_and_each_answers_way_down"]),
    Mutant("an overlapped learner in the replay never waits for its answer", "runtime",
           "sim/replay.py", "        if self.overlap and me.in_flight:",
           "        if False:",
           [T_REPLAY + "test_overlapped_rounds_wait_only_for_what_a_round_of_steps_does_not_"
            "hide"]),
]  # fmt: skip

# DCT momentum and SparseLoCo between learners (issue 55, item 4)
T_SPARSE = "tests/test_sparse_learners.py::"
MUTANTS += [
    Mutant("the syncer decodes a learner's messages to their sum, not their weighted mean",
           "algorithm", EXCHANGE,
           "    return _divide([dct.decode_sum(messages_R, config)], total_w)[0]",
           "    return dct.decode_sum(messages_R, config)",
           [T_SPARSE + "test_a_sparse_push_is_the_replicas_messages_and_decodes_to_the_cores_"
            "mean"]),
    Mutant("a learner's accumulator forgets what its replicas sent", "algorithm", CORE,
           "        state = state._replace(exchange_state=exchange_state, healthy=finite)",
           "        state = state._replace(healthy=finite)",
           [T_SPARSE + "test_learners_through_a_syncer_equal_the_cores_replicas"]),
    Mutant("the syncer takes a sparse push with a position sent twice in a chunk", "faults",
           "diloco_jax/learners/payload.py",
           "    if (ordered[..., 1:] == ordered[..., :-1]).any():", "    if False:",
           [T_SPARSE + "test_a_malformed_sparse_push_is_refused_by_name"]),
]  # fmt: skip
MUTANTS += [
    Mutant("the replay's streaming learner never waits for its answer tau steps on", "runtime",
           "sim/replay.py", "        if me.in_flight:\n            me.blocked_at = self.now",
           "        if False:\n            me.blocked_at = self.now",
           [T_REPLAY + "test_streamings_overlap_trains_tau_steps_while_a_push_travels"]),
    Mutant("a streaming learner lands its answer at once, not tau steps later", "variants",
           "diloco_jax/learners/learner.py",
           "        if self.plan.overlap and not last:  # Streaming DiLoCo's tau",
           "        if False:  # Streaming DiLoCo's tau",
           ["-m", "", "tests/test_learners.py::test_a_streaming_learner_in_this_process_trains_"
            "what_one_streaming_replica_trains"]),  # a slow test: -m "" runs it
]  # fmt: skip

# a syncer that stays up under abuse (issue 60): tests/test_syncer_abuse.py, tests/test_certs.py
T_ABUSE = "tests/test_syncer_abuse.py::"
T_NEVER = (
    T_ABUSE + "test_calls_that_never_end_hold_one_lane_of_their_learner_and_are_cancelled_when_idle"
)
T_CERTS = "tests/test_certs.py::"
GUARD = "diloco_jax/learners/guard.py"
SERVICE = "diloco_jax/learners/service.py"
MUTANTS += [
    Mutant("a learner may hold any number of calls at once", "faults", GUARD,
           "            if n >= self.limits[method]:", "            if False:", [T_NEVER]),
    Mutant("a call that sends nothing is never cancelled", "faults", GUARD,
           "            idle = [w for w in self.calls if w.idle() > self.limit]",
           "            idle = []",
           [T_NEVER, T_ABUSE + "test_a_stalled_push_is_cancelled_its_slot_freed_and_a_retry_"
            "merged_once"]),
    Mutant("a push may weigh more than its learner can train", "faults",
           "diloco_jax/learners/syncer.py",
           "        if cap is None or weight <= cap * (1 + 1e-6):", "        if True:",
           [T_DISTRUST + "test_a_weight_above_the_learners_capacity_is_capped_to_it_and_said_"
            "in_the_tape", T_ABUSE + "test_a_push_of_weight_zero_is_left_out_and_its_capacity_"
            "survives_a_restart"]),
    Mutant("a push's weight is not checked at its header", "faults", GUARD,
           "    if not math.isfinite(weight) or weight < 0:", "    if False:",
           [T_ABUSE + "test_guard_fields_and_lanes_by_definition"]),
    Mutant("a push id of any characters", "faults", GUARD,
           "    if not isinstance(push_id, str) or not PUSH_ID.fullmatch(push_id):",
           "    if not isinstance(push_id, str):",
           [T_ABUSE + "test_push_ids_and_fields_out_of_range_are_refused_in_one_line_without_"
            "forged_lines"]),
    Mutant("a caller's text goes into the log unescaped", "command line",
           "diloco_jax/learners/store.py", 'f"{k}={printable(v)}"', 'f"{k}={v}"',
           [T_ABUSE + "test_push_ids_and_fields_out_of_range_are_refused_in_one_line_without_"
            "forged_lines"]),
    Mutant("a join's size is checked against the model before its description", "faults",
           SERVICE, "        header, it = self._opened(requests, context, who)\n        try:\n"
           "            described,",
           "        header, it = self._opened(requests, context, who, max(1, sum(\n"
           "            a.nbytes for a in self.syncer.anchor or [])))\n        try:\n"
           "            described,",
           [T_ABUSE + "test_a_learner_of_another_width_is_refused_naming_its_first_"
            "differing_leaf"]),
    Mutant("a port taken is left to gRPC's C core to say", "command line", SERVICE,
           "            if _taken(host, port):", "            if False:",
           [T_ABUSE + "test_one_syncer_per_port_and_plain_http_on_it_writes_no_traceback"]),
    Mutant("a token beside the credentials folder is preferred to it", "command line",
           "diloco_jax/learners/credentials.py",
           "        if folder and given and not _agree(given, folder):",
           "        if folder and token_file and not _agree(given, folder):",
           [T_CERTS + "test_a_token_from_elsewhere_that_disagrees_with_the_folder_is_refused"]),
    Mutant("a party's own certificate is not checked for its dates", "command line",
           "diloco_jax/learners/certs.py", "    if tls.cert is not None:",
           "    if tls.cert is None:",
           [T_CERTS + "test_read_refuses_an_expired_or_early_certificate_and_warns_before"]),
    Mutant("the certs command's folders follow the umask", "command line",
           "diloco_jax/learners/certs.py",
           "    _folder(folder, PRIVATE_DIR)  # its key and token: the party's only",
           "    folder.mkdir(parents=True, exist_ok=True)",
           [T_CERTS + "test_certs_are_private_whatever_the_umask"]),
]  # fmt: skip
T_PAGE = "tests/test_status_abuse.py::"
STATUS = "diloco_jax/learners/status.py"
MUTANTS += [
    Mutant("the status page keeps idle connections past their deadline", "faults", STATUS,
           "                while self._waiting and next(iter(self._waiting)).deadline <= now:",
           "                while self._waiting and next(iter(self._waiting)).deadline <= now "
           "- 3600:",
           [T_PAGE + "test_idle_connections_hold_no_thread_and_are_closed_while_the_operator_"
            "gets_in"]),
    Mutant("the status page does not count wrong credentials", "command line",
           "diloco_jax/learners/answering.py",
           '                failures.failed(self.client_address[0], "a wrong credential on '
           'the status page")',
           "                pass",
           [T_PAGE + "test_wrong_credentials_are_counted_refused_at_once_and_logged_in_few_"
            "lines"]),
    Mutant("the status page under mutual TLS takes a client without a certificate",
           "command line", STATUS, "        context.verify_mode = ssl.CERT_REQUIRED",
           "        context.verify_mode = ssl.CERT_OPTIONAL",
           [T_PAGE + "test_under_mutual_tls_the_page_needs_the_operators_certificate_too"]),
    Mutant("the status page reads a request head of any size", "faults", STATUS,
           "MAX_HEAD = 8192  #", "MAX_HEAD = 1 << 20  #",
           [T_PAGE + "test_a_trickled_or_oversized_request_is_cut_off"]),
]  # fmt: skip
T_FIG = "tests/test_sweep_figures.py::"
DRAWING = "diloco_jax/watch/drawing.py"
MUTANTS += [  # issue 61, item 9: figures a reader can compare
    Mutant("drift and cosine drawn against outer steps", "command line", DRAWING,
           '    steps_S = np.array([e["step"] for e in events], float)',
           '    steps_S = np.array([e["outer_step"] for e in events], float)',
           [T_FIG + "test_a_sweeps_drift_and_cosine_share_inner_steps_across_sync_periods"]),
    Mutant("drift's log axis decided with its zeros in", "command line", DRAWING,
           "        log = key not in BOUNDED and log_scale(drawn[drawn != 0])",
           "        log = key not in BOUNDED and log_scale(drawn)",
           [T_FIG + "test_a_drift_spanning_a_decade_is_drawn_on_a_log_axis_without_its_zeros"]),
    Mutant("an undefined cosine drawn as 0", "command line", DRAWING,
           '        values_SxR = np.where(_rows(e["drift"] for e in events) == 0, np.nan, '
           "values_SxR)",
           "        values_SxR = np.nan_to_num(values_SxR)",
           [T_FIG + "test_an_undefined_cosine_is_a_gap_never_0"]),
    Mutant("tradeoff's loss axis linear over a decade", "command line", "sim/plots.py",
           "    if log_scale([row[y_key] for row in rows]):", "    if False:",
           [T_FIG + "test_tradeoffs_loss_axis_is_log_where_the_losses_span_a_decade"]),
]  # fmt: skip
MUTANTS += [  # issue 65: a damaged checkpoint is one line, no orbax read outlives its restore
    Mutant("orbax's reads left running on a closed loop after a failed restore", "checkpoint",
           "diloco_jax/runtime/checkpoint.py", "    with _settled():\n",
           "    with contextlib.nullcontext():\n",
           ["tests/test_damaged_checkpoint.py::test_a_damaged_syncer_checkpoint_is_one_line_and_"
            "nothing_after_it"]),
]  # fmt: skip
T_LAUNCH = "tests/test_launch_learners.py::"
MUTANTS += [  # issue 61, items 1-2: a learners' run a person can stop and resume
    Mutant("the launcher stops its syncer with its learners, not after them", "faults",
           "diloco_jax/run/local_learners.py",
           "        _send(self.learners, signal.SIGTERM)",
           "        _send([self.syncer, *self.learners], signal.SIGTERM)",
           [T_LAUNCH + "test_a_stop_lets_every_learner_save_before_the_syncer_stops"]),
    Mutant("a second Ctrl-C counts every step as lost, saved or not", "command line",
           "diloco_jax/run/local_learners.py",
           "            worst = max(worst, trained - saved)",
           "            worst = max(worst, trained)",
           [T_LAUNCH + "test_a_second_signal_kills_the_learners_and_says_what_they_lose"]),
    Mutant("a learner stops mid-round, not at its next sync", "faults", "diloco_jax/run/loop.py",
           "    while step < total and not _syncer_done(r) and not (between and "
           "agree_to_stop(stop)):",
           "    while step < total and not _syncer_done(r) and not agree_to_stop(stop):",
           [T_LAUNCH + "test_a_learner_signalled_mid_round_saves_at_its_next_sync"]),
]  # fmt: skip
T_PAGE2 = "tests/test_syncer_page.py::"
ANS = "diloco_jax/learners/answering.py"
MUTANTS += [  # issue 61, item 4: the syncer's page in a browser
    Mutant("a one-time link signs in again and again", "command line",
           "diloco_jax/learners/sessions.py", "            del self._links.expiry[key]",
           "            pass",
           [T_PAGE2 + "test_a_one_time_link_signs_in_once_and_not_after_it_expires"]),
    Mutant("a forged session cookie reads the syncer's page", "command line", ANS,
           "if given is None and session is not None and sessions.valid(session):",
           "if given is None and session is not None:",
           [T_PAGE2 + "test_a_forged_or_expired_cookie_is_refused_and_counted"]),
    Mutant("a push's training loss is not checked", "faults", "diloco_jax/learners/syncer.py",
           "        if loss is None or (math.isfinite(loss) and abs(loss) <= guard.MAX_LOSS):",
           "        if True:",
           [T_PAGE2 + "test_a_push_whose_loss_is_not_a_finite_number_in_range_is_refused",
            T_PAGE2 + "test_a_learner_pushes_its_rounds_mean_loss_and_a_bad_one_is_refused_"
            "over_grpc"]),
]  # fmt: skip
MUTANTS += [  # issue 61, items 5 and 6: stops said at once; the command under uv run
    Mutant("a signal acknowledged only between bytecodes", "faults",
           "diloco_jax/run/preemption.py",
           "previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)",
           "previous = signal.set_wakeup_fd(-1)",
           ["tests/test_preemption.py::test_a_signal_is_acknowledged_and_a_second_stops_at_once_"
            "while_a_step_runs"]),
    Mutant("the first save by time waits the whole interval", "checkpoint",
           "diloco_jax/run/loop.py", "    FIRST = 1 / 8  #", "    FIRST = 1.0  #",
           ["tests/test_checkpoint.py::test_the_save_clock_saves_soon_after_the_start_then_ever_"
            "less_often_up_to_its_minutes"]),
    Mutant("the command to continue forgets uv run", "command line",
           "diloco_jax/base/commandline.py",
           '    uv = ["uv", "run"] if environ.get(UV_RUN) and prog[:1] != ["uv"] else []',
           "    uv = []",
           ["tests/test_checkpoint.py::test_the_command_of_a_run_started_by_uv_run_starts_with_"
            "uv_run"]),
]  # fmt: skip
T_SHARD = "tests/test_shards.py::"
MUTANTS += [  # issue 62, steps 1-2: shards that follow the deciding shard's rounds
    Mutant("a following shard merges every push it holds, not the decision's", "faults",
           "diloco_jax/learners/keeping.py",
           "        order = sorted(self.pending) if decided is None else list(decided.learners)",
           "        order = sorted(self.pending)",
           [T_SHARD + "test_shards_in_quorum_rounds_merge_a_late_push_where_one_syncer_does"]),
    Mutant("a shard judges a push finite by its own leaves alone", "faults",
           "diloco_jax/learners/syncer.py",
           "            finite = whole_finite  # every shard leaves it out alike",
           "            pass",
           [T_SHARD + "test_shards_in_quorum_rounds_merge_a_late_push_where_one_syncer_does"]),
    Mutant("a shard's cut takes the blocks one row late", "faults",
           "diloco_jax/learners/shards.py", "            out[name] = message[name][first:end]",
           "            out[name] = message[name][first + 1 : end + 1]",
           [T_SHARD + "test_a_push_cut_into_block_ranges_decodes_on_each_shard_to_the_whole_"
            "pushs_bits"]),
    Mutant("a short last block range is kept, too small for the codec", "faults",
           "diloco_jax/learners/shards.py",
           "        edges[held[-1]] = blocks  # a short last range joins the one before it",
           "        pass",
           [T_SHARD + "test_a_push_cut_into_block_ranges_decodes_on_each_shard_to_the_whole_"
            "pushs_bits"]),
    Mutant("shards assigned in the leaves' order, not by size", "faults",
           "diloco_jax/learners/shards.py",
           "    for name in sorted(names, key=lambda n: (-sizes[n], n)):",
           "    for name in names:",
           [T_SHARD + "test_every_leaf_goes_to_one_shard_and_the_order_of_the_leaves_does_not_"
            "matter"]),
]  # fmt: skip
T_WIRE = "tests/test_shards_wire.py::"
MUTANTS += [  # issue 62, steps 3b-4a: block ranges held as a leaf; shards over the network
    Mutant("every syncer shard decides its own rounds", "faults",
           "diloco_jax/learners/command.py", "                  decides=sy.shard == 0, removed",
           "                  decides=True, removed",
           [T_WIRE + "test_two_learners_one_of_them_nan_merge_on_two_shards_as_on_one_syncer"]),
    Mutant("a learner tells every shard its mean is finite", "faults",
           "diloco_jax/learners/fanout.py", '"generation": self.generations[k], "finite": ok,',
           '"generation": self.generations[k], "finite": True,',
           [T_WIRE + "test_two_learners_one_of_them_nan_merge_on_two_shards_as_on_one_syncer"]),
    Mutant("shards' block ranges gathered in reverse", "faults",
           "diloco_jax/learners/shards.py",
           "        flat = np.concatenate([piece[FLAT] for piece, p in zip(pieces, parts, strict",
           "        flat = np.concatenate([piece[FLAT] for piece, p in zip(pieces[::-1], parts[::-1], strict",  # noqa: E501
           [T_SHARD + "test_an_anchor_split_into_pieces_gathers_back_and_a_bad_piece_is_named",
            T_SHARD + "test_shards_through_int8_with_compressed_answers_rebuild_one_syncers_"
            "anchor"]),
    Mutant("anyone may ask shard 0 how rounds closed", "faults",
           "diloco_jax/learners/service.py",
           "        if who.kind != identity.SHARD or not 0 < who.learner < self.shards:",
           "        if False:",
           [T_WIRE + "test_only_a_shard_asks_how_rounds_closed_and_a_follower_cannot_be_asked"]),
    Mutant("a restarted shard forgets the rounds it decided", "checkpoint",
           "diloco_jax/learners/keeping.py",
           "        self.decisions = {d.round: d for d in map(Decision.from_json, meta.get(",
           "        self.decisions = {} and {d.round: d for d in map(Decision.from_json, meta.get(",
           [T_SHARD + "test_a_shard_restarted_mid_round_keeps_its_members_and_follows_the_"
            "decision"]),
    Mutant("streaming fragments assigned over the shards as one", "faults",
           "diloco_jax/learners/shards.py", "    if count > 1:", "    if False:",
           [T_SHARD + "test_streaming_fragments_spread_over_every_shard_and_a_fragments_push_"
            "cuts_to_its_leaves"]),
    Mutant("the replay's flows through shared links never share", "runtime", "sim/replay.py",
           "        return min(self.cap, self.capacity / len(self.flows)) if self.flows else 0.0",
           "        return self.cap if self.flows else 0.0",
           [T_REPLAY + "test_behind_links_of_their_own_the_pushes_in_flight_share_the_syncers_"
            "link"]),
    # robust merging (issue 63)
    Mutant("the trimmed mean keeps one value too many at the top", "algorithm", ROBUST,
           "    kept = (k >= f) & (k < n - f)", "    kept = (k >= f) & (k < n - f + 1)",
           [T_ROBUST + "test_each_rule_equals_a_direct_numpy_computation"]),
    Mutant("the weighted median takes the lower middle only", "algorithm", ROBUST,
           "    hi = jnp.argmax(cumulative > half, axis=0)",
           "    hi = jnp.argmax(cumulative >= half, axis=0)",
           [T_ROBUST + "test_each_rule_equals_a_direct_numpy_computation"]),
    Mutant("norms clipped against the largest norm, not the median", "algorithm", ROBUST,
           "    radius = clip * median_of(norms_R, valid_R)",
           "    radius = clip * jnp.max(norms_R)",
           [T_ROBUST + "test_each_rule_equals_a_direct_numpy_computation"]),
    Mutant("centered clipping never clips", "algorithm", ROBUST,
           "        step = share * jnp.where(dist > tau, tau / jnp.maximum(dist, 1e-30), 1.0)",
           "        step = share * 1.0",
           [T_ROBUST + "test_each_rule_equals_a_direct_numpy_computation"]),
    Mutant("a left-out replica's NaN reaches the robust rule", "algorithm", ROBUST,
           "        sent = [jnp.where(counted, d, 0.0) for d in delta]",
           "        sent = list(delta); counted = jnp.isfinite(w)",
           [T_ROBUST + "test_the_exchange_under_vmap_gives_every_replica_the_rules_merge"]),
    Mutant("the attacker's statistics count the attackers", "algorithm", ROBUST,
           "    honest_R = valid_R & ~hostile_R", "    honest_R = valid_R",
           [T_ROBUST + "test_each_attack_equals_a_direct_numpy_computation"]),
    Mutant("the syncer merges every rule as the mean", "faults",
           "diloco_jax/learners/keeping.py", "        if rule is None or rule.plain:",
           "        if True:",
           [T_ROBUST + "test_a_syncer_merging_with_the_median_is_not_moved_by_one_far_push_"
            "and_says_so"]),
    Mutant("one odd round makes a learner suspect", "faults",
           "diloco_jax/learners/rounds.py",
           "    return len(window) >= SUSPECT_AFTER and 2 * sum(window) > len(window)",
           "    return any(window)",
           [T_DISTRUST + "test_a_learner_that_is_an_outlier_in_most_rounds_is_suspect_in_tape_"
            "page_and_metrics"]),
    Mutant("a restarted syncer forgets whom the operator removed", "checkpoint",
           "diloco_jax/learners/keeping.py", "        self.removed |= self._removed_before",
           "        self.removed |= set()",
           [T_DISTRUST + "test_a_learner_the_operator_removes_is_refused_from_then_on_and_not_"
            "waited_for"]),
    Mutant("the first round waits for a removed learner", "faults",
           "diloco_jax/learners/syncer.py",
           "                    self.expected |= set(range(self.learners)) - self.removed",
           "                    self.expected |= set(range(self.learners))",
           [T_DISTRUST + "test_a_learner_the_operator_removes_is_refused_from_then_on_and_not_"
            "waited_for"]),
    Mutant("a restarted syncer clips around zeros, not its last merge", "checkpoint",
           "diloco_jax/learners/keeping.py",
           '            self.center = [np.asarray(c, np.float32) for c in saved["center"]]',
           "            self.center = None",
           [T_ROBUST + "test_a_syncer_clips_around_its_last_merge_as_the_simulator_does_"
            "across_a_restart"]),
    Mutant("a streaming syncer clips every fragment around the first leaves' center", "faults",
           "diloco_jax/learners/keeping.py",
           "            part = None if center is None else [center[i] for i in idx]",
           "            part = None if center is None else center[:len(idx)]",
           ["tests/test_learners.py::test_streaming_learners_through_a_syncer_equal_the_cores_"
            "streaming_replicas"]),
]  # fmt: skip
