"""procman: supervised backend processes that recover by themselves.

A generic library: it spawns commands into their own process group, waits for their
health path to answer 200, watches them (exit at once, hangs by failed probes), stops
them (SIGTERM, bounded wait, SIGKILL, reap) and relaunches them with a backoff. It knows
nothing of the HTTP routes it fronts nor of what the processes compute.
"""

from __future__ import annotations

from procman.address import Address, AddressAllocator
from procman.backend import FAILURE_REASONS, Backend, Lease
from procman.errors import (
    BackendClosed,
    BackendUnavailable,
    InBackoff,
    InvalidTransition,
    ProcmanError,
    StartFailed,
    StartInterrupted,
    StartTimeout,
)
from procman.logbuffer import LogBuffer
from procman.manager import BeforeStart, ProcessManager
from procman.notices import Evicted, Notice, Restarted, Rolled, Started, Stopped, Transition
from procman.policy import RestartPolicy, backoff_delay
from procman.prober import HttpProber, Prober
from procman.room import Member, Room, Scope, victims
from procman.spare import SparePool, SpareSpec
from procman.spawner import ProcessHandle, Spawner, SubprocessSpawner
from procman.spec import BackendSpec, FrozenEnv
from procman.states import ALLOWED, LOADED, State

__all__ = [
    "ALLOWED",
    "LOADED",
    "FAILURE_REASONS",
    "Address",
    "AddressAllocator",
    "Backend",
    "BackendClosed",
    "BackendSpec",
    "BackendUnavailable",
    "BeforeStart",
    "Evicted",
    "FrozenEnv",
    "HttpProber",
    "InBackoff",
    "InvalidTransition",
    "Lease",
    "LogBuffer",
    "Member",
    "Notice",
    "ProcessHandle",
    "ProcessManager",
    "Prober",
    "ProcmanError",
    "RestartPolicy",
    "Restarted",
    "Rolled",
    "Room",
    "Scope",
    "SparePool",
    "SpareSpec",
    "Spawner",
    "StartFailed",
    "Started",
    "StartInterrupted",
    "StartTimeout",
    "State",
    "Stopped",
    "SubprocessSpawner",
    "Transition",
    "backoff_delay",
    "victims",
]
