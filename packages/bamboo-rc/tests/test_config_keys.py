"""DeepSpeed configs as users have them: keys without effect warn once each, monitors are read, and
enabled features bamboo lacks stay clear errors."""

from __future__ import annotations

import warnings

import pytest
from bamboo.rc.config import ConfigError, ConfigWarning, MonitorConfig, load_config


def _load_warnings(config: dict) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_config(config)
    return loaded, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"steps_per_print": 10}, "DeepSpeed config key 'steps_per_print' has no effect in bamboo (bamboo prints no "
                                  "periodic DeepSpeed log lines)"),
        ({"wall_clock_breakdown": False}, "DeepSpeed config key 'wall_clock_breakdown' has no effect in bamboo"),
        ({"zero_allow_untested_optimizer": True}, "'zero_allow_untested_optimizer' has no effect in bamboo"),
        ({"fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 16}},
         "DeepSpeed config key 'fp16' has no effect in bamboo (it is disabled)"),
        ({"zero_optimization": {"stage": 0, "overlap_comm": True, "reduce_bucket_size": 5e8}},
         "DeepSpeed config key 'zero_optimization' has no effect in bamboo (stage 0 is no ZeRO)"),
        ({"zero_optimization": {}}, "'zero_optimization' has no effect in bamboo (stage 0 is no ZeRO)"),
    ],
)
def test_a_key_without_effect_is_accepted_with_one_warning_naming_it(
    tiny_config: dict, extra: dict, message: str
) -> None:
    _, messages = _load_warnings({**tiny_config, **extra})
    assert len(messages) == 1 and message in messages[0], messages


def test_a_real_config_gives_one_line_per_key_and_trains_the_same(tiny_config: dict) -> None:
    config = {
        **tiny_config, "steps_per_print": 2000, "wall_clock_breakdown": False, "fp16": {"enabled": False},
        "bf16": {"enabled": False}, "zero_optimization": {"stage": 0},
        "tensorboard": {"enabled": False, "output_path": "logs/", "job_name": "x"},
    }
    loaded, messages = _load_warnings(config)
    assert sorted(m.split("'")[1] for m in messages) == ["fp16", "steps_per_print", "wall_clock_breakdown",
                                                          "zero_optimization"]
    assert all("\n" not in m for m in messages)
    assert loaded == load_config(tiny_config)  # nothing of it changes the training


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "'fp16' and 'bf16' are both enabled: choose one"),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16: 'hysteresis' must be > 0: 0"),
        ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16: 'min_loss_scale' must be > 0.0: 0.0"),
        ({"fp16": {"enabled": True, "min_loss_scale": float("inf")}}, "fp16: 'min_loss_scale' must be < inf: inf"),
        ({"fp16": {"enabled": True, "loss_scale_window": 1.5}}, "fp16.loss_scale_window must be an integer, got 1.5"),
        ({"fp16": {"enabled": True, "consecutive_hysteresis": 1}},
         "fp16.consecutive_hysteresis must be true or false, got 1"),
        ({"fp16": {"enabled": "auto"}}, "fp16.enabled must be true or false, got 'auto'"),
        ({"zero_optimization": {"stage": 2, "overlap_comm": True}},
         "unsupported DeepSpeed config key 'zero_optimization' with stage 2"),
        ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
         "unsupported DeepSpeed config key zero_optimization.'offload_optimizer' with device 'cpu'"),
        ({"comet": {"enabled": True}}, "unsupported DeepSpeed config key 'comet' with enabled true"),
        ({"tensorboard": {"enabled": True, "flush_secs": 3}}, "unsupported DeepSpeed config key tensorboard.'flush_secs'"),
        ({"csv_monitor": {"enabled": True, "output_path": 3}}, "csv_monitor.output_path must be a string, got 3"),
        ({"wandb": True}, "wandb must be a JSON object, got True"),
        ({"activation_checkpointing": {}}, "unsupported DeepSpeed config key 'activation_checkpointing'"),
    ],
)
def test_an_enabled_feature_bamboo_lacks_is_a_clear_error(tiny_config: dict, extra: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config({**tiny_config, **extra})
    assert message in str(error.value)


def test_enabled_monitors_are_read_with_deepspeeds_defaults(tiny_config: dict) -> None:
    loaded, messages = _load_warnings({
        **tiny_config,
        "tensorboard": {"enabled": True, "output_path": "out/tb", "job_name": "gpt"},
        "csv_monitor": {"enabled": True},
        "wandb": {"enabled": False, "project": "p"},
        "comet": {"enabled": False},
    })
    assert messages == []
    assert loaded.monitors == (  # type: ignore[attr-defined]
        MonitorConfig("tensorboard", {"output_path": "out/tb", "job_name": "gpt"}),
        MonitorConfig("csv_monitor", {"output_path": "", "job_name": "DeepSpeedJobName"}),
    )
