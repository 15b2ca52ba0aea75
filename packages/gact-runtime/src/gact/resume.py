"""What a run must carry over to be resumed: ``Controller.state_dict`` and its inverse."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, HookStateError

if TYPE_CHECKING:
    from .controller import Controller

__all__ = ["STATE_VERSION", "load_run_state", "run_state"]

# NOTE [Resumed runs]
# A run saved with the model's and optimizer's state and resumed in a new process must go on as
# the uninterrupted one: the same seeds (they mix the step count), the same widths, and the
# same schedule of adaptations, whose smoothed sensitivities carry over from one to the next.
# Before, a new Controller started at step 0: its first step re-adapted from the equal-
# sensitivity prior, and every rounding seed differed from the uninterrupted run's. The state
# is plain Python (ints, floats, strings, lists and dicts), so ``torch.save`` stores it beside
# a checkpoint and ``torch.load(..., weights_only=True)`` reads it. It holds the configuration
# it was made under: loading it into a Controller configured otherwise raises, rather than
# continue one run's widths under another's budget (``configure`` after loading changes it).
# It holds whether the loop marks its steps (``step()``, ``iterate()``): a resumed loop that
# accumulates micro-batches would otherwise have its first step split at the second forward
# again (NOTE [Steps] in controller.py), shifting every later seed. What is not carried over:
# the last step's statistics (``stats()`` starts empty), warnings already given, and compiled
# graphs (they compile again).
STATE_VERSION = 1

_PLAN_SETS = ("measured", "kept_keys", "value_read")
_PLAN_DICTS = ("bits", "sensitivity", "stderr", "two_valued")
_ADAPTER = (
    "count", "seconds", "compile_seconds", "last_seconds", "last_step", "last_adapted",
    "last_held_seconds", "has_prior", "_items", "last_probed", "last_held",
)  # fmt: skip
_PACING = ("step_seconds", "unmeasured", "probe_fraction")


def run_state(controller: Controller) -> dict[str, Any]:
    """``controller``'s run, as ``Controller.state_dict`` returns it (NOTE above)."""
    plan, hooks = controller.plan, controller.hooks
    return {
        "version": STATE_VERSION,
        "config": dataclasses.asdict(plan.config),
        "step": plan.step,
        **{name: sorted(getattr(plan, name)) for name in _PLAN_SETS},
        **{name: dict(getattr(plan, name)) for name in _PLAN_DICTS},
        "adapter": {name: getattr(controller.adapter, name) for name in _ADAPTER},
        "pacing": {name: getattr(controller.pacing, name) for name in _PACING},
        "verdicts": [[*key, *verdict] for key, verdict in hooks._verdicts.items()],
        "iterated": controller._iterated,
        "explicit_steps": controller._explicit_steps,
    }


def load_run_state(controller: Controller, state: dict[str, Any]) -> None:
    """Restore what ``run_state`` returned into ``controller`` (NOTE above).

    Raises:
        ValueError: ``state`` is not a state ``Controller.state_dict`` made.
        ConfigError: it was made under another configuration.
        HookStateError: the open step has saved tensors already.
    """
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        found = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"not a GACT run state of version {STATE_VERSION} (found {found!r}); pass what "
            "Controller.state_dict() returned"
        )
    missing = {"config", "step", "adapter", "pacing", "verdicts", "iterated", "explicit_steps"}
    missing |= {*_PLAN_SETS, *_PLAN_DICTS}
    missing -= state.keys()
    for part, names in (("adapter", _ADAPTER), ("pacing", _PACING)):
        inner = state.get(part)
        missing |= {f"{part}.{n}" for n in names if not isinstance(inner, dict) or n not in inner}
    if missing or not all(isinstance(v, list) and len(v) == 5 for v in state["verdicts"]):
        raise ValueError(f"the GACT run state lacks {sorted(missing) or ['verdicts']}: it was "
                         "not made by Controller.state_dict()")  # fmt: skip
    if controller.ledger.current:
        raise HookStateError(
            "cannot load a run state in the middle of a step (tensors were saved since the "
            "last step boundary); load it before training, or after controller.step()"
        )
    ours = dataclasses.asdict(controller.config)
    differ = sorted(k for k in ours.keys() | state["config"].keys()
                    if ours.get(k) != state["config"].get(k))  # fmt: skip
    if differ:
        pairs = ", ".join(f"{k}: {state['config'].get(k)!r} there, {ours.get(k)!r} here"
                          for k in differ)  # fmt: skip
        raise ConfigError(
            f"the run state was saved under another configuration ({pairs}); build the "
            "Controller with the saved configuration, load the state, then call "
            "controller.configure(...) to change it"
        )
    plan = controller.plan
    plan.step = int(state["step"])
    for name in _PLAN_SETS:
        setattr(plan, name, set(state[name]))
    for name in _PLAN_DICTS:
        setattr(plan, name, dict(state[name]))
    for name in _ADAPTER:
        setattr(controller.adapter, name, state["adapter"][name])
    for name in _PACING:
        setattr(controller.pacing, name, state["pacing"][name])
    controller.hooks._verdicts = {(w, k): (b, s, v) for w, k, b, s, v in state["verdicts"]}
    controller._iterated = bool(state["iterated"])
    controller._explicit_steps = bool(state["explicit_steps"])
