"""Steps: how an op that waits for the loop says so, as data.

A handler (ops/) returns its reply's result, a Generation it started, or a `Then`: a job for the
engine loop to run (turns.Encode, turns.Prefill, turns.Acknowledge, a StoreWrite to wait for) and
the plain function to give its outcome to, which returns the same kinds of things again. The loop
(Runtime._run) is the only code that sequences: it runs the job, then calls `then` with the outcome
(or `fail` with the job's error), and so on until a result. Nothing is suspended in between: what a
waiting op holds is its Then record.

`after` chains steps (one op's steps, then the next), `guarded` puts a try/except around them, jobs they
wait for included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(eq=False)
class Then:
    """A job for the loop, and what the op does with its outcome (the result, or the next Then).
    fail: what it does with the job's error (None: the error is the op's)."""

    job: object
    then: Callable[[object], object]
    fail: Callable[[BaseException], object] | None = None

    def resume(self, outcome=None, error: BaseException | None = None):
        """The op's next step, given the job's outcome or its error."""
        if error is None:
            return self.then(outcome)
        if self.fail is None:
            raise error
        return self.fail(error)


def wait(job) -> Then:
    """Wait for a job; its outcome is the result."""
    return Then(job, lambda outcome: outcome)


def after(step, then: Callable):
    """Give the result of `step` (a result, or a Then) to `then`, once the jobs it waits for are done."""
    if not isinstance(step, Then):
        return then(step)
    return Then(step.job, lambda outcome: after(step.then(outcome), then),
                None if step.fail is None else lambda error: after(step.fail(error), then))


def guarded(run: Callable[[], object], on_error: Callable[[BaseException], object]):
    """`run()`'s steps, any failure among them (the jobs' included) handed to `on_error`: the
    steps' try/except."""
    try:
        step = run()
    except BaseException as e:
        return on_error(e)
    if not isinstance(step, Then):
        return step
    return Then(step.job, lambda outcome: guarded(lambda: step.then(outcome), on_error),
                lambda error: guarded(lambda: step.resume(error=error), on_error))
