"""`bamboo-launch agent` and the etcd sources of `watch` and `report`, against a real etcd, without training.

The job's spec is written into etcd directly, so the agent's checks run before anything heavy starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from bamboo.launch.cli import main
from bamboo.launch.events import EtcdEventLog, Join, RunStart, Step
from bamboo.launch.spec import JobSpec
from bamboo.membership import EmbeddedEtcd, EtcdKV, EtcdOptions

LAYER = {"param_bytes": 400, "optimizer_bytes": 800, "compute_cost": 100.0}


def _write_spec(etcd: EmbeddedEtcd, job: str, **changes: object) -> JobSpec:
    fields: dict[str, object] = {"job": job, "stages": 2, "pipelines": 2, "steps": 30, "micro_batches": 4,
                                 "created_unix": 1_700_000_000.0, "layers": [LAYER] * 4, "config": {},
                                 "checkpoint_dir": "/ckpt"}
    fields.update(changes)
    spec = JobSpec(**fields)  # type: ignore[arg-type]
    kv = EtcdKV(EtcdOptions(endpoints=(etcd.endpoint,)))
    kv.put(f"/bamboo/{job}/spec", spec.to_json().encode())
    kv.close()
    return spec


def test_an_agent_whose_flags_conflict_with_the_stored_spec_is_a_one_line_error(
    etcd: EmbeddedEtcd, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    _write_spec(etcd, "conflict")
    status = main(["agent", "--job", "conflict", "--etcd", etcd.endpoint, "--node", "n0", "--run-dir", str(tmp_path),
                   "--stages", "4", "--steps", "30", "--checkpoint-dir", str(tmp_path / "elsewhere")])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "--stages 4 conflicts with the job's stored stages 2" in err
    assert f"--checkpoint-dir {tmp_path / 'elsewhere'} conflicts with the job's stored checkpoint_dir /ckpt" in err
    assert "--steps" not in err  # the same value: no conflict


def test_the_first_agent_needs_the_shape_of_the_job(etcd: EmbeddedEtcd, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["agent", "--job", "fresh-job", "--etcd", etcd.endpoint, "--node", "n0", "--run-dir", str(tmp_path)])
    assert status == 2
    assert "job fresh-job has no spec in etcd yet: the first agent needs --stages and --pipelines" in \
        capsys.readouterr().err


def test_an_agent_beyond_loopback_needs_a_token_or_mutual_tls(etcd: EmbeddedEtcd, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    _write_spec(etcd, "open")
    status = main(["agent", "--job", "open", "--etcd", etcd.endpoint, "--node", "n0", "--run-dir", str(tmp_path),
                   "--host", "0.0.0.0"])
    assert status != 0
    err = capsys.readouterr().err
    assert "0.0.0.0" in err and "token" in err and "Traceback" not in err


def test_agent_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["agent", "--help"])
    out = capsys.readouterr().out
    for flag in ("--job", "--etcd", "--stages", "--pipelines", "--zone", "--k8s-node", "--steps", "--host", "--port",
                 "--checkpoint-dir", "--ttl", "--grace", "--etcd-ca", "--etcd-cert", "--etcd-key", "--etcd-user",
                 "--etcd-password", "--token-file", "--tls-cert", "--tls-key", "--tls-ca", "--insecure"):
        assert flag in out, flag
    lines = [line for line in out.splitlines() if line.strip().startswith("--")]
    assert all(line.strip() for line in lines)


def test_report_and_watch_read_the_event_log_from_etcd(etcd: EmbeddedEtcd, capsys: pytest.CaptureFixture[str]) -> None:
    spec = _write_spec(etcd, "logged")
    kv = EtcdKV(EtcdOptions(endpoints=(etcd.endpoint,)))
    log = EtcdEventLog(kv, "logged", "n0.agent.1", spec.created_unix)
    log.write(RunStart(t=0.0, job="logged", unix_time=spec.created_unix, target_nodes=2, stages=2, pipelines=1))
    log.write(Join(t=0.0, node="n0", zone="a"))
    log.write(Join(t=0.1, node="n1", zone="b"))
    for step in range(1, 6):
        log.write(Step(t=float(step), step=step, samples=8, loss=2.0, nodes_active=2, duration_s=1.0))
    log.close()
    kv.close()
    assert main(["report", "--etcd", etcd.endpoint, "--job", "logged", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == 5 and report["samples"] == 40
    assert main(["watch", "--etcd", etcd.endpoint, "--job", "logged", "--once", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 5
    assert main(["report", "--etcd", etcd.endpoint, "--job", "nothing-here"]) == 2
    assert "job nothing-here has no event records in etcd" in capsys.readouterr().err
    assert main(["report", "--job", "logged"]) == 2
    assert "--job needs --etcd" in capsys.readouterr().err


def test_python_dash_m_bamboo_launch_is_the_command() -> None:
    import subprocess

    done = subprocess.run([sys.executable, "-m", "bamboo.launch", "agent", "--help"], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0 and "bamboo-launch agent --job J" in done.stdout


def test_finish_asks_a_job_once_and_refuses_a_job_that_does_not_exist(
    etcd: EmbeddedEtcd, capsys: pytest.CaptureFixture[str],
) -> None:
    from bamboo.launch.finish import finish_requested
    from bamboo.launch.records import JobEnd
    from bamboo.membership import MembershipStore

    assert main(["finish", "--etcd", etcd.endpoint, "--job", "nobody"]) == 2
    assert "has no job 'nobody'" in capsys.readouterr().err
    assert main(["finish", "--job", "x"]) == 2
    assert "give the job's --etcd URL and --job name" in capsys.readouterr().err
    _write_spec(etcd, "to-finish")
    assert main(["finish", "--etcd", etcd.endpoint, "--job", "to-finish", "--by", "alice"]) == 0
    assert "asked job to-finish to finish at its next step boundary" in capsys.readouterr().out
    assert main(["finish", "--etcd", etcd.endpoint, "--job", "to-finish", "--by", "bob"]) == 0
    assert "was asked to finish already, by alice" in capsys.readouterr().out
    kv = EtcdKV(EtcdOptions(endpoints=(etcd.endpoint,)))
    try:
        membership = MembershipStore(kv, "to-finish")
        request = finish_requested(membership)
        assert request is not None and request.by == "alice"
        _write_spec(etcd, "ended")
        MembershipStore(kv, "ended").decide("end", JobEnd(steps=12, node="n0").to_dict())
    finally:
        kv.close()
    assert main(["finish", "--etcd", etcd.endpoint, "--job", "ended"]) == 0
    assert "has ended already, after 12 steps" in capsys.readouterr().out
