"""bench/hostile.py on the tiny pair: every probe of issue 56 refused or harmless, judged by status
(the bar on the normal request's latency is for the real pair's run, not a unit test's timing)."""

import json

from omnidraft_mlx.bench.hostile import HANGUP_TEXT
from omnidraft_mlx.bench.hostile import main as hostile


def test_the_hostile_bench_runs_on_the_tiny_pair(tiny_dirs, tmp_path, monkeypatch):
    # The tiny pair would decode the hang-up probe's whole reply before its client hangs up:
    # its rounds are slowed (a failpoint aimed at that request only).
    monkeypatch.setenv("OMNIDRAFT_FAILPOINTS", f"draft#{HANGUP_TEXT[:40]}~0.05")
    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    argv = ["--draft", str(tiny_dirs["draft"]), "--target", str(tiny_dirs["target"]), "--alone", "2"]
    argv += ["--flood", "60", "--body-mb", "12", "--hangup-after", "1", "--out", str(out)]
    try:
        hostile(argv)
    except SystemExit:  # a latency check failed: not judged here
        pass
    result = json.loads((out / "hostile.json").read_text())
    for name, ok in result["checks"].items():
        assert ok or "its time alone" in name, (name, result["probes"])
    probes = result["probes"]
    assert list(probes) == [
        *("long-stops", "big-body", "foreign-host", "cross-site-post", "deep-nesting"),
        *("flood", "second-key", "hang-up"),
    ]
    flood = probes["flood"]["probe"]["statuses"]
    assert sum(flood.values()) == 60 and flood.get("429", 0) > 0  # past mallory's --max-per-client share
    assert probes["long-stops"]["probe"]["sent"] >= 1 and probes["hang-up"]["probe"]["cancelled"] == 1
    table = (out / "README.md").read_text()
    assert all(f"| {name} |" in table for name in probes)
