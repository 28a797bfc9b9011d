"""The engine under DeepSpeed's names: eval_batch, save_checkpoint/load_checkpoint and the monitors.

Each test forks the nodes of a small pipeline (a TCPStore hosted by the test), with the example GPT at
its smallest, in exact mode. (Not threads: two nodes in one process share torch's process-wide state,
and their replicas are then not always bit-equal.)
"""

from __future__ import annotations

import csv
import itertools
import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from bamboo.rc.checkpoint_files import CheckpointError
from bamboo.rc.data import GlobalBatchSampler, pipeline_data_iter
from bamboo.rc.engine import Engine, initialize
from bamboo.rc.evaluation import forward_only_streams
from bamboo.rc.failures import StoreFailureNotices
from bamboo.rc.model import GPTSize, gpt_layer_specs, lm_loss
from bamboo.rc.monitor import EVAL_LOSS, LEARNING_RATE, SAMPLES_PER_SECOND, TRAIN_LOSS
from bamboo.rc.records import FailureEvent
from bamboo.rc.testing import ForkedRanks
from bamboo.rc.timeouts import CommTimeouts
from bamboo.schedule import Costs, one_f_one_b
from bamboo.schedule.engine import check_execution

SIZE = GPTSize(layers=2, width=16, heads=2, sequence=8)
VICTIM_EXIT = 9
TIMEOUTS = CommTimeouts(group=30.0, build=30.0, confirm=10.0)


@pytest.fixture(autouse=True)
def _exact() -> Iterator[None]:
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


@pytest.fixture(scope="module")
def sampler() -> GlobalBatchSampler:
    return GlobalBatchSampler(2, SIZE.sequence, seed=3)


def _nodes(config: dict, body: Callable[[Engine, int], Any], *, stages: int = 2, pipelines: int = 1,
           job: str, victims: tuple[int, ...] = (), sampler: GlobalBatchSampler | None = None) -> dict[int, Any]:
    """Fork one process per node, each running ``body(engine, rank)``; their results by rank.

    The children are forked by :class:`bamboo.rc.testing.ForkedRanks`. With ``victims``, the
    nodes learn of failures through the store and this process is the failure authority: it publishes
    the death of each victim (which must die) as the next epoch's event. With ``sampler``, the engines get
    ``microbatch=`` from it (what a ring of one-stage nodes needs).
    """
    world = stages * pipelines

    def member(rank: int, store: Any) -> Any:
        notices = StoreFailureNotices(store, job) if victims else None
        engine = initialize(gpt_layer_specs(SIZE), config, "eflb", loss_fn=lm_loss, stages=stages, rank=rank,
                            world_size=world, store=store, job=job, timeouts=TIMEOUTS, notices=notices,
                            microbatch=_microbatch(sampler))
        result = body(engine, rank)
        engine.finish()
        return result

    codes: dict[int, int] = {}
    with ForkedRanks(world, member) as ranks:
        while len(codes) < world:
            pid, status = os.waitpid(-1, 0)
            rank = ranks.pids[pid]
            codes[rank] = os.waitstatus_to_exitcode(status)
            if rank in victims:  # epoch n: the n-th death
                StoreFailureNotices(ranks.store, job).publish(FailureEvent(sum(r in codes for r in victims), [rank]))
    assert all(codes[rank] == VICTIM_EXIT for rank in victims), codes
    assert sorted(ranks.results) == [rank for rank in range(world) if rank not in victims], codes
    return ranks.results


def _microbatch(sampler: GlobalBatchSampler | None) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None:
    """The data as a function of (step, global index), as ``initialize(microbatch=)`` takes it."""
    if sampler is None:
        return None

    def microbatch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = sampler.microbatch(step, index)
        return batch.tokens, batch.labels
    return microbatch


def _data(sampler: GlobalBatchSampler, engine: Engine, first_step: int = 0, offset: int = 0) -> Iterator[Any]:
    """The pipeline's training data (``offset`` 1000: the evaluation data, other steps of the same corpus)."""
    executor = engine.executor
    return pipeline_data_iter(sampler, executor.pipeline, executor.config.micro_batches, first_step + offset)


def _state(engine: Engine) -> dict[int, list[torch.Tensor]]:
    """Every slice's parameters and optimizer state (the replica's too), copied."""
    engine.executor.apply_replica_updates()
    state = {}
    for stage, piece in engine.executor.slices.items():
        tensors = [p.detach().clone() for p in piece.parameters]
        for value in piece.optimizer.state.values():
            tensors.extend(value[key].clone() for key in sorted(value))
        state[stage] = tensors
    return state


def _assert_identical(a: dict[int, Any], b: dict[int, Any]) -> None:
    assert a.keys() == b.keys()
    for rank in a:
        for stage in a[rank]:
            for x, y in zip(a[rank][stage], b[rank][stage], strict=True):
                assert torch.equal(x, y), f"rank {rank} stage {stage} differs"


def test_forward_only_streams_execute_for_every_placement() -> None:
    for placement in [(0, 1, 2, 3), (0, 1, 1, 3), (3, 1, 2, 3), (0, 0, 2, 3), (0, 1), (0,)]:
        streams = forward_only_streams(placement, 3)
        check_execution(streams)  # no deadlock, every send meets its receive
        for node, stream in streams.items():
            forwards = [str(i) for i in stream if i.kind.name == "FORWARD"]
            assert forwards == [f"{s}F{k}" for k in range(3) for s, n in enumerate(placement) if n == node]
    assert [str(i) for i in forward_only_streams((0, 1, 1), 1)[1]] == ["1RA0<0", "1F0", "2F0"]
    with pytest.raises(ValueError, match="at least 1 microbatch, got 0"):
        forward_only_streams((0, 1), 0)


def test_eval_batch_is_the_global_mean_and_the_next_step_is_bit_identical(
    tiny_config: dict, sampler: GlobalBatchSampler
) -> None:
    def train(evaluate: bool) -> Callable[[Engine, int], Any]:
        def body(engine: Engine, rank: int) -> Any:
            data = _data(sampler, engine)
            losses, evals = [], []
            for _ in range(3):
                losses.append(float(engine.train_batch(data)))
                if evaluate:
                    evals.append(float(engine.eval_batch(_data(sampler, engine, engine.global_steps, 1000))))
            return {"state": _state(engine), "losses": losses, "evals": evals, "lr": engine.get_lr(),
                    "steps": engine.global_steps}
        return body

    plain = _nodes(tiny_config, train(False), pipelines=2, job="eval-plain")
    evaluated = _nodes(tiny_config, train(True), pipelines=2, job="eval-evaluated")
    _assert_identical({r: v["state"] for r, v in plain.items()}, {r: v["state"] for r, v in evaluated.items()})
    assert all(v["losses"] == plain[0]["losses"] and v["steps"] == 3 for v in evaluated.values())
    evals = evaluated[0]["evals"]
    assert all(v["evals"] == evals for v in evaluated.values())  # every node gets the loss
    # The reference: the whole model, trained by the same steps, evaluated on the same 2 x M microbatches.
    from bamboo.rc.config import load_config
    from bamboo.rc.reference import train_reference
    from bamboo.rc.state import TrainableSlice

    config = load_config(tiny_config, pipelines=2)
    specs = gpt_layer_specs(SIZE)
    for steps, measured in ((1, evals[0]), (3, evals[2])):
        trained = train_reference(specs, lm_loss, config, sampler, steps, 2, 0)
        whole = TrainableSlice(specs, range(len(specs)), config, 0)
        for layer, state in zip(whole.layers, trained.layer_states, strict=True):
            layer.load_state_dict(state)
        whole.layers.eval()
        with torch.no_grad():
            batches = [sampler.microbatch(steps + 1000, i) for i in range(2 * config.micro_batches)]
            expected = sum(float(lm_loss(whole.layers(b.tokens), b.labels)) for b in batches) / len(batches)
        assert measured == pytest.approx(expected, rel=1e-5)


def test_a_node_killed_during_eval_batch_gives_the_evaluation_up_and_training_fails_over(
    tiny_config: dict, sampler: GlobalBatchSampler
) -> None:
    """Node 1 dies in the forward of its first evaluation microbatch: node 0 gets NaN (no hang), its next
    train_batch fails over (it runs both stages), and its next evaluation and its training match a run
    without the failure."""

    def body(engine: Engine, rank: int, die: bool) -> Any:
        data = _data(sampler, engine)
        losses = [float(engine.train_batch(data)) for _ in range(2)]
        if die and rank == 1:  # dies in an eval-mode forward of its stage: inside the evaluation
            engine.executor.slices[1].layers[0].register_forward_hook(
                lambda module, *_: os._exit(VICTIM_EXIT) if not module.training else None)
        first = float(engine.eval_batch(_data(sampler, engine, 2, 1000)))
        losses.append(float(engine.train_batch(data)))
        second = float(engine.eval_batch(_data(sampler, engine, 3, 1000)))
        losses.append(float(engine.train_batch(data)))
        return {"first": first, "second": second, "losses": losses, "state": _state(engine),
                "failovers": len(engine.executor.failovers), "hosted": engine.executor.hosted}

    clean = _nodes(tiny_config, lambda engine, rank: body(engine, rank, False), job="eval-clean")
    failed = _nodes(tiny_config, lambda engine, rank: body(engine, rank, True), job="eval-kill", victims=(1,))
    survivor = failed[0]
    assert math.isnan(survivor["first"]) and survivor["failovers"] == 1 and survivor["hosted"] == (0, 1)
    assert survivor["second"] == pytest.approx(clean[0]["second"], rel=1e-6)
    assert survivor["losses"] == pytest.approx(clean[0]["losses"], rel=1e-6)
    expected = {0: clean[0]["state"][0], 1: clean[1]["state"][1]}
    for stage, tensors in expected.items():
        for mine, theirs in zip(survivor["state"][stage], tensors, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=0.0)


def test_save_at_k_then_train_equals_load_at_k_in_fresh_engines(
    tiny_config: dict, sampler: GlobalBatchSampler, tmp_path: Path
) -> None:
    def save_and_go_on(engine: Engine, rank: int) -> Any:
        data = _data(sampler, engine)
        for _ in range(2):
            engine.train_batch(data)
        assert engine.save_checkpoint(tmp_path, client_state={"epoch": 7}) is True
        for _ in range(2):
            engine.train_batch(data)
        return _state(engine)

    def load_and_go_on(engine: Engine, rank: int) -> Any:
        path, client = engine.load_checkpoint(tmp_path)
        assert path == str(tmp_path / "global_step2") and client == {"epoch": 7} and engine.global_steps == 2
        data = _data(sampler, engine, first_step=2)
        for _ in range(2):
            engine.train_batch(data)
        return _state(engine)

    saved = _nodes(tiny_config, save_and_go_on, job="ckpt-save")
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in (tmp_path / "global_step2").iterdir()) == [
        "stage-0.manifest.json", "stage-0.pt", "stage-1.manifest.json", "stage-1.pt"]
    _assert_identical(saved, _nodes(tiny_config, load_and_go_on, job="ckpt-load"))
    # D=2 loads the same checkpoint (the stage bounds are those of P=2)
    _nodes(tiny_config, lambda engine, rank: engine.load_checkpoint(tmp_path, tag="global_step2"), pipelines=2,
           job="ckpt-load-d2")


def _variant(source: Path, tag: str, change: Callable[[Path], None]) -> None:
    """A copy of checkpoint ``source`` as ``tag`` beside it, each stage file changed by ``change``."""
    folder = source.parent / tag
    shutil.copytree(source, folder)
    for path in sorted(folder.glob("stage-*.pt")):
        change(path)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _uncommit(path: Path) -> None:
    path.with_name(path.name.replace(".pt", ".manifest.json")).unlink()


def _as_before_manifests(path: Path) -> None:
    """Rewrite a stage file as the engine wrote it before checkpoints had manifests (format 1)."""
    shard = torch.load(path, weights_only=True)
    del shard["format"]
    torch.save(shard, path)
    _uncommit(path)


def test_load_checkpoint_verifies_each_stage_file_and_reads_the_old_format(
    tiny_config: dict, sampler: GlobalBatchSampler, tmp_path: Path
) -> None:
    def save(engine: Engine, rank: int) -> Any:
        data = _data(sampler, engine)
        for _ in range(2):
            engine.train_batch(data)
        assert engine.save_checkpoint(tmp_path) is True
        return _state(engine)

    saved = _nodes(tiny_config, save, job="ckpt-verify-save")
    _variant(tmp_path / "global_step2", "corrupt", _flip_a_byte)
    _variant(tmp_path / "global_step2", "uncommitted", _uncommit)
    _variant(tmp_path / "global_step2", "old", _as_before_manifests)

    def load(engine: Engine, rank: int) -> Any:
        with pytest.raises(CheckpointError, match=r"corrupt/stage-\d\.pt: sha256 .* \(corrupt\)"):
            engine.load_checkpoint(tmp_path, tag="corrupt")
        with pytest.raises(CheckpointError, match=r"uncommitted/stage-\d\.pt: no manifest, .* never committed"):
            engine.load_checkpoint(tmp_path, tag="uncommitted")
        path, _ = engine.load_checkpoint(tmp_path, tag="old")
        assert path == str(tmp_path / "old") and engine.global_steps == 2
        return _state(engine)

    _assert_identical(saved, _nodes(tiny_config, load, job="ckpt-verify-load"))


def test_load_checkpoint_errors(tiny_config: dict, tmp_path: Path) -> None:
    def body(engine: Engine, rank: int) -> Any:
        assert engine.load_checkpoint(tmp_path / "empty") == (None, None)  # no latest: nothing, as DeepSpeed
        with pytest.raises(FileNotFoundError, match=r"has no stage-\d\.pt \(this node builds stage \d\)"):
            engine.load_checkpoint(tmp_path, tag="missing")
        with pytest.raises(ValueError, match="a checkpoint tag is one folder name"):
            engine.save_checkpoint(tmp_path, tag="a/b")
        return True

    assert _nodes(tiny_config, body, job="ckpt-errors") == {0: True, 1: True}


def test_the_reporting_node_writes_tensorboard_and_csv(
    tiny_config: dict, sampler: GlobalBatchSampler, tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = {**tiny_config, "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "t"},
              "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "t"}}

    def body(engine: Engine, rank: int) -> Any:
        data = _data(sampler, engine)
        losses = [float(engine.train_batch(data)) for _ in range(3)]
        losses.append(float(engine.eval_batch(_data(sampler, engine, 3, 1000))))
        return {"losses": losses, "reports": engine.reports(), "last": engine.last_step}

    results = _nodes(config, body, job="monitors")
    assert [r["reports"] for r in results.values()] == [False, True]  # the last stage of pipeline 0
    losses = results[1]["losses"]
    batch = tiny_config["train_micro_batch_size_per_gpu"] * tiny_config["gradient_accumulation_steps"]
    files = list((tmp_path / "tb" / "t").glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # one writer per job
    events = EventAccumulator(str(files[0]))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars(TRAIN_LOSS)] == [
        (batch * (i + 1), pytest.approx(loss)) for i, loss in enumerate(losses[:3])]
    assert [e.step for e in events.Scalars(LEARNING_RATE)] == [batch, 2 * batch, 3 * batch]
    assert events.Scalars(LEARNING_RATE)[0].value == pytest.approx(0.0)  # WarmupLR's first step runs at min lr
    assert [(e.step, e.value) for e in events.Scalars(EVAL_LOSS)] == [(3 * batch, pytest.approx(losses[3]))]
    assert len(events.Scalars(SAMPLES_PER_SECOND)) == 3 and events.Scalars(SAMPLES_PER_SECOND)[0].value > 0
    with open(tmp_path / "csv" / "t" / "Train_Samples_train_loss.csv") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["step", "train_loss"] and [int(r[0]) for r in rows[1:]] == [batch, 2 * batch, 3 * batch]
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(losses[:3])
    last = results[1]["last"]
    assert last.step == 3 and last.loss == pytest.approx(losses[2]) and last.samples == 3 * batch


def test_wandb_without_the_package_is_a_clear_error(tiny_config: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from bamboo.rc.config import ConfigError, load_config
    from bamboo.rc.monitor import Monitors

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    config = load_config({**tiny_config, "wandb": {"enabled": True, "project": "p"}})
    with pytest.raises(ConfigError, match=r"enables 'wandb', but the wandb package is not installed \(pip install wandb"):
        Monitors(config.monitors)


def test_p1_eval_batch_after_a_failover_covers_the_taken_over_share_given_its_data(
    tiny_config: dict, sampler: GlobalBatchSampler
) -> None:
    """One stage, D = 3 (the shadow ring). Node 2 dies in its first evaluation: the others get NaN (no
    hang), and their next train_batch fails over (node 0, its shadow, takes its share). The next
    evaluation, given the data by global index, covers all 3 shares and equals a run without the failure;
    without it, it is the mean over the two survivors' shares (not that sum over 3 shares: the count of
    microbatches is reduced with the losses). Training stays bit-equal."""

    def own_share_loss_sum(engine: Engine, step: int) -> float:
        layers = engine.executor.slices[0].layers
        layers.eval()
        with torch.no_grad(), torch.random.fork_rng():
            total = sum(float(lm_loss(layers(tokens), labels))
                        for tokens, labels in itertools.islice(_data(sampler, engine, step, 1000), 4))
        layers.train()
        return total

    def body(engine: Engine, rank: int, die: bool) -> Any:
        data = _data(sampler, engine)
        losses = [float(engine.train_batch(data)) for _ in range(2)]
        if die and rank == 2:
            engine.executor.slices[0].layers[0].register_forward_hook(
                lambda module, *_: os._exit(VICTIM_EXIT) if not module.training else None)
        first = float(engine.eval_batch(_data(sampler, engine, 2, 1000)))
        losses.append(float(engine.train_batch(data)))
        given = _microbatch(sampler)
        assert given is not None
        engine.eval_batch(_data(sampler, engine, 3, 1000), microbatch=lambda index: given(3 + 1000, index))
        whole = engine.last_eval_loss  # a float (the returned tensor is float32)
        engine.eval_batch(_data(sampler, engine, 3, 1000))
        without = engine.last_eval_loss
        own = own_share_loss_sum(engine, 3)
        losses.append(float(engine.train_batch(data)))
        return {"first": first, "whole": whole, "without": without, "own": own, "losses": losses,
                "state": _state(engine), "failovers": len(engine.executor.failovers)}

    clean = _nodes(tiny_config, lambda engine, rank: body(engine, rank, False), stages=1, pipelines=3,
                   job="p1-eval-clean", sampler=sampler)
    assert not math.isnan(clean[0]["first"]) and all(v["failovers"] == 0 for v in clean.values())
    assert all(v["whole"] == v["without"] == clean[0]["whole"] for v in clean.values())
    assert clean[0]["whole"] == pytest.approx(sum(v["own"] for v in clean.values()) / 12, rel=1e-12)
    failed = _nodes(tiny_config, lambda engine, rank: body(engine, rank, True), stages=1, pipelines=3,
                    job="p1-eval-kill", victims=(2,), sampler=sampler)
    assert sorted(failed) == [0, 1]
    survivors_mean = (clean[0]["own"] + clean[1]["own"]) / 8
    for survivor in failed.values():
        assert math.isnan(survivor["first"]) and survivor["failovers"] == 1
        assert survivor["whole"] == pytest.approx(clean[0]["whole"], rel=1e-12)
        assert survivor["without"] == pytest.approx(survivors_mean, rel=1e-12)
        assert survivor["losses"] == clean[0]["losses"]
        _assert_identical({0: survivor["state"]}, {0: clean[0]["state"]})


def test_schedule_costs_give_every_node_the_placement_searched_for_them(tiny_config: dict) -> None:
    """`initialize(schedule_costs=...)`: each node runs the placement that `bamboo.schedule` searched for the costs
    (here another order than the unit-cost one on both nodes); without them, the unit-cost placement."""
    costs = Costs.bert_like(2)
    microbatches = tiny_config["gradient_accumulation_steps"]

    def streams(given: Costs | None) -> dict[int, list[str]]:
        def member(rank: int, store: Any) -> list[str]:
            engine = initialize(gpt_layer_specs(SIZE), tiny_config, "eflb", loss_fn=lm_loss, stages=2, rank=rank,
                                world_size=2, store=store, job=f"costs-{given is not None}", timeouts=TIMEOUTS,
                                schedule_costs=given)
            stream = [str(instruction) for instruction in engine.executor.schedule.streams[rank]]
            engine.finish()
            return stream

        with ForkedRanks(2, member) as ranks:
            pass
        return ranks.results

    searched = one_f_one_b(2, microbatches, "eflb", costs.linearizer_cost(), refine=True)
    unit = one_f_one_b(2, microbatches, "eflb")
    assert all(searched.streams[n] != unit.streams[n] for n in (0, 1))
    assert streams(costs) == {n: [str(i) for i in searched.streams[n]] for n in (0, 1)}
    assert streams(None) == {n: [str(i) for i in unit.streams[n]] for n in (0, 1)}
