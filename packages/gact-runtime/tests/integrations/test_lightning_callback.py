"""``gact.integrations.lightning.GactCallback`` with ``lightning.pytorch.Trainer`` (and the
``pytorch_lightning`` twin)."""

from __future__ import annotations

import doctest
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("lightning.pytorch")

import gact.integrations.lightning as gact_lightning  # noqa: E402
from gact import LEVELS, GactConfig  # noqa: E402
from gact.integrations import IntegrationError  # noqa: E402
from gact.integrations.lightning import GactCallback  # noqa: E402

BATCH = 32


def _classifier(
    base: type, fail_at: int | None = None, manual: bool = False, submodules: bool = False
) -> Any:
    """A LightningModule that logs its loss; its training_step calls ``self(x)``, or with
    ``submodules`` its submodules one by one (the root module's forward never runs)."""

    class Classifier(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = torch.nn.Sequential(
                torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)
            )
            self.head = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(256, 4))  # probed
            self.automatic_optimization = not manual
            self.steps = 0
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.steps += 1
            if self.steps == fail_at:
                raise ValueError("training_step failed")
            x, y = batch
            logits = self.head(self.body(x)) if submodules else self(x)
            loss = F.cross_entropy(logits, y)
            self.log("train_loss", loss, reduce_fx="sum", on_epoch=True)
            self.losses.append(float(loss.detach()))
            return loss

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Classifier()


def _loader() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(8 * BATCH, 64, generator=gen), torch.randint(0, 4, (8 * BATCH,), generator=gen)
    )
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def _fit(callback: Any, module: Any, trainer_cls: Any = None, **options: Any) -> Any:
    settings: dict[str, Any] = dict(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    settings.update(options)
    trainer = (trainer_cls or pl.Trainer)(callbacks=[callback], **settings)
    trainer.fit(module, _loader())
    return trainer


def _no_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("level", list(LEVELS))
def test_trains_at_every_level(level: str) -> None:
    callback = GactCallback(
        GactConfig.from_level(level, adapt_interval=2, adapt_first_gap=0, adapt_budget=None)
    )
    module = _classifier(pl.LightningModule)
    _fit(callback, module)
    stats = callback.controller.stats()
    assert all(math.isfinite(loss) for loss in module.losses)
    assert stats["step"] == 3
    assert stats["adaptations"] == (2 if LEVELS[level].adaptive else 0)  # steps 0 and 2
    assert (stats["ratio"] > 2) == LEVELS[level].compresses
    assert _no_hooks() and not callback.controller.installed


def test_accumulation_and_bf16_mixed() -> None:
    callback = GactCallback(
        GactConfig.from_level("L2", adapt_interval=2, adapt_first_gap=0, adapt_budget=None)
    )
    module = _classifier(pl.LightningModule)
    trainer = _fit(callback, module, accumulate_grad_batches=2, precision="bf16-mixed")
    stats = callback.controller.stats()
    assert trainer.global_step == 3
    assert stats["step"] == 3  # one GACT step per optimizer step, not per batch
    assert stats["adaptations"] == 2
    rows = [line.split() for line in callback.controller.report().splitlines()]
    body = [row for row in rows if row and row[0].startswith("body.")]
    assert body and all(row[2] == "bfloat16" and row[-3] == "2" for row in body)  # 2 batches


def test_figures_are_logged_and_probes_do_not_log() -> None:
    callback = GactCallback(GactConfig.from_level("L2", adapt_first_gap=0))
    module = _classifier(pl.LightningModule, submodules=True)
    trainer = _fit(callback, module)
    metrics = trainer.logged_metrics
    assert float(metrics["gact/ratio"]) == pytest.approx(callback.controller.stats()["ratio"])
    assert "gact/stored_bytes" in metrics
    assert len(module.losses) > 3  # the step-0 probes ran training_step again ...
    # ... but only the three real batches reached self.log (reduce_fx="sum" over the epoch)
    assert float(trainer.callback_metrics["train_loss_epoch"]) == pytest.approx(
        sum(module.losses[:1] + module.losses[-2:]), rel=1e-5
    )


@pytest.mark.parametrize(("probe_batch_size", "rows"), [(None, 8), (5, 5), (0.5, 16), (1.0, BATCH)])
def test_probes_on_a_sub_batch(probe_batch_size: int | float | None, rows: int) -> None:
    """``probe_batch_size``: the probes replay training_step on the batch's first rows, a
    quarter of them by default (NOTE [Sub-batch probes]); the real steps keep their whole
    batches."""
    options = {} if probe_batch_size is None else {"probe_batch_size": probe_batch_size}
    callback = GactCallback(GactConfig.from_level("L2", adapt_first_gap=0), **options)
    module = _classifier(pl.LightningModule)
    seen: list[tuple[bool, int]] = []
    module.register_forward_pre_hook(
        lambda m, args: seen.append((callback.controller.hooks.probing, args[0].shape[0]))
    )
    _fit(callback, module)
    assert callback.controller.stats()["adaptations"] == 1
    assert {n for probing, n in seen if probing} == {rows}
    assert {n for probing, n in seen if not probing} == {BATCH}
    # the schedule predicts the first adaptation's cost from the probes' share of the batch
    assert callback.controller.pacing.probe_fraction == rows / BATCH


def test_probe_batch_size_must_be_rows_or_a_share() -> None:
    for bad in (0, -2, 2.5, 0.0, True, "all", None):
        with pytest.raises(ValueError, match="probe_batch_size must be a number of rows"):
            GactCallback("L2", probe_batch_size=bad)


def test_training_step_without_batch_idx() -> None:
    callback = GactCallback(GactConfig.from_level("L2", adapt_first_gap=0))
    module = _classifier(pl.LightningModule)
    two_arguments = module.training_step
    module.training_step = lambda batch: two_arguments(batch, 0)  # Lightning passes no index
    _fit(callback, module)
    assert callback.controller.stats()["adaptations"] == 1


def test_failed_training_leaves_no_hooks() -> None:
    callback = GactCallback(GactConfig.from_level("L2", adapt_first_gap=0))
    with pytest.raises(ValueError, match="training_step failed"):
        _fit(callback, _classifier(pl.LightningModule, fail_at=2))
    assert _no_hooks() and not callback.controller.installed


def test_epoch_cut_short_by_the_module_leaves_no_hooks() -> None:
    callback = GactCallback(GactConfig.from_level("L2", adapt_first_gap=0))
    module = _classifier(pl.LightningModule)
    # returning -1 ends the epoch right after the callbacks' on_train_batch_start
    module.on_train_batch_start = lambda batch, batch_idx: -1 if batch_idx == 1 else None
    _fit(callback, module, max_epochs=1, max_steps=-1)
    assert callback.controller.stats()["step"] == 1
    assert _no_hooks() and not callback.controller.installed


def test_manual_optimization_is_refused() -> None:
    with pytest.raises(IntegrationError, match="automatic optimization"):
        _fit(
            GactCallback(GactConfig.from_level("L2", adapt_first_gap=0)),
            _classifier(pl.LightningModule, manual=True),
        )
    assert _no_hooks()


def test_controller_before_training_raises() -> None:
    with pytest.raises(IntegrationError, match=r"once trainer\.fit"):
        GactCallback(GactConfig.from_level("L2", adapt_first_gap=0)).controller  # noqa: B018


def test_pytorch_lightning_package() -> None:
    legacy = pytest.importorskip("pytorch_lightning")
    from gact.integrations.pytorch_lightning import GactCallback as LegacyCallback

    callback = LegacyCallback(GactConfig.from_level("L2", adapt_first_gap=0))
    _fit(callback, _classifier(legacy.LightningModule), trainer_cls=legacy.Trainer)
    assert callback.controller.stats()["step"] == 3
    assert callback.controller.stats()["adaptations"] == 1


def test_docstring_examples() -> None:
    result = doctest.testmod(gact_lightning)
    assert result.attempted > 0 and result.failed == 0


def _checkpointed(level: str, steps: int, ckpt: str | None = None) -> tuple[Any, Any]:
    """A fit of ``steps`` steps at ``level`` (adapting often), from checkpoint ``ckpt`` if
    given; the trainer and the callback."""
    config = GactConfig.from_level(level, adapt_interval=4, adapt_first_gap=1, adapt_budget=None)
    callback = GactCallback(config)
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )  # fmt: skip
    trainer.fit(_classifier(pl.LightningModule), _loader(), ckpt_path=ckpt)
    return trainer, callback


def test_a_run_resumed_from_a_checkpoint_goes_on_from_its_gact_state(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The callback's state is in Lightning's checkpoints (NOTE [Resumed runs] in resume.py):
    resumed from a checkpoint after 8 steps, GACT goes on at step 8 with the widths,
    sensitivities and schedule it had (not at step 0 with the prior: other rounding seeds,
    the schedule anew). (Lightning's own resume is not bit-identical here, GACT or not.)"""
    first, saved = _checkpointed("L2", 8)  # one epoch of 8 batches
    path = str(tmp_path / "epoch.ckpt")
    first.save_checkpoint(path)
    state = saved.controller.state_dict()
    restored: list[dict[str, Any]] = []
    original = GactCallback.on_train_start

    def spy(self: Any, trainer: Any, pl_module: Any) -> None:
        original(self, trainer, pl_module)
        restored.append(self.controller.state_dict())

    monkeypatch.setattr(GactCallback, "on_train_start", spy)
    _, resumed = _checkpointed("L2", 16, ckpt=path)
    assert restored[0]["step"] == state["step"] == 8
    assert restored[0]["bits"] == state["bits"] and state["adapter"]["count"] >= 2
    assert restored[0]["sensitivity"] == state["sensitivity"]
    assert resumed.controller.state_dict()["step"] == 16


def test_a_run_resumed_under_another_level_goes_on_under_the_new_one(tmp_path: Any) -> None:
    """A run saved at L2 and resumed with a callback at L2.2: the saved run goes on (step 8),
    then the new level's budget takes over as ``configure`` makes it. Before, loading raised
    ``ConfigError`` and suggested ``configure()``, which a callback's user cannot reach."""
    first, _ = _checkpointed("L2", 8)
    path = str(tmp_path / "epoch.ckpt")
    first.save_checkpoint(path)
    _, resumed = _checkpointed("L2.2", 16, ckpt=path)
    stats = resumed.controller.stats()
    assert resumed.controller.config.level == "L2.2" and stats["step"] == 16
    assert stats["average_bits"] is not None and stats["average_bits"] < 2.6
