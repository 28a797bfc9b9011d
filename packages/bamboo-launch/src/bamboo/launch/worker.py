"""One training worker of ``bamboo-launch run``: the bamboo-rc engine for one (stage, pipeline).

Its node's agent spawns it as ``python -m bamboo.launch.worker --spec RUN.json --rank R --agent
HOST:PORT``, in the agent's process group (a market kill takes both). The worker

- reaches the shared c10d store over etcd (`bamboo.membership.EtcdStore` under
  ``/bamboo/<job>/c10d/rc/``), so groups form and re-form with no store host to lose;
- learns of confirmed failures through :class:`bamboo.launch.authority.MembershipFailureNotices`
  (suspicions go to its agent's failure detector);
- trains the built-in example (the tiny GPT of bamboo-rc) with exact arithmetic for the run's
  steps, appending ``step`` records (from the host of the last stage of pipeline 0) and
  ``failover`` records (from the shadow that took a victim's stage) to the run's event log;
- writes its final state to ``<run>/out/rank<R>.pt`` and ends with a flush and ``os._exit``.

Exit status: 0 done; 3 a consecutive failure stopped its pipeline (reconfiguration is the
launcher's business; see the package README for what is supported); 1 any other error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import attrs

__all__ = ["RunSpec", "main", "train"]


@attrs.frozen
class RunSpec:
    """What every worker of a run shares (written once by the launcher as ``RUN.json``)."""

    job: str
    etcd: tuple[str, ...] = attrs.field(converter=tuple)
    stages: int
    pipelines: int
    steps: int
    node_of_rank: dict[int, str] = attrs.field(converter=lambda m: {int(k): str(v) for k, v in m.items()})
    out_dir: str
    events: str
    run_start: float
    redundancy: str = "eflb"
    size: dict[str, int] = attrs.field(factory=dict)
    config: dict[str, Any] = attrs.field(factory=dict)
    seed: int = 0
    etcd_user: str | None = None
    etcd_password: str | None = attrs.field(default=None, repr=False)
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    confirm_timeout_s: float = 60.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    group_timeout_s: float = 60.0

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls(**json.loads(text))


def _failover_records(executor: Any, seen: int) -> list[dict[str, Any]]:
    """The failovers this node took a victim's stage in, among those recorded since ``seen``."""
    records = []
    stages = executor.layout.stages
    for failover in executor.failovers[seen:]:
        for victim in failover["victims"].get(executor.pipeline, []):
            if (victim - 1) % stages == executor.stage:
                records.append({"victim": victim, "pause_s": failover["detect_s"] + failover["reroute_s"]})
    return records


def train(spec: RunSpec, rank: int, agent_address: str | None) -> dict[str, Any]:
    """Train as global rank ``rank`` of the run; returns the report also written to disk."""
    import torch
    from bamboo.launch.authority import MembershipFailureNotices
    from bamboo.launch.events import EventLog, Failover, Step
    from bamboo.membership import AgentClient, EtcdKV, EtcdOptions, EtcdStore, c10d_prefix
    from bamboo.rc import CommTimeouts, ConsecutiveFailure, initialize, load_config
    from bamboo.rc.data import GlobalBatchSampler, pipeline_data_iter
    from bamboo.rc.model import GPTSize, gpt_layer_specs, lm_loss
    from bamboo.rc.worker import exact_mode

    exact_mode()
    size = GPTSize(**spec.size)
    config = load_config(spec.config, pipelines=spec.pipelines)
    kv = EtcdKV(EtcdOptions(endpoints=spec.etcd, user=spec.etcd_user, password=spec.etcd_password,
                            ca_cert=spec.etcd_ca, cert_cert=spec.etcd_cert, cert_key=spec.etcd_key))
    timeouts = CommTimeouts(group=spec.group_timeout_s, confirm=spec.confirm_timeout_s)
    store = EtcdStore(kv, c10d_prefix(spec.job, "rc"), timeout=datetime.timedelta(seconds=timeouts.build))
    agent = AgentClient(agent_address, name=f"worker-{rank}") if agent_address else None
    notices = MembershipFailureNotices(store, spec.job, agent, spec.node_of_rank)
    engine = initialize(
        gpt_layer_specs(size), spec.config, spec.redundancy, loss_fn=lm_loss, stages=spec.stages, rank=rank,
        world_size=spec.stages * spec.pipelines, store=store, seed=spec.seed, job=spec.job, timeouts=timeouts,
        notices=notices if spec.redundancy != "none" else None,
    )
    executor = engine.executor
    sampler = GlobalBatchSampler(config.micro_batch_size, size.sequence, seed=spec.seed)
    data = pipeline_data_iter(sampler, executor.pipeline, config.micro_batches)
    samples = config.micro_batch_size * config.micro_batches * spec.pipelines
    log = EventLog(spec.events, start=spec.run_start)
    node = spec.node_of_rank[rank]
    checkpointers: dict[int, Any] = {}  # stage -> its shard's writer (pipeline 0 writes one shard per stage)

    def checkpoint(step: int) -> None:
        from bamboo.launch.checkpoint import AsyncCheckpointer
        from bamboo.launch.events import Checkpoint

        def committed(info: Any) -> None:
            log.write(Checkpoint(t=log.now(), step=info.step, path=str(info.path), bytes=info.bytes,
                                 duration_s=info.duration_s))

        for stage in executor.hosted:  # a shadow that took over a stage writes that stage's shard too
            if stage not in checkpointers:
                checkpointers[stage] = AsyncCheckpointer(spec.checkpoint_dir, shard=f"stage-{stage}",
                                                         every_steps=spec.checkpoint_every, on_commit=committed)
            checkpointers[stage].maybe_save(step, lambda stage=stage: {
                "state": torch.frombuffer(bytearray(executor.slices[stage].state_bytes()), dtype=torch.uint8)})

    consecutive: str | None = None
    seen_failovers = 0
    started = time.perf_counter()
    try:
        for _ in range(spec.steps):
            step_started = time.perf_counter()
            loss = float(engine.train_batch(data))
            duration = time.perf_counter() - step_started
            for record in _failover_records(executor, seen_failovers):
                victim_rank = executor.layout.rank(record["victim"], executor.pipeline)
                log.write(Failover(t=log.now(), victim=spec.node_of_rank.get(victim_rank, str(victim_rank)),
                                   shadow=node, stage=record["victim"], pause_s=record["pause_s"]))
            seen_failovers = len(executor.failovers)
            if spec.checkpoint_dir is not None and executor.pipeline == 0:
                checkpoint(executor.step)
            if executor.pipeline == 0 and spec.stages - 1 in executor.hosted:
                active = spec.stages * spec.pipelines - len(executor.dead)
                log.write(Step(t=log.now(), step=executor.step, samples=samples, loss=loss,
                               nodes_active=active, duration_s=duration))
        engine.finish()
        for writer in checkpointers.values():
            writer.close()
    except ConsecutiveFailure as failure:
        consecutive = str(failure)
        executor.apply_replica_updates()
    report = {
        "rank": rank,
        "node": node,
        "stage": executor.stage,
        "pipeline": executor.pipeline,
        "hosted": list(executor.hosted),
        "slices": {stage: [layer.state_dict() for layer in piece.layers] for stage, piece in executor.slices.items()},
        "replica_stage": executor.replica_stage,
        "losses": executor.losses,
        "steps_done": executor.step,
        "failovers": executor.failovers,
        "consecutive": consecutive,
        "seconds": time.perf_counter() - started,
    }
    path = Path(spec.out_dir) / f"rank{rank}.pt"
    torch.save(report, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)  # the launcher polls for this file: never a partial one
    log.close()
    if consecutive is not None:
        print(consecutive, file=sys.stderr)
    return report


def main(argv: list[str] | None = None) -> None:
    """Entry point (never returns: ends with ``os._exit``, see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m bamboo.launch.worker",
                                     description="One bamboo-launch worker (started by its node's agent).")
    parser.add_argument("--spec", required=True, help="the run's RUN.json, written by bamboo-launch run")
    parser.add_argument("--rank", type=int, required=True, help="this worker's global rank (pipeline * P + stage)")
    parser.add_argument("--agent", default=None, help="HOST:PORT of this node's agent (failure reports)")
    args = parser.parse_args(argv)
    code = 0
    try:
        report = train(RunSpec.from_json(Path(args.spec).read_text()), args.rank, args.agent)
        code = 3 if report["consecutive"] is not None else 0
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
