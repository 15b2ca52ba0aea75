"""Each script's main() for one short epoch on tiny data, at L0 (fp32 measuring) and L2."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from gact import Controller, GactConfig
from gact_examples.train import REQUIRED_KEYS, sub_batch_probe

GNN, VISION, TEXT = "gnn/train_gnn.py", "vision/train_vision.py", "text/train_char_gpt.py"
BERT = "hf/train_bert_classifier.py"
TINY = {
    "gcn": (GNN, ["--model", "gcn", "--epochs", "2"]),
    "sage": (GNN, ["--model", "sage", "--epochs", "2"]),
    "gat": (GNN, ["--model", "gat", "--epochs", "2"]),
    "mnist": (VISION, ["--dataset", "mnist", "--batch-size", "32", "--width", "4"]),
    "cifar10": (VISION, ["--dataset", "cifar10", "--batch-size", "15", "--width", "4"]),
    "text": (
        TEXT,
        [
            "--steps-per-epoch",
            "3",
            "--batch-size",
            "4",
            "--block-size",
            "16",
            "--n-embd",
            "32",
            "--eval-batches",
            "2",
        ],
    ),
    "bert": (
        BERT,
        "--steps-per-epoch 3 --batch-size 4 --passage 8 --chunk 32 --classes 2 --n-embd 32 "
        "--n-layer 1 --n-head 2".split(),
    ),
}


def check_record(rec: dict, level: str) -> None:
    missing = [k for k in REQUIRED_KEYS if k not in rec]
    assert not missing, missing
    assert rec["level"] == level
    assert isinstance(rec["final_metric"], float) and math.isfinite(rec["final_metric"])
    assert rec["original_bytes"] > 0 and rec["stored_bytes"] > 0
    assert rec["peak_memory_bytes"] > 0
    assert rec["step_time_s"] > 0 and rec["throughput"] > 0
    if level == "L0":
        assert rec["compression_ratio"] == pytest.approx(1.0, abs=0.05)
    else:
        assert rec["compression_ratio"] > 1.0
        assert rec["stored_bytes"] < rec["original_bytes"]


@pytest.mark.parametrize("level", ["L0", "L2"])
@pytest.mark.parametrize("name", sorted(TINY))
def test_script_main(name, level, data_root, tmp_path, script):
    if name == "bert":
        pytest.importorskip("transformers")  # examples[transformers], in tests(examples)
    path, extra = TINY[name]
    out = tmp_path / "r.json"
    argv = ["--data", str(data_root), "--seed", "1", "--device", "cpu", "--no-progress"]
    argv += ["--gact", "--level", level, "--json", str(out), *extra]
    rec = script(path).main(argv)
    on_disk = json.loads(out.read_text())
    assert on_disk["model"] == rec["model"] and on_disk["seed"] == 1
    check_record(on_disk, level)
    if name in ("gcn", "sage", "gat", "mnist", "cifar10", "bert"):
        assert 0.0 <= on_disk["final_metric"] <= 1.0
    else:
        assert on_disk["metric"] == "val_loss" and on_disk["final_metric"] > 0


def test_trainer_example(data_root, tmp_path, script):
    """hf/train_trainer.py: GPT-2 from a config under transformers' Trainer, GACT as a callback."""
    pytest.importorskip("accelerate")  # examples[transformers], in tests(examples)
    out = tmp_path / "trainer.json"
    argv = ["--data", str(data_root), "--level", "L2", "--steps", "2", "--batch-size", "2"]
    argv += "--block-size 16 --n-layer 1 --n-embd 32 --n-head 2 --eval-blocks 2".split()
    rec = script("hf/train_trainer.py").main([*argv, "--out", str(out)])
    assert json.loads(out.read_text())["level"] == "L2" and rec["steps"] == 2
    assert math.isfinite(rec["eval_loss"]) and rec["saved_activation_ratio"] > 4


def test_record_holds_the_largest_step(data_root, script):
    """A partial last batch does not stand for the run: 40 images at batch 32 train on 32, then
    8, and the record's saved bytes are the 32-image step's."""
    argv = ["--data", str(data_root), "--dataset", "mnist", "--batch-size", "32", "--width", "4"]
    argv += ["--gact", "--level", "L1", "--no-progress"]
    full = script(VISION).main([*argv, "--train-subset", "32"])
    partial = script(VISION).main([*argv, "--train-subset", "40"])
    assert (full["steps"], partial["steps"]) == (1, 2)
    assert partial["original_bytes"] == full["original_bytes"]
    assert partial["stored_bytes"] == full["stored_bytes"]


@pytest.mark.parametrize("level", ["L2", "L2.2"])
def test_memory_budget_caps_an_adaptive_level(data_root, script, level):
    """--memory-budget: the adaptive level stores what it is given, not its average's bytes; the
    benchmark's L2@L1 runs rely on it to compare levels at equal stored bytes. (Not the GCN:
    with its ReLU output stored as its decision, L2's own budget already holds every tensor it
    quantizes at 8 bits on this tiny graph.)"""
    argv = ["--data", str(data_root), "--model", "gat", "--epochs", "3", "--no-progress"]
    uniform = script(GNN).main([*argv, "--gact", "--level", "L1"])
    default = script(GNN).main([*argv, "--gact", "--level", level])
    budget = uniform["stored_bytes"]
    matched = script(GNN).main([*argv, "--gact", "--level", level, "--memory-budget", str(budget)])
    # whole bits per tensor: 10 small tensors fill the budget to a few %
    assert default["stored_bytes"] < matched["stored_bytes"] <= budget
    assert matched["stored_bytes"] > 0.9 * budget


@pytest.mark.parametrize(
    "options", [["--gact", "--level", "L1"], ["--level", "L2"], ["--gact", "--level", "L2"]]
)
def test_memory_budget_is_checked(data_root, script, capsys, options):
    budget = "0" if "--gact" in options and "L2" in options else "1000"
    argv = ["--data", str(data_root), "--model", "gcn", *options, "--memory-budget", budget]
    with pytest.raises(SystemExit) as exc:
        script(GNN).main(argv)
    assert exc.value.code == 2 and "--memory-budget" in capsys.readouterr().err


def test_fp32_without_gact(data_root, script):
    rec = script(GNN).main(["--data", str(data_root), "--epochs", "2", "--no-progress"])
    assert rec["level"] == "fp32" and rec["original_bytes"] is None
    assert 0.0 <= rec["final_metric"] <= 1.0


def test_get_mem_run(data_root, capsys, script):
    rec = script(VISION).main(
        [
            "--data",
            str(data_root),
            "--dataset",
            "mnist",
            "--batch-size",
            "16",
            "--width",
            "4",
            "--gact",
            "--level",
            "L2",
            "--get-mem",
            "--mem-steps",
            "3",
            "--no-progress",
        ],
    )
    # the second step is profiled for the live-tensor peak, not timed
    assert rec["get_mem"] and rec["final_metric"] is None and rec["steps"] == 2
    assert rec["live_peak_bytes"] > 0 and rec["cuda_reserved_peak_bytes"] is None
    assert "glibc" not in rec["memory_method"]  # measured under the malloc users run
    assert rec["compression_ratio"] > 1.0
    assert "compression ratio" in capsys.readouterr().out


def test_l3_on_cpu_runs_as_l2(data_root, script):
    """L3 swaps to pinned memory on CUDA only; on the CPU the runtime runs it as L2."""
    argv = ["--data", str(data_root), "--seed", "1", "--device", "cpu", "--no-progress"]
    argv += ["--model", "gcn", "--epochs", "2", "--gact"]
    recs = {lvl: script(GNN).main([*argv, "--level", lvl]) for lvl in ("L2", "L3")}
    check_record(recs["L3"], "L3")
    assert recs["L3"]["stored_bytes"] == recs["L2"]["stored_bytes"]
    assert recs["L3"]["final_metric"] == recs["L2"]["final_metric"]


def test_report_at_the_end_of_a_training_run(data_root, capsys, script):
    """--report prints the per-tensor table after a normal run (not only a memory run)."""
    argv = ["--data", str(data_root), "--model", "gcn", "--epochs", "2", "--no-progress"]
    script(GNN).main([*argv, "--gact", "--level", "L2", "--report"])
    out = capsys.readouterr().out
    assert "sensitivity" in out and "conv1.lin#0:float32:2d" in out
    script(GNN).main([*argv, "--gact", "--level", "L2"])
    assert "conv1.lin#0:float32:2d" not in capsys.readouterr().out


def test_missing_data_folder_is_a_usage_error(script, monkeypatch, capsys):
    monkeypatch.delenv("GACT_DATA", raising=False)
    with pytest.raises(SystemExit) as exc:
        script(GNN).main(["--epochs", "1"])
    assert exc.value.code == 2 and "--data" in capsys.readouterr().err


def test_probes_run_on_a_quarter_of_the_batch_by_default():
    """``--probe-batch``: the probe closure runs on the first rows of the batch, and its share
    is what the controller is told; a probe batch as large as the batch probes the batch."""
    rows_seen = []

    def closure(rows=None):
        rows_seen.append(rows)
        return torch.zeros(())

    probe, fraction = sub_batch_probe(argparse.Namespace(probe_batch=None), 64, closure)
    probe()
    assert rows_seen == [16] and fraction == 0.25
    probe, fraction = sub_batch_probe(argparse.Namespace(probe_batch=8), 64, closure)
    assert fraction == 0.125
    assert sub_batch_probe(argparse.Namespace(probe_batch=64), 64, closure) is None
    assert sub_batch_probe(argparse.Namespace(probe_batch=None), 3, closure)[1] == 2 / 3
    assert sub_batch_probe(argparse.Namespace(probe_batch=None), 2, closure) is None  # BatchNorm


def test_a_probe_batch_below_one_is_a_usage_error(data_root, capsys, script):
    with pytest.raises(SystemExit) as exc:
        script(VISION).main(["--data", str(data_root), "--probe-batch", "0"])
    assert exc.value.code == 2 and "--probe-batch" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["resnet18", "vit", "llama"])
def test_stability_script(model, data_root, tmp_path, script):
    """stability.py: every level trains a few steps; L1 records variance ratios per parameter."""
    if model != "resnet18":
        pytest.importorskip("transformers")  # examples[transformers], in tests(examples)
    out = tmp_path / "s.json"
    argv = ["--data", str(data_root), "--model", model, "--levels", "L0,L1,L2", "--seeds", "0"]
    argv += ["--lrs", "0.001", "--steps", "3", "--batch-size", "4", "--images", "16"]
    argv += ["--variance-steps", "1", "--variance-draws", "2", "--minibatch-draws", "3"]
    argv += ["--variance-levels", "L1,L2", "--adapt-budget", "none"]
    argv += ["--rounding-batches", "2", "--out", str(out)]
    argv += ["--channel-error-steps", "2"]
    records = script("stability.py").main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(records))
    fp32, l1, l2 = json.loads(out.read_text())
    # at batch 4 every map is small: BatchNorm inputs at 8 bits, other saves at 6 (NOTE [Small
    # maps] in norm_rules.py), so L1 stores 3.7x less on the ResNet
    assert (fp32["level"], l1["level"]) == ("L0", "L1") and l1["ratio"] > 3
    for rec in records:
        assert rec["first_nan_step"] is None and len(rec["losses"]) == 3
        assert math.isfinite(rec["final_loss"]) and rec["max_grad_norm"] > 0
    assert not fp32["variance_ratios"]
    assert set(l2["variance_ratios"]["1"]) == set(l1["variance_ratios"]["1"])
    assert l2["adapt_budget"] is None
    ratios = l1["variance_ratios"]["1"]
    assert (
        len(ratios) > 4
        and all(r >= 0 and math.isfinite(r) for r in ratios.values())
        and max(ratios.values()) > 0
    )
    errors = l1["channel_errors"]["2"]
    if model == "resnet18":  # its 1x1 maps: memory-order groups span channels
        assert errors and all(e["channel"] < 1.0 for e in errors)
        assert max(e["memory"] for e in errors) > max(e["channel"] for e in errors)
    assert not fp32["channel_errors"]


def test_stability_variance_of_an_adaptive_level_uses_its_allocation(data_root, script):
    """stability.py's ``variance_ratios(bits=...)``: rounding with an adaptive level's allocation
    (its ``plan.bits``), not its first-step widths. Every save at 1 bit adds far more gradient
    variance than every save at 8 bits."""
    stability = script("stability.py")
    args = argparse.Namespace(data=str(data_root), images=16, batch_size=4)
    task = stability.make_task("resnet18", args)
    torch.manual_seed(0)
    model = task.build()
    config = GactConfig.from_level("L2")
    with Controller(model, config) as controller:  # the keys of the model's saves
        task.loss(model, next(task.batches(torch.Generator().manual_seed(0)))).backward()
    keys = list(controller.ledger.current or controller.ledger.last)
    worst = {}
    for width in (1, 8):
        ratios = stability.variance_ratios(
            model, task, config, 2, 0, minibatches=3, rounding_batches=1,
            bits=dict.fromkeys(keys, width),
        )  # fmt: skip
        worst[width] = max(ratios.values())
    assert worst[1] > 100 * worst[8] > 0


def test_stability_script_records_divergence(data_root, tmp_path, script):
    """A learning rate far past fp32's edge: the run stops at the first NaN and says when."""
    argv = ["--data", str(data_root), "--levels", "L0", "--seeds", "0", "--lrs", "1e6"]
    argv += ["--steps", "20", "--batch-size", "4", "--images", "16", "--out", str(tmp_path / "s")]
    (rec,) = script("stability.py").main(argv)
    assert rec["first_nan_step"] is not None and len(rec["losses"]) == rec["first_nan_step"] + 1
    assert math.isnan(rec["final_loss"]) and rec["adaptations"] == 0


def test_stability_adapt_budget_is_checked(data_root, capsys, script):
    with pytest.raises(SystemExit) as exc:
        script("stability.py").main(["--data", str(data_root), "--adapt-budget", "-1"])
    assert exc.value.code == 2 and "a fraction >= 0 or 'none'" in capsys.readouterr().err


def test_stability_report(tmp_path, script):
    """stability_report.py: NaN steps per seed, final loss against fp32, variance per layer."""

    def rec(level, seed, loss, nan=None, ratios=None):
        return {
            "model": "resnet18", "layout": "channel", "lr": 0.1, "level": level, "seed": seed,
            "first_nan_step": nan, "final_loss": loss, "max_grad_norm": 10.0 + seed,
            "variance_ratios": ratios or {}, "adaptations": 3 * seed,
        }  # fmt: skip

    records = [
        rec("L0", 0, 1.0),
        rec("L0", 1, 1.2),
        rec(
            "L1", 0, 1.1, ratios={"0": {"layer4.1.bn2.weight": 0.05, "layer4.0.conv1.weight": 0.2}}
        ),
        rec("L1", 1, 1.1, ratios={"0": {"layer4.1.bn2.weight": 0.01}}),
        rec("L2", 0, 1.1, ratios={"0": {"layer4.1.bn2.weight": 0.5}}),
        rec("L1.2", 0, math.nan, nan=7),
        rec("L1.2", 1, math.nan, nan=12),
    ]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(records))
    text = script("stability_report.py").main([str(path)])
    assert "| resnet18 | 0.1 | L1 | -, - | 1.100 ± 0.000 | +0.0% | 11 | 0, 3 |" in text
    assert "| resnet18 | 0.1 | L1.2 | 7, 12 | diverged |" in text
    # per level, the largest over the layer's parameters and seeds
    l1, l2 = text.split("(L1, largest")[1].split("(L2, largest")
    assert "| layer4 | 20.0% |" in l1 and "| layer4 | 50.0% |" in l2


def test_memory_bench(data_root, tmp_path, script):
    """memory_bench.py: one process per run, peak growth and step time per level, the table."""
    bench = script("memory_bench.py")
    assert bench.allocator_env("default") == {}
    assert bench.allocator_env("glibc-tuned")["MALLOC_MMAP_THRESHOLD_"] == "131072"
    out = tmp_path / "m.json"
    argv = ["--data", str(data_root), "--models", "resnet18,char-gpt", "--levels", "L0,L1"]
    argv += ["--allocators", "default", "--steps", "2", "--json", str(out)]
    argv += ["--plot", str(tmp_path / "m.png")]
    records = bench.main(argv)
    assert json.loads(out.read_text()) == records and (tmp_path / "m.png").stat().st_size > 0
    assert [(r["model"], r["level"]) for r in records] == [
        ("resnet18", "L0"), ("resnet18", "L1"), ("char-gpt", "L0"), ("char-gpt", "L1")
    ]  # fmt: skip
    for r in records:
        assert r["peak_growth_bytes"] > 0 and r["step_s"] > 0 and r["saved_bytes"] > 0
        compressed = r["level"] != "L0"
        assert (r["stored_bytes"] < r["saved_bytes"] / 4) == compressed
    text = bench.table(records)
    assert "| default | char-gpt (" in text and "x less" in text


@pytest.mark.parametrize("backend", ["aot_eager", "aot_eager/blocks"])
def test_memory_bench_compiled(data_root, script, backend):
    """memory_bench.py --compile: the model is compiled in its process (whole, or block by
    block), and the compiled graphs' saves are compressed (stored a fraction of saved, as in
    eager)."""
    argv = ["--data", str(data_root), "--models", "mnist", "--levels", "L1"]
    records = script("memory_bench.py").main(
        [*argv, "--allocators", "default", "--steps", "2", "--compile", backend]
    )
    (rec,) = records
    assert rec["compile"] == backend and rec["peak_growth_bytes"] > 0
    assert 0 < rec["stored_bytes"] < rec["saved_bytes"] / 4


def test_memory_bench_rejects_unknown_models(data_root, script):
    with pytest.raises(ValueError, match=r"unknown model\(s\) \['nomodel'\]"):
        script("memory_bench.py").main(
            [
                "--data",
                str(data_root),
                "--models",
                "nomodel",
                "--levels",
                "L0",
                "--allocators",
                "default",
            ]
        )


@pytest.mark.parametrize(
    "name", ["gpt2", "bert", "resnet18", "char-gpt", "mnist", "gcn", "encoder6"]
)
def test_workloads_train_evaluate_and_name_their_blocks(data_root, name):
    from gact_examples.workloads import MODELS, workload

    assert name in MODELS
    torch.manual_seed(0)
    work = workload(name, str(data_root))
    before = [p.detach().clone() for p in work.model.parameters()]
    for i in range(2):
        loss = work.loss(i)
        work.optimizer.zero_grad()
        loss.backward()
        work.optimizer.step()
    assert torch.isfinite(loss) and work.model.training
    assert any(not torch.equal(a, p) for a, p in zip(before, work.model.parameters()))
    metrics = work.evaluate()
    assert set(metrics) == {"loss", "accuracy"} and math.isfinite(metrics["loss"])
    assert 0.0 <= metrics["accuracy"] <= 1.0 and work.model.training
    assert work.blocks and all(work.model.get_submodule(b) is not None for b in work.blocks)


@pytest.mark.parametrize("name", ["bert", "resnet18", "char-gpt", "mnist", "gcn", "encoder6"])
def test_workloads_live_on_the_device_given(data_root, name):
    """Every input, label, mask and graph of a workload follows its model to ``device`` (the
    meta device stands in for a GPU: one CPU tensor left in a step would raise). Not GPT-2:
    transformers' loss calls ``.item()``, which meta tensors cannot answer; its windows come
    from the same device-resident corpus as BERT's and char-GPT's."""
    from gact_examples.workloads import workload

    work = workload(name, str(data_root), "meta")
    assert all(p.device.type == "meta" for p in work.model.parameters())
    loss = work.loss(3)
    assert loss.device.type == "meta" and loss.requires_grad
    loss.backward()
    assert all(p.grad is None or p.grad.device.type == "meta" for p in work.model.parameters())


def test_workloads_reject_unknown_models(data_root):
    from gact_examples.workloads import workload

    with pytest.raises(ValueError, match="unknown model 'nomodel'"):
        workload("nomodel", str(data_root))


def test_speed_bench(data_root, tmp_path, script):
    """speed_bench.py: levels interleaved in rounds, ratios to fp32 per round, the table."""
    out = tmp_path / "s.json"
    argv = ["--data", str(data_root), "--models", "gcn", "--levels", "L0,L1", "--rounds", "2"]
    results = script("speed_bench.py").main([*argv, "--steps", "1", "--json", str(out)])
    (res,) = results
    assert list(res["levels"]) == ["fp32", "L0", "L1"]
    assert res["levels"]["fp32"]["ratios"] == [1.0, 1.0]
    for row in res["levels"].values():
        assert len(row["ratios"]) == 2 and row["ratio_worst"] >= row["ratio_median"] > 0
    assert json.loads(out.read_text())["results"] == results
    table = script("speed_bench.py").table(results)
    assert table.splitlines()[2].startswith("| gcn | ") and "(worst " in table
    with pytest.raises(ValueError, match=r"unknown model\(s\) \['nomodel'\]"):
        script("speed_bench.py").main(["--data", str(data_root), "--models", "nomodel"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"--device cuda: torch\.cuda\.is_available"):
            script("speed_bench.py").main(["--data", str(data_root), "--device", "cuda"])


def test_speed_bench_profile(data_root, script):
    """speed_bench.py --profile: one profiled step per level, GACT's packs and unpacks counted
    and timed from its profiler ranges; fp32 has none."""
    bench = script("speed_bench.py")
    argv = ["--data", str(data_root), "--models", "mnist", "--levels", "L0,L1", "--rounds", "1"]
    (res,) = bench.main([*argv, "--steps", "1", "--profile"])
    fp32, l0, l1 = (res["levels"][lv]["profile"] for lv in ("fp32", "L0", "L1"))
    assert fp32["packs"] == fp32["unpacks"] == 0
    assert l1["packs"] >= l1["unpacks"] > 0 and l1["pack_us"] > 0 and l1["unpack_us"] > 0
    assert l0["packs"] == l1["packs"]  # L0 handles the same saves, only keeps them
    assert "syncs" not in l1  # CUDA figures only on CUDA
    text = bench.profile_table([res])
    assert text.count("| mnist |") == 3 and "| - | - |" in text


def test_speed_bench_compiled(data_root, script):
    """speed_bench.py --compile: every copy compiled, fp32's too; GACT's sites compressed."""
    argv = ["--data", str(data_root), "--models", "mnist", "--levels", "L1", "--rounds", "1"]
    (res,) = script("speed_bench.py").main([*argv, "--steps", "1", "--compile", "aot_eager"])
    assert res["backend"] == "aot_eager" and list(res["levels"]) == ["fp32", "L1"]
    assert res["levels"]["L1"]["ratio_median"] > 0


def test_recomputed_activations(data_root, tmp_path, script):
    """recomputed_activations.py: GPT-2 with a composite activation stores fewer bytes with its
    intermediates recomputed; the time and training rows of both variants and fp32."""
    pytest.importorskip("transformers")
    out = tmp_path / "ra.json"
    argv = ["--data", str(data_root), "--activations", "quick_gelu", "--levels", "L1",
            "--time-levels", "L1", "--rounds", "1", "--steps", "1", "--train-steps", "2",
            "--seeds", "0", "--train-activations", "gelu_new", "--json", str(out)]  # fmt: skip
    records = script("recomputed_activations.py").main(argv)
    memory = {r["variant"]: r for r in records if r["kind"] == "memory"}
    assert memory["recomputed"]["stored_bytes"] < memory["stored"]["stored_bytes"]
    assert memory["recomputed"]["original_bytes"] == memory["stored"]["original_bytes"]
    assert sorted(r["variant"] for r in records if r["kind"] == "time") == ["recomputed", "stored"]
    runs = [(r["level"], r["variant"]) for r in records if r["kind"] == "train"]
    assert runs == [("fp32", "-"), ("L2", "recomputed"), ("L2", "stored")]
    assert json.loads(out.read_text()) == records


def test_compile_bench(data_root, tmp_path, script):
    """compile_bench.py: eager and compiled runs from the same weights on the same batches; the
    loss against the eager run of the level, the live peak against the fp32 run of the backend."""
    bench = script("compile_bench.py")
    out = tmp_path / "cb.json"
    argv = ["--data", str(data_root), "--models", "mnist", "--steps", "3", "--tail", "2"]
    runs = "eager:L2,aot_eager:L2,aot_eager:fp32"
    records = bench.main([*argv, "--runs", runs, "--peak-step", "1", "--json", str(out)])
    assert [r["run"] for r in records] == ["eager L2", "aot_eager L2", "aot_eager fp32"]
    eager, compiled, fp32 = records
    assert all(len(r["losses"]) == 3 and r["peak_bytes"] > 0 for r in records)
    assert eager["graphs"] == 0 and compiled["graphs"] >= 1 and fp32["graphs"] >= 1
    assert compiled["compiled_compressed"] > 0 and compiled["ratio"] > 3
    assert eager["compiled_compressed"] == 0 and "ratio" not in fp32
    assert compiled["peak_bytes"] < fp32["peak_bytes"]
    assert json.loads(out.read_text()) == records
    table = bench.table(records, 2).splitlines()
    assert table[2].startswith("| mnist | eager L2 |") and "+0.00%" in table[2]
    assert table[4].startswith("| mnist | aot_eager fp32 |") and "| 1.00x |" in table[4]
    with pytest.raises(ValueError, match=r"unknown model\(s\) \['nomodel'\]"):
        bench.main(["--data", str(data_root), "--models", "nomodel"])
    with pytest.raises(ValueError, match="BACKEND:LEVEL"):
        bench.main(["--data", str(data_root), "--models", "mnist", "--runs", "L1"])


def test_compile_bench_gradient_error(data_root, script):
    """--gradient-error: per run, the relative squared error of GACT's gradient against the
    same backend's fp32 gradient at fixed weights; the rounding streams advance from sample to
    sample, and an adaptive level adapts on its schedule."""
    bench = script("compile_bench.py")
    argv = ["--data", str(data_root), "--models", "mnist", "--warmup", "1"]
    runs = "eager:L1,aot_eager:L1,eager:L1.2,eager:L2,eager:L2@L1"
    records = bench.main([*argv, "--gradient-error", "12", "--runs", runs])
    l1, compiled, l12, l2, matched = records
    for r in records:
        assert len(r["errors"]) == 12 and len(set(r["errors"])) > 1  # other rounding each time
        assert 0 < r["error"] < 1
    assert l1["adapted_at"] == [] and l2["adapted_at"] == [10]  # its first measured adaptation
    assert l2["error"] == pytest.approx(sum(l2["errors"][11:]) / 1)
    assert l1["error"] == pytest.approx(sum(l1["errors"]) / 12)
    assert l12["error"] > 4 * l1["error"]  # 2 bits: 16x the rounding variance of 4 bits
    assert 0.5 < compiled["error"] / l1["error"] < 2  # the same 4 bits in a compiled graph
    assert matched["ratio"] == pytest.approx(l1["ratio"], rel=0.02)  # L1's bytes, not L2's
    assert matched["ratio"] < l2["ratio"]
    budget = ["--memory-budget", str(l1["stored_bytes"])]  # the adaptive levels at those bytes
    (given,) = bench.main([*argv, "--gradient-error", "2", "--runs", "eager:L2", *budget])
    assert given["stored_bytes"] == pytest.approx(l1["stored_bytes"], rel=0.02)
    rows = bench.gradient_table(records).splitlines()
    assert rows[3].startswith("| mnist | aot_eager L1 | 0 |") and rows[3].count("x |") == 2
    with pytest.raises(ValueError, match="leave fp32 out of --runs"):
        bench.main([*argv, "--gradient-error", "2", "--runs", "eager:fp32"])


def test_compile_bench_blocks(data_root, script):
    """BACKEND/blocks compiles each of the workload's blocks alone: their saves, inputs
    included (NOTE [Compiled saves] in gact/compiled.py), are compressed inside the graphs."""
    bench = script("compile_bench.py")
    argv = ["--data", str(data_root), "--models", "mnist", "--steps", "2", "--tail", "1"]
    runs = "aot_eager/blocks:L1,aot_eager/blocks:fp32"
    compiled, fp32 = bench.main([*argv, "--runs", runs, "--peak-step", "1"])
    assert compiled["run"] == "aot_eager/blocks L1" and compiled["graphs"] >= 3  # one a stage
    assert compiled["compiled_compressed"] > 0 and compiled["ratio"] > 3
    assert compiled["peak_bytes"] < fp32["peak_bytes"]


def test_compile_bench_seeds(data_root, script):
    """--seeds repeats every run per seed (weights and rounding streams), each compared with the
    eager run of its level and seed; differences() summarises the compiled runs over seeds."""
    bench = script("compile_bench.py")
    argv = ["--data", str(data_root), "--models", "mnist", "--steps", "2", "--tail", "1"]
    records = bench.main([*argv, "--runs", "eager:L1", "--seeds", "0,1"])
    assert [r["seed"] for r in records] == [0, 1]
    assert records[0]["losses"] != records[1]["losses"]  # other weights, other rounding

    def run(backend, seed, tail_loss):
        return {"model": "m", "run": f"{backend or 'eager'} L2", "backend": backend,
                "level": "L2", "seed": seed, "losses": [9.0, tail_loss]}  # fmt: skip

    fake = [
        run(None, 0, 2.0),
        run("inductor", 0, 2.02),
        run(None, 1, 4.0),
        run("inductor", 1, 3.96),
    ]
    (d,) = bench.differences(fake, tail=1)
    assert d["run"] == "inductor L2" and d["seeds"] == 2
    assert d["percent"] == pytest.approx([1.0, -1.0]) and d["mean"] == pytest.approx(0.0)
    assert d["sd"] == pytest.approx(math.sqrt(2)) and d["se"] == pytest.approx(1.0)
    (single,) = bench.differences(fake[:2], tail=1)
    assert single["mean"] == pytest.approx(1.0) and math.isnan(single["sd"])
    for bad in ("", "0,x", "-1"):
        with pytest.raises(ValueError, match="--seeds takes comma-separated integers"):
            bench.main([*argv, "--runs", "eager:L1", "--seeds", bad])


def test_compare(data_root, tmp_path, script):
    """compare.py: one process per method, both peaks, the table with its Pareto marks."""
    compare = script("compare.py")
    assert compare.pareto({"a": (1, 1.0), "b": (2, 0.5), "c": (2, 1.0)}) == {"a", "b"}
    out = tmp_path / "c.json"
    argv = ["--data", str(data_root), "--models", "gcn", "--methods", "ckpt,selective,L1,L1+ckpt"]
    records = compare.main(
        [*argv, "--steps", "4", "--json", str(out), "--plot", str(tmp_path / "c.png")]
    )
    assert [r["method"] for r in records] == ["fp32", "ckpt", "selective", "L1", "L1+ckpt"]
    assert json.loads(out.read_text()) == records and (tmp_path / "c.png").stat().st_size > 0
    for r in records:
        assert "error" not in r, r
        assert r["live_bytes"] > 0 and r["rss_bytes"] > 0 and r["step_s"] > 0
        assert math.isfinite(r["loss"]) and 0 <= r["accuracy"] <= 1
    # checkpointing recomputes exactly: the same training as fp32's
    assert records[1]["loss"] == records[0]["loss"]
    text = compare.table(records)
    assert text.count("| gcn |") == 5 and "*" in text
    with pytest.raises(ValueError, match=r"unknown model\(s\) or method\(s\) \['nomethod'\]"):
        compare.main(["--data", str(data_root), "--methods", "nomethod"])
    # offloading and L3 are GPU methods: asked for on the CPU, they are refused up front
    with pytest.raises(ValueError, match="offload, L3 run on CUDA only"):
        compare.main(["--data", str(data_root), "--methods", "fp32,offload"])
    with pytest.raises(ValueError, match="'L3' runs on CUDA only"):
        compare.worker("gcn", "L3", 4, str(data_root))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"--device cuda: torch\.cuda\.is_available"):
            compare.main(["--data", str(data_root), "--device", "cuda"])


def test_checkpoint_blocks_wraps_the_named_modules(script):
    compare = script("compare.py")
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    )
    x = torch.randn(3, 4, requires_grad=True)
    expected = torch.autograd.grad(model(x).sum(), x)[0]
    compare.checkpoint_blocks(model, ["0", "1.0"])
    assert isinstance(model[0], compare.Checkpointed)
    assert isinstance(model[1][0], compare.Checkpointed)
    assert torch.equal(torch.autograd.grad(model(x).sum(), x)[0], expected)


def test_group_layouts_script(data_root, tmp_path, script):
    """group_layouts.py: a row per linear layer and width, every layout's error positive, and
    on the LLaMA-style decoder's query projection (its input a RMSNorm's output times learned
    gains) feature groups round no worse than memory-order groups of 256."""
    pytest.importorskip("transformers")  # examples[transformers], in tests(examples)
    out = tmp_path / "g.json"
    argv = ["--data", str(data_root), "--warmup", "2", "--draws", "2", "--batch-size", "4"]
    rows = script("group_layouts.py").main([*argv, "--json", str(out)])
    assert json.loads(out.read_text()) == rows
    assert {r["bits"] for r in rows} == {2, 4} and len(rows) == 2 * 15  # 7 per layer, lm_head
    assert all(r[k] > 0 for r in rows for k in script("group_layouts.py").LAYOUTS)
    query = [r for r in rows if r["layer"].endswith("layers.0.self_attn.q_proj")]
    assert all(r["feature groups"] <= r["memory order, 256"] for r in query)


def test_rotation_bench_script(data_root, tmp_path, script):
    """rotation_bench.py: the saves an L1 step rotates are the down projections' inputs, and
    only their layers' gradient errors differ between rotated and plain groups (same seeds)."""
    pytest.importorskip("transformers")  # examples[transformers], in tests(examples)
    out = tmp_path / "r.json"
    argv = ["--data", str(data_root), "--warmup", "2", "--draws", "1", "--rounds", "1"]
    argv += ["--steps", "1", "--batch-size", "4", "--json", str(out)]
    result = script("rotation_bench.py").main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["rotated_saves"] and all(s[-1] == 176 for s in result["rotated_saves"])
    for row in result["errors"]:
        assert row["plain"] > 0 and row["rotated"] > 0
        if "down_proj" not in row["layer"]:
            assert row["rotated"] == row["plain"]
    assert set(result["step"]) == {"fp32", "L1 plain", "L1 rotated"}


def test_view_saves(tmp_path, script):
    """The activation's and the attention's outputs of each layer of PyTorch's transformer
    layer without dropout are stored once with their views (NOTE [Aliased saves]); dropout
    makes the views' bases tensors nothing else saves."""
    out = tmp_path / "views.json"
    argv = "--models encoder-relu,encoder-relu-dropout,tanh-mlp --levels L0,L1 --batch 2 "
    argv += f"--tokens 16 --width 32 --json {out}"
    records = script("view_saves.py").main(argv.split())
    assert json.loads(out.read_text()) == records
    found = {(r["model"], r["level"]): r for r in records}
    assert found["encoder-relu", "L1"]["deduplicated_saves"] == 4  # 2 layers x (ReLU, attention)
    assert found["encoder-relu-dropout", "L1"]["deduplicated_saves"] == 0
    assert found["tanh-mlp", "L1"]["deduplicated_saves"] == 1
    for (_, level), r in found.items():
        assert (r["stored_bytes"] < r["original_bytes"]) == (level == "L1")


def test_view_saves_rejects_unknown_models(script):
    with pytest.raises(SystemExit):
        script("view_saves.py").main(["--models", "resnet"])


def test_view_saves_fresh_processes(script):
    """``--fresh`` measures each model and level in its own process: the peak resident size of
    its steps, GACT's statistics as in-process."""
    argv = "--models tanh-mlp --levels fp32,L1 --batch 2 --tokens 16 --width 32 --steps 2"
    fresh = script("view_saves.py").main([*argv.split(), "--fresh", "--malloc", "tuned"])
    here = script("view_saves.py").main(argv.split())
    assert [r["level"] for r in fresh] == ["fp32", "L1"]
    assert all(r["peak_rss_growth_bytes"] >= 0 and r["malloc"] == "tuned" for r in fresh)
    for key in ("stored_bytes", "original_bytes", "deduplicated_saves"):
        assert [r[key] for r in fresh] == [r[key] for r in here]
    assert fresh[1]["deduplicated_saves"] == 1 and fresh[0]["stored_bytes"] == 0
