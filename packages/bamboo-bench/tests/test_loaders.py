"""Loader tests: every format in the shared trace folder, the generic CSV round trip, malformed input.

The shared folder holds the EC2 event CSVs, GCP count logs, AWS count curves (seconds and scaled
hours), Auto Scaling Group count CSVs, per-minute delta CSVs (refused: not counts) and SkyPilot
count JSON files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from bamboo.bench.loaders import (
    MAX_INSTANCE_COUNT,
    TraceFormatError,
    load_count_csv,
    load_count_curve,
    load_ec2_events,
    load_gcp_counts,
    load_generic_csv,
    load_skypilot_counts,
    load_trace,
    load_trace_folder,
    write_generic_csv,
)
from bamboo.bench.trace import EventKind


def test_ec2_p3_trace_matches_its_source_notes(traces_dir: Path) -> None:
    trace = load_ec2_events(traces_dir / "bamboo" / "p3-trace.csv", zone="us-east-1")
    summary = trace.summary()
    assert (summary.adds, summary.preemptions, summary.max_alive) == (177, 167, 32)
    assert summary.duration_h == pytest.approx(11.3667, abs=1e-3)
    assert summary.zones == ("us-east-1",)
    first = next(iter(trace))
    assert str(first) == "+node1@us-east-1@0s"
    assert first.kind is EventKind.ADD


def test_ec2_g4dn_trace_matches_its_source_notes(traces_dir: Path) -> None:
    summary = load_trace(traces_dir / "bamboo" / "g4dn-trace.csv").summary()
    assert (summary.adds, summary.preemptions, summary.max_alive) == (79, 74, 24)
    assert summary.zones == ("ec2",)


@pytest.mark.parametrize(
    ("name", "rows", "low", "high"),
    [("a100x1-east1b.txt", 268, 17, 64), ("v100x1-east1c.txt", 1477, 30, 80)],
)
def test_gcp_count_logs_replay_their_counts(traces_dir: Path, name: str, rows: int, low: int, high: int) -> None:
    path = traces_dir / "bamboo" / name
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    assert len(lines) == rows
    trace = load_gcp_counts(path)
    times, counts = trace.alive_series()
    assert counts.max() == high
    assert counts.min() >= low or counts.min() == 0
    # The count after the last event equals the count on the latest row (the log is sorted first).
    latest = max(lines, key=lambda line: line.split(",")[0] + line.split(",")[1])
    assert counts[-1] == int(latest.split(",")[2])
    assert list(times) == sorted(times)


def test_skypilot_multi_zone_counts(traces_dir: Path) -> None:
    folder = traces_dir / "skypilot-spot-traces" / "preemption" / "4-node" / "aws-08-03-2023"
    files = sorted(folder.glob("*.json"))
    trace = load_skypilot_counts(files)
    assert trace.summary().zones == ("us-east-1f", "us-east-2a", "us-west-2c")
    for path in files:
        document = json.loads(path.read_text())
        zone = path.stem.split("_")[0]
        z = trace.zone_names.index(zone)
        mine = trace.zone == z
        assert int(trace.is_add[mine].sum()) - int((~trace.is_add[mine]).sum()) == document["data"][-1]
        gap = document["metadata"]["gap_seconds"]
        assert trace.duration_s >= len(document["data"]) * gap


def test_a_folder_of_skypilot_zones_is_the_multi_zone_trace(traces_dir: Path) -> None:
    folder = traces_dir / "skypilot-spot-traces" / "preemption" / "4-node" / "aws-08-03-2023"
    together, alone = load_trace(folder), load_skypilot_counts(sorted(folder.glob("*.json")))
    assert [str(event) for event in together] == [str(event) for event in alone]
    assert (together.name, together.zone_names, together.duration_s) == (folder.name, alone.zone_names,
                                                                         alone.duration_s)


def test_a_folder_of_dated_logs_starts_every_zone_at_the_earliest_row(tmp_path: Path) -> None:
    (tmp_path / "east1b.txt").write_text("2021-12-11, 10:00:00, 2\n2021-12-11, 10:30:00, 1\n")
    (tmp_path / "east1c.txt").write_text("2021-12-11, 09:00:00, 1\n2021-12-11, 09:10:00, 0\n")
    (tmp_path / "asg.csv").write_text("timestamp,count\n2021-12-11T09:30:00Z,1\n")
    (tmp_path / "events.csv").write_text("time_s,event,node,zone\n60,add,x1,west\n")
    (tmp_path / "README.md").write_text("not a trace\n")
    trace = load_trace_folder(tmp_path)
    assert [str(event) for event in trace] == [
        "+east1c-1@east1c@0s", "+x1@west@60s", "-east1c-1@east1c@600s", "+asg-1@asg@1800s",
        "+east1b-1@east1b@3600s", "+east1b-2@east1b@3600s", "-east1b-2@east1b@5400s"]
    assert trace.duration_s == 5400.0 and trace.name == tmp_path.name


def test_a_folder_refuses_a_node_in_two_files_and_a_folder_without_traces(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("time_s,event,node,zone\n0,add,n1,a\n")
    (tmp_path / "b.csv").write_text("time_s,event,node,zone\n5,add,n1,b\n")
    with pytest.raises(TraceFormatError, match=r"node 'n1' is in both a\.csv and b\.csv"):
        load_trace(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.md").write_text("x\n")
    with pytest.raises(TraceFormatError, match=r"a folder with no trace file in it \(looked for .json, .txt, .csv\)"):
        load_trace(empty)


@pytest.mark.parametrize(
    "relative",
    [
        "availability/1-node/aws-02-15-2023/us-east-1a_v100_1.json",
        "availability/16-node/aws-08-27-2023/us-east-2b_v100_1.json",
        "preemption/1-node/gcp-04-30-2023/us-central1-a_c3-88.json",
    ],
)
def test_skypilot_single_files(traces_dir: Path, relative: str) -> None:
    path = traces_dir / "skypilot-spot-traces" / relative
    data = json.loads(path.read_text())["data"]
    trace = load_trace(path)
    _, counts = trace.alive_series()
    assert counts.max() == max(data)
    changes = sum(abs(b - a) for a, b in zip([0, *data], data, strict=False))
    assert len(trace) == changes


def test_generic_csv_round_trip(traces_dir: Path, tmp_path: Path) -> None:
    trace = load_trace(traces_dir / "bamboo" / "g4dn-trace.csv", zone="us-east-1c")
    out = tmp_path / "g4dn.csv"
    write_generic_csv(trace, out)
    again = load_trace(out)
    assert list(again) == list(trace)
    assert again.duration_s == trace.duration_s


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("0,add,node1\n60000,remove,node2\n", 2, "not alive"),
        ("0,add,node1\nabc,add,node2\n", 2, "'abc'"),
        ("0,add,node1\n0,kill,node2\n", 2, "'kill'"),
        ("0,add,node1\n0,add,node1\n", 2, "added twice"),
        ("60000,add,node1\n0,add,node2\n", 2, "goes back"),
        ("0,add\n", 1, "expected"),
    ],
)
def test_ec2_malformed_lines_name_file_and_line(tmp_path: Path, text: str, line: int, words: str) -> None:
    path = _write(tmp_path, "bad.csv", text)
    with pytest.raises(TraceFormatError) as caught:
        load_ec2_events(path)
    assert caught.value.line == line
    assert str(caught.value).startswith(f"{path}:{line}: ")
    assert words in str(caught.value)


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("2021-12-11, 11:11:30, 5\n2021-12-11, 11:1x:30, 4\n", 2, "bad date"),
        ("2021-12-11, 11:11:30, 5\n2021-12-11, 11:12:30, -1\n", 2, "not a whole number"),
        ("2021-12-11, 11:11:30\n", 1, "expected"),
    ],
)
def test_gcp_malformed_lines(tmp_path: Path, text: str, line: int, words: str) -> None:
    path = _write(tmp_path, "bad.txt", text)
    with pytest.raises(TraceFormatError, match=rf"bad\.txt:{line}: .*{words}"):
        load_gcp_counts(path)


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("time_s,event,node,zone\n1.0,add,n1,z\nx,add,n2,z\n", 3, "not a number"),
        ("time_s,event,node,zone\n1.0,add,n1\n", 2, "4 fields"),
        ("time,event\n", 1, "expected header"),
        ("time_s,event,node,zone\n2.0,add,n1,z\n1.0,remove,n1,z\n", 3, "goes back"),
        ("time_s,event,node,zone\n-1,add,n1,z\n", 2, ">= 0"),
        ("# duration_s=abc\ntime_s,event,node,zone\n", 1, "not a number"),
    ],
)
def test_generic_malformed_lines(tmp_path: Path, text: str, line: int, words: str) -> None:
    path = _write(tmp_path, "bad.csv", text)
    with pytest.raises(TraceFormatError, match=rf"bad\.csv:{line}: .*{words}"):
        load_generic_csv(path)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"metadata": {"gap_seconds": 0}, "data": [1]}', "gap_seconds"),
        ('{"metadata": {"gap_seconds": 30}, "data": [1, "x"]}', r"data\[1\]"),
        ('{"metadata": {"gap_seconds": 30}, "data": [1, -1]}', r": data\[1\] = -1 is a negative instance count"),
        ('{"metadata": {"gap_seconds": 30}, "data": [1, 2, 10001]}',
         r": data\[2\] = 10001 is above the instance-count limit of 10000"),
        ('{"metadata": {"gap_seconds": 30}}', "expected an object"),
        ('{"metadata": [], "data": [1]}', r"'metadata' must be an object with 'gap_seconds', got \[\]"),
        ('{"metadata": null, "data": [1]}', "'metadata' must be an object with 'gap_seconds', got None"),
        ('{"metadata": ', "not JSON"),
    ],
)
def test_skypilot_malformed(tmp_path: Path, text: str, words: str) -> None:
    path = _write(tmp_path, "us-x-1a_v100_1.json", text)
    with pytest.raises(TraceFormatError, match=rf"us-x-1a_v100_1\.json.*{words}"):
        load_skypilot_counts([path])


def test_skypilot_errors_name_the_element_not_a_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "us-x-1a_v100_1.json", '{"metadata": {"gap_seconds": 30}, "data": [3, 2, 1, 0, 1, -2]}')
    with pytest.raises(TraceFormatError) as caught:
        load_skypilot_counts([path])
    assert str(caught.value) == f"{path}: data[5] = -2 is a negative instance count"
    assert caught.value.line is None


def test_counts_above_the_limit_are_refused(tmp_path: Path) -> None:
    assert MAX_INSTANCE_COUNT == 10_000
    with pytest.raises(TraceFormatError, match=r"curve\.csv:2: instance count 1000000 is above the limit of 10000"):
        load_count_curve(_write(tmp_path, "curve.csv", "0,4\n60,1000000\n"))
    with pytest.raises(TraceFormatError, match=r"log\.txt:1: instance count 10001 is above the limit of 10000"):
        load_gcp_counts(_write(tmp_path, "log.txt", "2021-01-01, 00:00:00, 10001\n"))
    assert len(load_count_curve(_write(tmp_path, "edge.csv", "0,10000\n60,0\n"))) == 20_000


def test_a_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    text = "time_s,event,node,zone\n0,add,n0,zone-a\n5,remove,n0,zone-a\n"
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    trace = load_trace(path)
    assert [str(event) for event in trace.events()] == ["+n0@zone-a@0s", "-n0@zone-a@5s"]
    ec2 = tmp_path / "ec2.csv"
    ec2.write_bytes(b"\xef\xbb\xbf0,add,node1\n")
    assert len(load_trace(ec2)) == 1
    sky = tmp_path / "us-x-1a_v100_1.json"
    sky.write_bytes(b"\xef\xbb\xbf" + json.dumps({"metadata": {"gap_seconds": 60}, "data": [2, 1]}).encode())
    assert len(load_trace(sky)) == 3


def test_unknown_format_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        load_trace(_write(tmp_path, "other.csv", "a;b;c\n"))
    with pytest.raises(TraceFormatError, match="no such file"):
        load_trace(tmp_path / "missing.csv")


@pytest.mark.parametrize(
    "name",
    [
        "aws-spot-instances-g4dn-xlarge-us-east-1c-2020-11-20-1930-to-2020-11-21-2200",
        "aws-spot-instances-g4dn-xlarge-us-east-1d-2020-11-23-1730-to-2020-11-24-1530",
        "aws-spot-instances-p2-xlarge-us-east-1e-2020-11-23-1700-to-2020-11-24-0700",
        "aws-spot-instances-p2-xlarge-us-east-1a-2020-11-20-1730-to-2020-11-21-1104",
    ],
)
def test_aws_count_curves_in_seconds_and_scaled_hours_agree(traces_dir: Path, name: str) -> None:
    seconds = load_trace(traces_dir / "bamboo" / f"{name}.csv")
    hours = load_trace(traces_dir / "bamboo" / f"{name}_scaled.csv")
    text = (traces_dir / "bamboo" / f"{name}.csv").read_text()
    rows = [line.split(",") for line in text.splitlines() if line.strip()]
    _, counts = seconds.alive_series()
    assert counts[-1] == int(rows[-1][1])
    assert seconds.duration_s == float(rows[-1][0])
    assert [e.kind for e in seconds] == [e.kind for e in hours]
    # The scaled file rounds hours to 3 decimals: 3.6 s.
    assert np.allclose(seconds.time_s, hours.time_s, atol=3.6)


def test_aws_count_curve_already_in_hours(traces_dir: Path) -> None:
    trace = load_count_curve(traces_dir / "bamboo" / "aws-spot-instances-p2-xlarge-2020-11-20-to-2020-11-23.csv",
                             time_unit_s=3600)
    summary = trace.summary()
    assert summary.duration_h == pytest.approx(88.7, abs=0.1)
    assert summary.max_alive == 16


@pytest.mark.parametrize(
    ("name", "rows"),
    [
        ("full-64-node-trace.csv", 97),  # SOURCE.md counts 98 rows with the header
        ("preempt-trace-GroupInServiceInstances.csv", 305),
        ("preempt-trace-GroupTotalInstances.csv", 305),
        ("preempt-trace-GroupPendingInstances.csv", 305),
        ("preempt-trace-GroupTerminatingInstances.csv", 305),
    ],
)
def test_auto_scaling_group_count_csvs(traces_dir: Path, name: str, rows: int) -> None:
    path = traces_dir / "bamboo" / name
    lines = [line for line in path.read_text().splitlines()[1:] if line.strip()]
    assert len(lines) == rows
    trace = load_trace(path)
    _, counts = trace.alive_series()
    assert counts.max() == max(int(float(line.split(",")[1])) for line in lines)
    assert counts[-1] == int(float(lines[-1].split(",")[1]))


@pytest.mark.parametrize(
    "name", ["full-64-additions-trace.csv", "full-64-terminate-trace.csv", "full-64-found-preemptions.csv"]
)
def test_per_minute_delta_files_are_refused_not_misread(traces_dir: Path, name: str) -> None:
    # These hold additions or terminations per minute, not instance counts.
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        load_trace(traces_dir / "bamboo" / name)


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("timestamp,count\n2021-07-26T18:42:00Z,8\n2021-07-26 18:4x:00,9\n", 3, "bad timestamp"),
        ("time,count\n2021-09-17 04:00:00,2.5\n", 2, "not a whole number"),
        ("time,count\n2021-09-17 04:00:00\n", 2, "expected 'time,count'"),
    ],
)
def test_count_csv_malformed_lines(tmp_path: Path, text: str, line: int, words: str) -> None:
    path = _write(tmp_path, "asg.csv", text)
    with pytest.raises(TraceFormatError, match=rf"asg\.csv:{line}: .*{words}"):
        load_count_csv(path)


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [("0,4\n10,x\n", 2, "not a number"), ("10,4\n5,3\n", 2, "goes back"), ("0,4,1\n", 1, "expected")],
)
def test_count_curve_malformed_lines(tmp_path: Path, text: str, line: int, words: str) -> None:
    path = _write(tmp_path, "curve.csv", text)
    with pytest.raises(TraceFormatError, match=rf"curve\.csv:{line}: .*{words}"):
        load_count_curve(path)
