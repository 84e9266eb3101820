"""The randomized resumption stress (tests/resume_stress.py), short: every stitched stream is the
unbroken answer, or a prefix of it ended by an error event. ``make test`` runs one round (its streams'
process hung by SIGSTOP); ``make stress`` runs it for minutes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.resume_stress import run_stress

pytestmark = pytest.mark.timeout(600)


async def test_resumed_streams_are_exact_under_hangs_and_rolling_changes(tmp_path: Path) -> None:
    seconds = float(os.environ.get("OVROUTER_STRESS_S", "0"))  # make test: one round (a hang); make stress: minutes
    seed = int(os.environ.get("OVROUTER_STRESS_SEED", "1"))
    streams = int(os.environ.get("OVROUTER_STRESS_STREAMS", "12"))
    figures = await run_stress(tmp_path, seconds, seed, streams)
    print(f"stress: seed {seed}, {figures.rounds} rounds, {figures.streams} streams ({figures.resumed} resumes, "
          f"{figures.retried} retries), {figures.exact} exact, {figures.errors} ended by an error event "
          f"{figures.codes}; scenarios {figures.scenarios}")
    assert not figures.problems, "\n".join(figures.problems[:5])
    assert figures.rounds >= 1 and figures.exact > 0
