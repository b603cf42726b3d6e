"""How many of raysb's functions one training step runs: the hot path kept short and flat.

The count: build the engine as tests/test_epoch_plans.py's `engine_for` does (a small CNN on the CPU,
the strategy's defaults), train epoch 0, then trace epoch 1 with `sys.setprofile` and collect, between
every two consecutive optimizer steps (`Optimizer.register_step_post_hook`), the distinct raysb
functions called: (file, qualified name) of every Python code object entered whose file is under
raysb/, comprehensions, generator expressions, lambdas and generator resumptions included, each
counted once a window however often it runs. The count is the largest window's (the first window,
before the epoch's first step, and the last, after its last, are not between two steps). Nothing of
raysb's is left out.
"""

from __future__ import annotations

import sys

import pytest

from test_epoch_plans import engine_for


def functions_a_step(strategy: str) -> set[tuple[str, str]]:
    """The distinct raysb functions of the largest window between two optimizer steps in epoch 1."""
    engine = engine_for(strategy)
    engine.train_epoch(0)
    windows: list[set[tuple[str, str]]] = [set()]

    def called(frame, event, arg):
        if event == "call" and "/raysb/" in frame.f_code.co_filename:
            windows[-1].add((frame.f_code.co_filename.split("/raysb/")[1], frame.f_code.co_qualname))

    hook = engine.step.optimizer.register_step_post_hook(lambda *_: windows.append(set()))
    sys.setprofile(called)
    try:
        engine.train_epoch(1)
    finally:
        sys.setprofile(None)
        hook.remove()
    between_steps = windows[1:-1]
    assert between_steps, "epoch 1 took fewer than two steps"
    return max(between_steps, key=len)


@pytest.mark.parametrize("strategy, most", [("sb", 60), ("free-sb", 45)])
def test_a_step_runs_few_raysb_functions(strategy, most):
    functions = functions_a_step(strategy)
    assert len(functions) <= most, "\n".join(f"{path} {name}" for path, name in sorted(functions))


if __name__ == "__main__":  # python tests/test_hot_path.py [strategy ...]: each strategy's count and functions
    for name in sys.argv[1:] or ["sb", "free-sb"]:
        found = functions_a_step(name)
        print(name, len(found), "functions in", len({path for path, _ in found}), "files")
        for path, qualname in sorted(found):
            print("  ", path, qualname)
