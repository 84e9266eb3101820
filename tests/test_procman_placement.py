"""procman.placement.place: memory budgets per device, as a table."""

from __future__ import annotations

import pytest

from procman.placement import Holder, Placement, format_bytes, place, waiting_words

M = 1024 * 1024
NOW = 1000.0
BUDGET = {"CPU": 1000 * M, "GPU.0": 2000 * M}


def idle(name: str, size_mb: int, last_used: float, device: str = "CPU", **kw: object) -> Holder:
    return Holder(name, device, size_mb * M, idle=True, last_used=last_used, **kw)  # type: ignore[arg-type]


def busy(name: str, size_mb: int, device: str = "CPU", **kw: object) -> Holder:
    return Holder(name, device, size_mb * M, idle=False, last_used=NOW, **kw)  # type: ignore[arg-type]


CASES: list[tuple[str, int, list[Holder], Placement]] = [
    # (id, size of the new model in MiB on CPU, holders, expected)
    ("fits_empty", 300, [], Placement(True)),
    ("fits_beside", 300, [idle("a", 300, 1), idle("b", 300, 2)], Placement(True)),
    ("fits_exactly", 400, [idle("a", 300, 1), idle("b", 300, 2)], Placement(True)),
    ("evict_one_lru", 300, [idle("a", 300, 5), idle("b", 300, 1), idle("c", 300, 9)],
     Placement(False, stop=("b",), wait="stopping")),
    ("evict_several", 700, [idle("a", 300, 5), idle("b", 300, 1), idle("c", 300, 9)],
     Placement(False, stop=("b", "a"), wait="stopping")),
    ("busy_skipped", 300, [busy("a", 300), idle("b", 300, 7), busy("c", 300)],
     Placement(False, stop=("b",), wait="stopping")),
    ("pinned_skipped", 300, [idle("a", 300, 1, pinned=True), idle("b", 300, 7), idle("c", 300, 8)],
     Placement(False, stop=("b",), wait="stopping")),
    ("young_skipped", 300, [idle("a", 300, 1, evictable_at=NOW + 5), idle("b", 300, 7), idle("c", 300, 8)],
     Placement(False, stop=("b",), wait="stopping")),
    ("only_young_wait", 300, [idle("a", 300, 1, evictable_at=NOW + 5), idle("b", 300, 2, evictable_at=NOW + 3),
                              busy("c", 300)],
     Placement(False, wait="young", retry_at=NOW + 3)),
    ("all_busy_wait", 300, [busy("a", 300), busy("b", 300), busy("c", 300)], Placement(False, wait="busy")),
    ("stopping_counts_until_exited", 300, [idle("a", 300, 1, going=True), busy("b", 300), busy("c", 300)],
     Placement(False, wait="stopping")),
    ("stopping_not_stopped_twice", 600, [idle("a", 300, 1, going=True), idle("b", 300, 2), busy("c", 300)],
     Placement(False, stop=("b",), wait="stopping")),
    ("starting_counts", 300, [Holder("a", "CPU", 800 * M, starting=True)], Placement(False, wait="compiling")),
    ("never_bigger_than_budget", 1200, [],
     Placement(False, never="cannot start new: new needs 1.2 GiB, more than memory_budget CPU: 1000 MiB")),
    ("never_beside_pinned", 500, [idle("p", 600, 1, pinned=True)],
     Placement(False, never="cannot start new: new needs 500 MiB and pinned p (600 MiB) hold 600 MiB, "
                            "more than memory_budget CPU: 1000 MiB")),
]


@pytest.mark.parametrize(("size_mb", "holders", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_place(size_mb: int, holders: list[Holder], expected: Placement) -> None:
    assert place("new", "CPU", size_mb * M, holders, BUDGET, NOW) == expected


def test_other_devices_do_not_count() -> None:
    holders = [idle("g", 1900, 1, device="GPU.0"), idle("c", 900, 1)]
    assert place("new", "GPU.0", 100 * M, holders, BUDGET, NOW) == Placement(True)
    assert place("new", "CPU", 100 * M, holders, BUDGET, NOW) == Placement(True)


def test_a_device_without_budget_always_fits() -> None:
    assert place("new", "NPU", 10**12, [idle("a", 10**6, 1, device="NPU")], BUDGET, NOW) == Placement(True)
    assert place("new", None, 10**12, [], BUDGET, NOW) == Placement(True)


def test_compiles_are_serialised_per_device() -> None:
    gpu_start = Holder("a", "GPU.0", 100 * M, starting=True)
    assert place("new", "GPU.0", 100 * M, [gpu_start], BUDGET, NOW).wait == "compiling"
    assert place("new", "CPU", 100 * M, [gpu_start], BUDGET, NOW) == Placement(True)  # other device
    assert place("new", "GPU.0", 100 * M, [gpu_start], BUDGET, NOW, serialize=False) == Placement(True)
    leaving = Holder("a", "GPU.0", 100 * M, starting=True, going=True)
    assert place("new", "GPU.0", 100 * M, [leaving], BUDGET, NOW) == Placement(True)


def test_waiters_are_served_in_order() -> None:
    assert place("new", "CPU", 100 * M, [], BUDGET, NOW, queued_ahead=True) == Placement(False, wait="queued")


def test_the_target_itself_does_not_count() -> None:
    assert place("new", "CPU", 900 * M, [Holder("new", "CPU", 900 * M, starting=True)], BUDGET, NOW).fits


def test_never_is_reported_before_any_wait() -> None:
    result = place("new", "CPU", 2000 * M, [busy("a", 300)], BUDGET, NOW, queued_ahead=True)
    assert result.never is not None and "memory_budget CPU" in result.never


def test_format_bytes() -> None:
    assert [format_bytes(x) for x in (512, 2048, 300 * M, 1536 * M)] == ["512 B", "2 KiB", "300 MiB", "1.5 GiB"]


def test_counts_never_stop_a_pinned_model() -> None:
    from procman.room import Member, Room, Scope, victims

    scope = Scope("all models", 2, frozenset("abc"))
    pinned = Member("a", idle=True, last_used=0.0, pinned=True)
    assert victims("c", [pinned, Member("b", idle=True, last_used=5.0)], [scope]) == Room(("b",), False)
    assert victims("c", [pinned, Member("b", idle=False, last_used=5.0)], [scope]) == Room((), False, scope)


def test_waiting_words_name_the_need_the_use_and_each_holder_on_the_device() -> None:
    holders = [busy("m2", 300), idle("m3", 300, 1, starting=True), idle("m4", 300, 2, going=True),
               busy("gpu", 500, device="GPU.0"), busy("m1", 100)]
    words = waiting_words("m1", "CPU", 300 * M, 1024 * M, holders, "busy")
    assert words == ("waiting for memory: needs 300 MiB, 900 MiB of 1 GiB CPU in use by m2 (busy), m3 (starting), "
                     "m4 (stopping); the others are busy")
    alone = waiting_words("m1", "CPU", M, M, [], None)
    assert alone == "waiting for memory: needs 1 MiB, 0 B of 1 MiB CPU in use by nothing"
