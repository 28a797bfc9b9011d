"""Shared fixtures for the bamboo-bench tests: the shared trace folder and a tiny hand-computable profile."""

from __future__ import annotations

from pathlib import Path

import pytest
from bamboo.bench.profile import ModelProfile, Timing

# <repo>/packages/bamboo-bench/tests/conftest.py -> parents[3] is <repo>; the traces sit beside it.
TRACES = Path(__file__).resolve().parents[3] / ".." / "shared" / "traces"


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """The shared real traces (`<repo>/../shared/traces`); tests that need them skip if it is missing."""
    if not TRACES.is_dir():
        pytest.skip(f"shared trace folder {TRACES.resolve()} is missing")
    return TRACES.resolve()


@pytest.fixture(scope="session")
def tiny_profile() -> ModelProfile:
    """2 pipelines x 4 stages (immutable, so shared), 10 samples per step, 1.0 s steps with 2 pipelines and 1.5 s with 1.

    Timing: nodes ready 10 s after they are added, global rendezvous 5 s, local 2 s,
    reconfiguration 3 s, failover pause 4 s, fallback x1.5, restart 20 s, checkpoints every 100 s.
    """
    return ModelProfile(
        name="tiny",
        stages=4,
        pipelines=2,
        samples_per_step=10,
        step_time_ms={(4, 2): 1000.0, (4, 1): 1500.0},
        spot_price_per_node_hour=1.0,
        on_demand_price_per_node_hour=3.0,
        on_demand_nodes=6,
        on_demand_samples_per_second=12.0,
        job_samples=1000.0,
        timing=Timing(
            instance_creation_s=10.0,
            global_rendezvous_s=5.0,
            local_rendezvous_s=2.0,
            reconfiguration_s=3.0,
            failover_pause_s=4.0,
            fallback_slowdown=1.5,
            restart_s=20.0,
            checkpoint_interval_s=100.0,
        ),
    )
