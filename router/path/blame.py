"""Whose fault was a backend's death: the request's, or not — and so what the router does next.

A request whose process dies under it is *innocent* when the death plausibly was not its
doing: an external signal killed the process (``kill -9``, the OOM killer), the device
failed (a fatal engine error, a stalled generation), or other requests were in flight
too. An innocent request is retried once on the fresh process (a non-streamed one with
nothing sent yet) or its stream is resumed (up to ``max_resumes``). A request that was
alone in a process that crashed or hung on its own is the likely cause (a *poison*
request): it is answered at once, naming itself as the cause, and never sent again — as
is a request that already had its second chance and took a second process down with it
alone. A second death shared with other requests blames none of them (a poison neighbour
retried beside them is as likely): each goes again, in the suspect lane, while its tries last
(router/path/recovery.py: two more than its budget for shared deaths), then gets an ordinary 502.

The death and its predicates (``Death``, ``external``, ``innocent``) are procman's
(:mod:`procman.deaths`): the same record and the same policy that decide whether a death
counts toward the backoff. This module adds the router's part, the verdict.

*Suspects* (:func:`suspect`): the requests of a death shared by several, not caused from
outside. One of them may be the poison, so their second tries run one at a time (the
router's suspect lane, :mod:`router.path.recovery`): an innocent one is served, and the poison
one takes down at most itself and whatever ordinary request happened to run beside it
(whose own first death makes it a suspect in turn). This holds for a hang too: a hang
shared by several requests retries each of them (a non-streamed one included), one at a
time, where a hang alone names the request at once (it would hang the fresh process too).
A stream that was already receiving tokens when its process hung is resumed (the request
ran; the device stopped). Pure: no I/O.
"""

from __future__ import annotations

from typing import Literal

from procman.deaths import Death, external, innocent

__all__ = ["Verdict", "suspect", "verdict"]

Verdict = Literal["again", "blame"]


def verdict(death: Death, *, second: bool, streaming: bool) -> Verdict:
    """``again`` (retry or resume on the fresh process if the request has a try left, else an ordinary 502)
    or ``blame`` (the request is the likely cause: ``request_crashed_model``, never sent again).

    ``second``: the request already had a retry or resume; ``streaming``: its stream had started.
    """
    if second:  # named the cause only when it took a process down alone
        if external(death) or death.in_flight > 1:
            return "again"  # not its doing, or a neighbour's as likely: again (in the suspect lane) while tries last
        return "blame"
    if death.cause == "hang" and streaming:
        return "again"  # tokens were flowing when it hung: the device, not the request
    if not innocent(death):
        return "blame"
    return "again"  # a hang too, when shared: the retries of suspects run one at a time


def suspect(death: Death) -> bool:
    """The request shared this death with others and no outside signal caused it: a neighbour may be the
    poison, so its next try runs in the suspect lane, one at a time."""
    return death.in_flight > 1 and not external(death)
