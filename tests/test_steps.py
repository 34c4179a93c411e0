"""Steps (ellmd/runtime/steps.py): what an op that waits returns, run by the engine loop alone."""

import inspect

import pytest

from ellmd.runtime.ops import RUNTIME_OPS
from ellmd.runtime.steps import Then, after, guarded, wait


def drive(step, outcomes):
    """Run steps as the loop does: each job's outcome from `outcomes` (an exception: its error)."""
    jobs = []
    while isinstance(step, Then):
        jobs.append(step.job)
        outcome = outcomes[step.job]
        step = step.resume(error=outcome) if isinstance(outcome, Exception) else step.resume(outcome)
    return jobs, step


def test_no_handler_is_a_generator():
    """Handlers return a result or steps; none suspends itself for a trampoline to resume."""
    generators = [name for name, op in RUNTIME_OPS.items() if inspect.isgeneratorfunction(op.handler)]
    assert generators == []


def test_after_chains_each_outcome_into_the_next_step():
    step = after(Then("encode", lambda text: Then("prefill", lambda logits: f"{text}+{logits}")),
                 lambda result: {"result": result})
    jobs, result = drive(step, {"encode": "ids", "prefill": "logits"})
    assert jobs == ["encode", "prefill"]
    assert result == {"result": "ids+logits"}
    assert after(None, lambda result: ("at once", result)) == ("at once", None)


def test_guarded_handles_a_failed_job_and_a_failing_step_after_one():
    undone = []

    def undo(error):
        undone.append(str(error))
        raise error

    failing_job = guarded(lambda: after(wait("prefill"), lambda _: "appended"), undo)
    with pytest.raises(ValueError, match="no room"):
        drive(failing_job, {"prefill": ValueError("no room")})

    def fails(_):
        raise KeyError("turn")
    failing_step = guarded(lambda: Then("write", fails), undo)
    with pytest.raises(KeyError):
        drive(failing_step, {"write": "done"})
    assert undone == ["no room", "'turn'"]

    jobs, result = drive(guarded(lambda: wait("write"), undo), {"write": "on disk"})
    assert (jobs, result, len(undone)) == (["write"], "on disk", 2)


def test_a_step_recovers_from_its_job_error_before_guarded_sees_it():
    settled = Then("pending write", lambda _: "kept", fail=lambda error: "snapshot again")
    step = guarded(lambda: settled, lambda error: pytest.fail(f"not recovered: {error}"))
    assert drive(step, {"pending write": OSError("disk full")}) == (["pending write"], "snapshot again")
