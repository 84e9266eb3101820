"""`make bench` still runs: the harness in its tiny --quick mode. No timing assertions — numbers are the bench's job.

The asyncio load generator is forced so that the test does not depend on wrk/nginx being
installed (nginx is used when present, skipped otherwise); the report goes to a temp dir.
The real-model sections (model, coldstart) are left out: with their model loads they take
minutes on a 2-core machine; `python -m bench --quick --only model coldstart` runs them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKE_SECTIONS = ["overhead", "streaming", "recovery", "memory", "scale"]


def _bench(out: Path, sections: list[str], timeout_s: float) -> dict[str, dict[str, object]]:
    argv = [sys.executable, "-m", "bench", "--quick", "--loadgen", "asyncio", "--out", str(out), "--only", *sections]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out / "latest.md").read_text()
    assert report.startswith("# ovrouter benchmark")
    raw = json.loads((out / "latest.json").read_text())
    return {s["key"]: s for s in raw["sections"]}


@pytest.mark.timeout(330)
def test_quick_bench_runs_every_fake_section(tmp_path: Path) -> None:
    sections = _bench(tmp_path, FAKE_SECTIONS, 300)  # ~40 s on 2 busy cores; far slower on a loaded machine
    assert list(sections) == FAKE_SECTIONS
    for key, section in sections.items():
        assert section["status"] == "ok", (key, section["notes"])
        assert section["tables"] and all(t["rows"] for t in section["tables"]), key
    for plot in ("overhead_throughput.png", "overhead_latency.png", "streaming.png", "recovery.png"):
        assert (tmp_path / plot).stat().st_size > 1000, plot

