"""The benchmark's flags, metric and report (no GPU): the same numbers and format as
`epcomm bench`."""

import json

import pytest

from epcomm import bench


def test_defaults_are_deepeps_workload():
    a = bench.parse_args([])
    assert (a.tokens, a.hidden, a.top_k, a.experts, a.sms, a.iters, a.warmup) == (4096, 7168, 8, 256, 24, 50, 5)
    assert (a.transport, a.schedule, a.routes) == ("ipc", "epoch", "auto")
    for bad in (["--tokens", "0"], ["--iters", "-1"], ["--world", "0"], ["--json", "--csv"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_metric_is_deepeps():
    # As epcomm_check::timing::BenchOp::metric_bytes: FP8 counts a byte per value plus a
    # 4-byte scale per 128 values.
    assert bench.metric_bytes("dispatch_bf16", 10, 128) == 2560
    assert bench.metric_bytes("dispatch_fp8", 10, 128) == 1280 + 40
    assert bench.metric_bytes("combine_bf16", 10, 128) == 2560
    assert bench.median([3.0, 1.0, 2.0]) == 2.0
    assert bench.median([4.0, 1.0, 2.0, 3.0]) == 2.5


REPORT = {
    "schema": "epcomm-bench/2",
    "config": dict(
        world=2, transport="ipc", schedule="epoch", routes="auto", tokens=4096, hidden=7168, top_k=8, experts=256,
        sms=[24], iters=50, warmup=5, fp8=True, gpu_sms=132, gpu_name="GPU",
    ),
    "results": [dict(op="dispatch_bf16", sms=24, time_us=213.04, gbps=548.12, recv_rows=8150, rank_time_us=[213.04, 212.5])],
}


def test_reports_like_the_cli():
    table = bench.render(REPORT, bench.parse_args([]))
    lines = table.splitlines()
    assert lines[0] == "epcomm bench (Python API): 2 x GPU (132 SMs each), ipc transport, epoch schedule, auto routes"
    assert lines[3].split() == ["op", "SMs", "us", "GB/s", "us", "per", "rank"]
    assert lines[4].split()[:5] == ["dispatch", "BF16", "24", "213.0", "548.1"]
    csv = bench.render(REPORT, bench.parse_args(["--csv"])).splitlines()
    assert csv[1] == "dispatch_bf16,24,213.040,548.120,8150,2,ipc,epoch,auto,4096,7168,8,256,50,5"
    assert json.loads(bench.render(REPORT, bench.parse_args(["--json"]))) == REPORT
