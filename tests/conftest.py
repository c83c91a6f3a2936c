"""Every test sees 8 fake CPU devices, set before JAX initialises."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
    del config
    if jax.device_count() != 8:
        raise RuntimeError(
            f"tests need 8 fake CPU devices, JAX has {jax.device_count()}; was jax "
            "initialised before tests/conftest.py ran?"
        )


@pytest.fixture(scope="session")
def devices():
    return jax.devices()


@pytest.fixture(scope="session")
def digits_data_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tfds data_dir with the offline ``digits`` dataset built once per session."""
    import experiments.datasets  # noqa: F401  (registers the "digits" builder)
    from replicator.trainer import data

    path = str(tmp_path_factory.mktemp("tfds"))
    data.load_data_source("digits", "train", data_dir=path)  # builds both splits
    return path


@pytest.fixture(scope="session")
def gcs_server():
    """A real GCS JSON API server (gcp-storage-emulator) on 127.0.0.1 for the session.

    The client libraries reach it through their own variables only, set here for
    this process and every subprocess a test starts: ``STORAGE_EMULATOR_HOST``
    (google-cloud-storage, gcsfs) and ``TENSORSTORE_GCS_HTTP_URL`` with
    ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` (tensorstore, Orbax's array writer).
    """
    from tests import gcs

    with gcs.emulator() as url:
        yield url


@pytest.fixture
def bucket(gcs_server) -> str:
    """A fresh, empty bucket on the session's GCS server: ``gs://NAME``."""
    from tests import gcs

    return gcs.new_bucket()


# Slow on CI's 2 cores (10-25 s each) and held by faster tests of the same invariant, so
# `make test` (two pytest-xdist workers) keeps under 15 minutes; `make test-slow` runs them.
SLOW = (
    # The XLA:CPU scheduler crash repro (a subprocess) and the GAN config (its experiment
    # has its own fast tests) run with `make test-slow`.
    "tests/test_lm_parallel.py::test_an_moe_step_reducing_its_sums_over_data_runs_on_cpu",
    "tests/test_configs.py::test_config_trains_two_steps[gan_digits]",
    # The same experiment as digits_cnn and cifar10_resnet (kept), and DiLoCo's own tests:
    "tests/test_configs.py::test_config_trains_two_steps[cifar10_cnn]",
    "tests/test_configs.py::test_config_trains_two_steps[fashion_mnist_cnn]",
    "tests/test_configs.py::test_config_trains_two_steps[mnist_cnn]",
    "tests/test_configs.py::test_config_trains_two_steps[digits_cnn_diloco]",
    # Siblings on other meshes or storage stay fast:
    "tests/test_zero.py::test_run_keeps_the_state_sharded_and_equals_one_device[adam-data4_tensor2]",
    "tests/test_zero.py::test_run_keeps_the_state_sharded_and_equals_one_device[adam-data4_fsdp2]",
    "tests/test_zero.py::test_what_the_step_reads_is_what_it_reads_unsharded[1]",
    "tests/test_checkpoint.py::test_every_item_of_a_step_restores_with_orbax_alone[bucket]",
    "tests/test_context_parallel.py::test_chunks_smaller_than_a_block_equal_one_device[False-ring]",
    "tests/test_context_parallel.py::test_chunks_smaller_than_a_block_equal_one_device[True-gather]",
    "tests/test_context_parallel.py::test_inside_a_shard_map_over_data_and_context_equals_one_device[4-gather-False]",
    "tests/test_context_parallel.py::test_inside_a_shard_map_over_data_and_context_equals_one_device[4-ring-False]",
    "tests/test_ports.py::test_resnet_cross_replica_batchnorm_8_replicas_equal_1_device_and_compile",
    "tests/test_configs.py::test_config_trains_two_steps[lm_tiny_diloco]",
    "tests/test_configs.py::test_config_trains_two_steps[lm_8b]",
    "tests/test_configs.py::test_gan_digits_logs_two_finite_losses",
    "tests/test_diloco.py::test_trainer_resumes_exactly_and_evaluates_the_outer_parameters",
    "tests/test_diloco.py::test_trainer_compile_path_trains_like_the_run_path",
    "tests/test_profile.py::test_profile_steps_on_a_bucket_land_in_the_bucket",
    "tests/test_multiprocess.py::test_elastic_islands_survive_a_killed_island_exactly",
    "tests/test_multiprocess.py::test_diloco_islands_on_two_processes_train_like_one",
    "tests/test_lm.py::test_a_chunked_loss_equals_the_whole_one_without_whole_logits[True]",
    "tests/test_gan.py::test_microbatches_keep_the_model_state_mirrored",
    "tests/test_eval_anywhere.py::test_eval_on_1_and_3_devices_equals_the_training_runs_eval[digits_cnn_diloco]",
    "tests/test_gcs.py::test_init_from_a_run_on_a_bucket",
    "tests/test_pipeline.py::test_gradient_accumulation_runs_the_schedule_per_microbatch[compile]",
    "tests/test_optimizer_keys.py::test_every_experiment_takes_the_optimizer_keys_on_both_paths[gan_digits-compile-mesh3-Dense_0]",
    "tests/test_finetune.py::test_lr_mults_in_a_run_move_the_backbone_a_tenth_and_say_what_they_took",
    "tests/test_optimizer_keys.py::test_every_experiment_takes_the_optimizer_keys_on_both_paths[lm_tiny-run-mesh2-ln_final]",
    "tests/test_optimizer_keys.py::test_every_experiment_takes_the_optimizer_keys_on_both_paths[digits_nnx_cnn-run-mesh1-conv1]",
    "tests/test_optimizer_keys.py::test_a_resumed_fine_tune_needs_no_source",
    "tests/test_own_data.py::test_a_data_function_of_the_digits_trains_like_the_tfds_digits",
    # Session 13 (the fast suite was 19.7 minutes alone on 2 cores): each of these has
    # its invariant held by a faster test (the other path, another parameter, a unit test).
    "tests/test_pipeline.py::test_the_lm_on_a_pipeline_trains_like_one_device[run-mesh1-pipeline1]",
    "tests/test_multiprocess.py::test_custom_loop_on_two_processes_equals_one",
    "tests/test_multiprocess.py::test_replicate_and_process_rows_across_processes",
    "tests/test_own_data.py::test_the_regression_example_trains_from_the_repository_root",
    "tests/test_optimizer_keys.py::test_a_bf16_gradient_sum_trains_like_a_float32_one[digits_cnn-60-accuracy-0.03]",
    "tests/test_optimizer_keys.py::test_init_from_with_freeze_reproduces_the_source_eval",
    "tests/test_lm_parallel.py::test_the_moe_lm_over_experts_trains_like_one_device[compile-mesh0]",
    "tests/test_nnx.py::test_batch_norm_statistics_keep_their_shape_alternating_run_and_compile",
    "tests/test_train.py::test_compile_path_trains_like_the_run_path",
    "tests/test_nnx_trainer.py::test_experiment_under_a_policy_runs_convolutions_and_matmuls_in_low_precision[fp16]",
    "tests/test_nnx_trainer.py::test_smoke_config_trains_with_its_state_in_the_train_state[bf16]",
    "tests/test_nnx_trainer.py::test_smoke_config_trains_with_its_state_in_the_train_state[fp32]",
    "tests/test_ports.py::test_gan_two_optimizers_in_one_step_8_replicas_equal_1_device[mesh1]",
    "tests/test_lm_program.py::test_every_remat_policy_gives_the_gradients_of_none[minimal]",
    "tests/test_profile.py::test_the_profiler_server_runs_while_training_and_stops_after",
    "tests/test_zero.py::test_run_keeps_the_state_sharded_and_equals_one_device[sgd-cube]",
    "tests/test_zero.py::test_run_keeps_the_state_sharded_and_equals_one_device[sgd-data4_tensor2]",
    # Pretrained models, packing and sampling: a sibling of each stays fast.
    "tests/test_sample.py::test_greedy_is_the_full_forward_argmax_at_every_position[gpt2-scan]",
    "tests/test_sample.py::test_greedy_is_the_full_forward_argmax_at_every_position[llama-unrolled]",
    "tests/test_sample.py::test_the_cached_forward_equals_the_full_forward",
    "tests/test_sample.py::test_bf16_policy_caches_in_bf16",
    "tests/test_sample.py::test_docstring_examples_run[experiments.lm.sample]",
    "tests/test_packing.py::test_the_lm_on_both_paths_and_over_context_equals_documents_alone[run-mesh1-gather-True]",
    "tests/test_llama.py::test_swiglu_experts_train_like_one_device[compile]",
    "tests/test_llama.py::test_the_llama_lm_trains_like_one_device[run-mesh3-parallel3]",
    "tests/test_llama.py::test_every_remat_policy_gives_the_gradients_of_none[minimal]",
    "tests/test_configs.py::test_config_trains_two_steps[llama3_8b]",
    "tests/test_configs.py::test_config_trains_two_steps[digits_vit]",
    # On a 2-core AMD EPYC VM the suite takes about twice as long as where it was tuned
    # (17m51s for 888 tests): these have siblings (another path or mesh, a unit test).
    "tests/test_lm_parallel.py::test_the_moe_lm_over_experts_trains_like_one_device[run-mesh1]",
    "tests/test_lm_parallel.py::test_the_lm_over_context_trains_like_one_device[run-mesh1-gather-True]",
    "tests/test_checkpoint.py::test_sigkill_then_resume_equals_uninterrupted",
    "tests/test_checkpoint.py::test_guide_orbax_recipe_runs_as_written",
    "tests/test_cli.py::test_a_key_a_newer_config_file_added_does_not_block_resuming",
    "tests/test_cli.py::test_eval_is_quiet_and_verbose_shows_the_libraries",
    "tests/test_cli.py::test_progress_bar_on_a_terminal",
    "tests/test_cli.py::test_a_rerun_without_a_complete_checkpoint_says_it_starts_over",
    "tests/test_cli.py::test_a_workdir_of_another_experiment_is_refused_unless_forced",
    "tests/test_cli.py::test_eval_follow_prints_one_json_line_per_result",
    "tests/test_own_data.py::test_resuming_a_run_on_a_data_function_equals_never_stopping",
    "tests/test_gan.py::test_train_step_8_replicas_equal_1_device_and_compile",
    "tests/test_optimizer_keys.py::test_ema_metrics_and_ema_survive_kill_and_resume_bitwise",
    "tests/test_optimizer_keys.py::test_a_key_a_config_sets_can_be_set_back_to_none",
    "tests/test_configs.py::test_config_trains_two_steps[lm_1b]",
    "tests/test_configs.py::test_config_trains_two_steps[lm_gpt2_124m]",
    "tests/test_configs.py::test_config_trains_two_steps[cifar10_resnet]",
    "tests/test_nnx.py::test_the_guides_nnx_example_runs_as_printed",
    "tests/test_finetune.py::test_a_linear_probe_costs_fewer_flops_per_step",
    "tests/test_sample.py::test_greedy_is_the_full_forward_argmax_at_every_position[gpt2-unrolled]",
    "tests/test_aggregate.py::test_diloco_islands_aggregate_among_their_own_replicas",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    del config
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
    # An entry of a collected file that names no test (a renamed test, a changed
    # parameter) would silently turn that test fast: refuse it.
    collected = {item.nodeid for item in items}
    files = {nodeid.split("::")[0] for nodeid in collected}
    stale = [n for n in SLOW if n.split("::")[0] in files and n not in collected]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py SLOW names no collected test: {stale}")
