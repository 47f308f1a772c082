"""The derived-drafter benchmark end to end on tiny models: files, records, consistency."""

import json
import sys

from test_bench import home  # noqa: F401  (fixture: empty OMNIDRAFT_HOME that finds the task data)
from test_derive import SMALL

from omnidraft_mlx.bench import derived
from omnidraft_mlx.models import derive as d


def test_derived_bench_end_to_end(tiny_dirs, home, tmp_path, monkeypatch):  # noqa: F811
    draft, target = str(tiny_dirs["draft"]), str(tiny_dirs["target"])
    d.derive(d.DeriveConfig(source=draft, layers=1, name="tiny-1l", minutes=0, **SMALL), progress=False)
    out = tmp_path / "out"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "derived",
            "--derived",
            "tiny-1l",
            "--full",
            draft,
            "--target",
            target,
            "--big-target",
            target,
            "--depths",
            "1",
            "--k",
            "2,3",
            "--prompts",
            "1",
            "--max-tokens",
            "8",
            "--cost-rounds",
            "1",
            "--adapted",
            "--out",
            str(out),  # no profiles yet: the adapted drafters decode as they are
        ],
    )
    derived.main()
    assert (out / "derived.png").stat().st_size > 0
    result = json.loads((out / "derived.json").read_text())
    assert list(result["summary"]) == [
        "plain",
        "full-k4",
        "derived-k2",
        "derived-k3",
        "full-adapted-k4",
        "derived-adapted-k2",
        "derived-adapted-k3",
    ]
    assert {"drafter cut to 1 layers", "tiny-1l", draft, target} == set(result["cost_ms"])
    assert result["derived_info"]["kept_layers"] in ([0], [1])
    records = result["records"]
    assert len(records) == len(result["prompt_ids"]) * 7 == 21  # one prompt per task, complete, math and chat
    # Greedy: every speculative output is the target's own.
    assert all(r["equal_to_plain"] for r in records)
    for label, rows in result["summary"].items():
        assert list(rows) == ["complete", "math", "chat", "all"]
        for task, row in rows.items():
            mine = [r for r in records if r["method"] == label and task in ("all", r["task"])]
            assert row["tokens"] == sum(r["tokens"] for r in mine) and row["prompts"] == len(mine)
            assert row["tokens_per_forward"] >= 1.0
