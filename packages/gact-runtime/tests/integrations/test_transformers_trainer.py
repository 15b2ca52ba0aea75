"""``gact.integrations.transformers.GactCallback`` with ``transformers.Trainer``."""

from __future__ import annotations

import doctest
import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import gact.integrations.transformers as gact_transformers  # noqa: E402
from gact import LEVELS, ConfigError, GactConfig  # noqa: E402
from gact.integrations import IntegrationError  # noqa: E402
from gact.integrations.transformers import GactCallback  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

VOCAB = 64


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0
    )
    config.eos_token_id = 0
    return GPT2LMHeadModel(config)


def _data(rows: int = 32) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (rows, 32), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def _trainer(
    tmp_path: Path,
    callbacks: list[TrainerCallback],
    model: torch.nn.Module | None = None,
    **options: Any,
) -> Trainer:
    settings: dict[str, Any] = dict(
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    settings.update(options)
    args = TrainingArguments(str(tmp_path / "out"), **settings)
    return Trainer(
        model=_model() if model is None else model,
        args=args,
        train_dataset=_data(),
        callbacks=callbacks,
    )


def _no_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("level", list(LEVELS))
def test_trains_at_every_level(level: str, tmp_path: Path) -> None:
    callback = GactCallback(
        GactConfig.from_level(level, adapt_interval=2, adapt_first_gap=0, adapt_budget=None)
    )
    trainer = _trainer(tmp_path, [callback], max_steps=3)
    output = trainer.train()
    stats = callback.controller.stats()
    assert math.isfinite(output.training_loss)
    assert stats["step"] == 3
    assert stats["adaptations"] == (2 if LEVELS[level].adaptive else 0)  # steps 0 and 2
    assert (stats["ratio"] > 2) == LEVELS[level].compresses
    assert _no_hooks() and not callback.controller.installed
    assert "training_step" not in vars(trainer)  # the trainer's own method is back


def test_a_compiled_model_compresses_inside_its_graphs(tmp_path: Path) -> None:
    """``torch_compile=True``: the Trainer compiles the model after the callback made its
    controller; the compiled graphs' saves are compressed (NOTE [Compiled saves] in
    compiled.py) and the run trains as the eager one does. (Both store every intermediate of
    GPT-2's ``gelu_new``: eager code recomputes them by default, NOTE [Recomputed activations],
    compiled graphs store what their partitioner saves.) The callback installs the hooks
    around every step: from the second on, they go on the compiled module alone (NOTE
    [Compiled forwards] in scope.py), so the model compiles twice however long the run. Before,
    each step's hooks on every submodule recompiled it, and past dynamo's recompile limit (8)
    it ran eagerly, every save kept (ratio 1.02 after 14 steps)."""
    losses, ratios = {}, {}
    for compile_ in (False, True):
        torch._dynamo.reset()
        callback = GactCallback(GactConfig.from_level("L1", recompute_activations=False))
        options = dict(torch_compile=True, torch_compile_backend="aot_eager") if compile_ else {}
        output = _trainer(tmp_path, [callback], max_steps=10, **options).train()
        losses[compile_] = output.training_loss
        stats = callback.controller.stats()
        ratios[compile_] = stats["ratio"]  # the last step's
        assert bool(callback.controller.hooks.compiled_sites) == compile_
        assert stats["compiled_graphs"] <= (3 if compile_ else 0)
    assert ratios[True] > 0.9 * ratios[False] > 4
    assert abs(losses[True] - losses[False]) < 0.02 * losses[False]


def test_gradient_accumulation_is_one_gact_step_per_optimizer_step(tmp_path: Path) -> None:
    single = GactCallback(
        GactConfig.from_level("L2", adapt_interval=2, adapt_first_gap=0, adapt_budget=None)
    )
    _trainer(tmp_path, [single], max_steps=3).train()
    accumulated = GactCallback(
        GactConfig.from_level("L2", adapt_interval=2, adapt_first_gap=0, adapt_budget=None)
    )
    trainer = _trainer(tmp_path, [accumulated], max_steps=3, gradient_accumulation_steps=2)
    trainer.train()
    stats = accumulated.controller.stats()
    assert trainer.state.global_step == 3
    assert stats["step"] == 3
    assert stats["adaptations"] == 2  # the first step is not split by its second micro-batch
    assert stats["original_bytes"] == 2 * single.controller.stats()["original_bytes"]


def test_probes_use_the_trainers_loss(tmp_path: Path) -> None:
    calls = []

    def loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> Any:
        calls.append(torch.is_grad_enabled())
        logits = outputs.logits[:, :-1].reshape(-1, VOCAB)
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))

    callback = GactCallback(GactConfig.from_level("L2", adapt_first_gap=0))
    trainer = _trainer(tmp_path, [callback], max_steps=1)
    trainer.compute_loss_func = loss_func
    trainer.train()
    assert callback.controller.stats()["adaptations"] == 1
    assert len(calls) > 2  # one real micro-batch, then the probes: all through the Trainer's loss


@pytest.mark.parametrize(("probe_batch_size", "rows"), [(None, 2), (3, 3), (1.0, 4)])
def test_probes_on_a_sub_batch(
    probe_batch_size: int | float | None, rows: int, tmp_path: Path
) -> None:
    """``probe_batch_size``: the probes replay training_step on the micro-batch's first rows,
    by default a quarter but at least 2 (NOTE [Sub-batch probes]); the real steps keep their
    whole micro-batches."""
    options = {} if probe_batch_size is None else {"probe_batch_size": probe_batch_size}
    callback = GactCallback(GactConfig.from_level("L2", adapt_first_gap=0), **options)
    model = _model()
    seen: list[tuple[bool, int]] = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(
            (callback.controller.hooks.probing, kwargs["input_ids"].shape[0])
        ),
        with_kwargs=True,
    )
    _trainer(tmp_path, [callback], model=model, max_steps=1).train()
    assert callback.controller.stats()["adaptations"] == 1
    assert {n for probing, n in seen if probing} == {rows}
    assert {n for probing, n in seen if not probing} == {4}
    # the schedule predicts the first adaptation's cost from the probes' share of the batch
    assert callback.controller.pacing.probe_fraction == rows / 4


def test_bf16_autocast(tmp_path: Path) -> None:
    callback = GactCallback(GactConfig.from_level("L2", adapt_first_gap=0))
    output = _trainer(tmp_path, [callback], bf16=True).train()
    report = callback.controller.report()
    assert math.isfinite(output.training_loss)
    assert any("bfloat16" in line and "quantized" in line for line in report.splitlines())


class _Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.logs.append(dict(logs))


def test_figures_reach_the_trainers_loggers(tmp_path: Path) -> None:
    recorder = _Recorder()
    callback = GactCallback("L1")
    trainer = _trainer(tmp_path, [callback, recorder], max_steps=2)
    trainer.train()
    figures = [logs for logs in recorder.logs if "gact/ratio" in logs]
    assert len(figures) == 2  # logging_steps=1
    assert figures[-1]["gact/ratio"] == pytest.approx(callback.controller.stats()["ratio"])
    assert figures[-1]["gact/stored_bytes"] == callback.controller.stats()["stored_bytes"]
    assert any("gact/ratio" in entry for entry in trainer.state.log_history)
    assert sum("loss" in logs for logs in recorder.logs) == 2  # the Trainer's own logs still come


class _FailsAt(TrainerCallback):
    """Raises in ``on_step_end`` of the given step (outside every forward and backward)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise KeyError("boom")


class _ForwardFails(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _model()
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 2:
            raise ValueError("forward failed")
        return self.inner(input_ids=input_ids, labels=labels, **kwargs)


@pytest.mark.parametrize("where", ["forward", "between steps"])
def test_failed_training_leaves_no_hooks_and_can_rerun(where: str, tmp_path: Path) -> None:
    callback = GactCallback(GactConfig.from_level("L2", adapt_first_gap=0))
    if where == "forward":
        trainer = _trainer(tmp_path, [callback], model=_ForwardFails(), max_steps=3)
        error: type[Exception] = ValueError
    else:
        trainer = _trainer(tmp_path, [callback, _FailsAt(1)], max_steps=3)
        error = KeyError
    with pytest.raises(error):
        trainer.train()
    assert _no_hooks() and not callback.controller.installed
    if where == "between steps":
        trainer.remove_callback(_FailsAt)
    trainer.train()  # the same trainer and callback train again
    assert callback.controller.stats()["step"] >= 3
    assert _no_hooks()


def test_controller_before_training_raises() -> None:
    with pytest.raises(IntegrationError, match=r"once trainer\.train"):
        GactCallback(GactConfig.from_level("L2", adapt_first_gap=0)).controller  # noqa: B018


def test_bad_config_raises() -> None:
    with pytest.raises(TypeError, match="level name"):
        GactCallback(4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown optimization level"):
        GactCallback("L9")
    with pytest.raises(ConfigError, match=r"unknown GactConfig fields \['bits_per_tensor'\]"):
        GactCallback({"level": "L2", "bits_per_tensor": 4})
    with pytest.raises(ConfigError, match="unknown optimization level"):
        GactCallback({"level": "L9"})
    assert GactCallback({"level": "L1", "group_size": 64}).config.group_size == 64


def test_docstring_examples() -> None:
    result = doctest.testmod(gact_transformers, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_a_run_resumed_from_a_checkpoint_goes_on_from_its_gact_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The callback is an ``ExportableState``: the Trainer keeps its configuration and GACT's
    run state in its checkpoints (NOTE [Resumed runs] in resume.py), and with
    ``restore_callback_states_from_checkpoint=True`` a resumed run goes on at the saved step
    with the saved widths and sensitivities (it restarted GACT at step 0)."""
    config = GactConfig.from_level("L2", adapt_interval=2, adapt_first_gap=1, adapt_budget=None)
    options = dict(
        save_strategy="steps", save_steps=4, restore_callback_states_from_checkpoint=True
    )
    first = GactCallback(config)
    _trainer(tmp_path, [first], max_steps=4, **options).train()
    saved = first.controller.state_dict()
    begun: list[dict[str, Any]] = []
    original = GactCallback.on_train_begin

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        begun.append(self.controller.state_dict())

    monkeypatch.setattr(GactCallback, "on_train_begin", spy)
    trainer = _trainer(tmp_path, [GactCallback(config)], max_steps=8, **options)
    trainer.train(resume_from_checkpoint=True)
    assert begun[0]["step"] == saved["step"] == 4
    assert begun[0]["bits"] == saved["bits"] and saved["adapter"]["count"] >= 2
    assert begun[0]["sensitivity"] == saved["sensitivity"]
    (restored,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, GactCallback)]
    assert restored.controller.state_dict()["step"] == 8
    assert restored.config == config
