"""``strategy="compiled_fsdp"`` on 2 gloo processes (CPU), checked against float64 eager DDP arithmetic.

Three launches of fsdp_script.py serve every multi-process check (they are the expensive part):
  A. 2 "nodes" x 1 process under ``torchrun --nnodes 2`` on localhost, 20 steps uninterrupted;
  B. 1 node x 2 processes (Lightning's launcher), rank 1 SIGKILLed at step 13, started beside A;
  C. B resumed from its last sharded checkpoint (step 10) on 2 SLURM "nodes" x 1 task (the SLURM_* variables
     srun sets, on 2 local processes); then, in the same processes, a checkpoint of 1 process (written here
     while A and B run) resumed mid-epoch on 2.
A equals the float64 replay (a), holds half of each tensor per rank (b), compiles once (d); C's weights
equal A's bit for bit, which shows that a killed run resumes exactly (c), that 2 nodes x 1 process train as
1 node x 2 processes do (B's first 10 steps), and that Lightning's SLURM environment runs it. C's second run
gives the resume on another world size (1 -> 2 -> 1).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lcv_kernels.tolerances import network_length, reduction_tolerance, tolerance, trajectory_tolerance
from logged_process import LoggedProcess

HERE = Path(__file__).parent
SCRIPT = str(HERE / "fsdp_script.py")
TIMEOUT = 300

pytestmark = [pytest.mark.xdist_group("fsdp"), pytest.mark.timeout(900)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK"):
        env.pop(name, None)
    for name in [n for n in env if n.startswith("SLURM_")]:  # a test run inside a SLURM job
        env.pop(name)
    env.update(extra)
    return env


def _slurm_job_id() -> str:
    """A job id whose port (Lightning's SLURMEnvironment: 15000 + its last 4 digits) is free here."""
    for _ in range(100):
        job = str(int.from_bytes(os.urandom(2), "little") % 10000).zfill(4)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 15000 + int(job)))
            except OSError:
                continue
        return "7" + job
    raise RuntimeError("no free port in 15000..24999")


def _srun_env(job: str, node: int) -> dict[str, str]:
    """What ``srun --nodes 2 --ntasks-per-node 1`` sets for the task on ``node`` (the variables Lightning's
    SLURMEnvironment reads); the address of the first node comes from the node list."""
    return {
        "SLURM_JOB_ID": job,
        "SLURM_JOB_NAME": "fsdp_script",
        "SLURM_NODELIST": "localhost",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_PROCID": str(node),
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(node),
    }


def _start(args: list[str], env: dict[str, str]) -> LoggedProcess:
    # output to a file: the fixture waits on one run while the others train (see tests/logged_process.py)
    return LoggedProcess(args, env=env)


def _finish(proc: LoggedProcess) -> tuple[int, str]:
    code, output = proc.finish(TIMEOUT)
    return code, output[-4000:]


def _fit_one_process(out: Path, ckpt_path: Path | None, **trainer_kwargs) -> list:
    """fsdp_script.fit_device_loader's training on one plain process (``compiled``, no compile):
    the (epoch, batch_idx, sample indices) of each batch it trained on."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_plugin
    from fsdp_script import IdDataModule, IdModule

    torch.manual_seed(0)
    module = IdModule()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=lightning_plugin.CompiledStrategy(compile="never", tune_cpu=False),
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", save_top_k=-1, every_n_train_steps=7)],
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        **trainer_kwargs,
    )
    trainer.fit(module, datamodule=IdDataModule(), ckpt_path=ckpt_path)
    return module.seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fsdp")
    a, b = root / "two_nodes", root / "killed"
    port = str(_free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    # aot_eager in all six ranks: the subjects are sharding, checkpoints and resumes (and a resumed run must
    # equal the uninterrupted one bitwise, so all use one backend). FSDP2's hooks stay outside the compiled
    # blocks (each is compiled before it is sharded), so a block's graph is the same on one rank or two, and
    # test_strategy_names.py fits "compiled_fsdp" with Inductor.
    backend = ["--backend", "aot_eager"]
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", port]
    nodes = [
        _start(
            [
                *torchrun,
                "--node-rank",
                str(n),
                *rendezvous,
                SCRIPT,
                str(a),
                "--num-nodes",
                "2",
                "--devices",
                "1",
                *backend,
            ],
            _env(),
        )
        for n in (0, 1)
    ]
    killed = _start(
        [sys.executable, SCRIPT, str(b), "--kill-at", "13", *backend], _env(MASTER_PORT=str(_free_port()))
    )
    # 1 process -> 2: 7 steps of one process here (while A and B run), continued by C's processes.
    one, two = root / "one_process", root / "two_processes"
    one.mkdir()
    (one / "seen.json").write_text(json.dumps(_fit_one_process(one, None, max_steps=7)))
    grow = ["--then-device-loader", str(two), str(one / "checkpoints" / "epoch=0-step=7.ckpt")]
    code, output = _finish(killed)
    assert code != 0, "the run whose rank 1 was killed ended normally:\n" + output
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["epoch=0-step=10.ckpt"]
    # C: 2 SLURM "nodes" x 1 task, beside A (which is still running): started here as srun would start them.
    resume = [SCRIPT, str(b), "--resume", str(b / "checkpoints" / "epoch=0-step=10.ckpt"), *grow, *backend]
    job = _slurm_job_id()
    resumed = [
        _start([sys.executable, *resume, "--num-nodes", "2", "--devices", "1"], _env(**_srun_env(job, n)))
        for n in (0, 1)
    ]
    for code, output in [_finish(p) for p in (*nodes, *resumed)]:
        assert code == 0, output
    return {"two_nodes": a, "resumed": b, "one_process": one, "two_processes": two}


def _result(run: Path) -> dict:
    return json.loads((run / "result.json").read_text())


def test_weights_equal_float64_eager_ddp(runs):
    from fsdp_reference import reference_state

    reference = reference_state()
    final = torch.load(runs["two_nodes"] / "final.pt")
    assert set(final) == set(reference)
    from fsdp_script import BATCH, EPOCHS, SAMPLES, Net

    steps = EPOCHS * SAMPLES // (BATCH * 2)  # two ranks, each a batch of BATCH per step
    atol, rtol = trajectory_tolerance(torch.float32, network_length(Net(), (BATCH, 3, 8, 8)), steps)
    for key, expected in reference.items():
        torch.testing.assert_close(final[key].to(expected.dtype), expected, atol=atol, rtol=rtol, msg=key)


def test_each_rank_holds_half_of_parameters_and_optimizer_state(runs):
    info = _result(runs["two_nodes"])
    assert info["world_size"] == 2 and info["dtensor_params"]
    full = info["param_bytes_full"]  # SGD's momentum: one fp32 tensor per parameter, as large
    for param_bytes, optimizer_bytes in info["bytes_per_rank"]:
        assert param_bytes == full // 2  # every first dimension is even: exactly half
        assert optimizer_bytes == full // 2


def test_blocks_compiled_once_without_breaks(runs):
    info = _result(runs["two_nodes"])
    assert info["steps"] == 20 and info["blocks"] == 4  # 2 blocks of the model, 2 of its EMA copy
    assert info["graphs"] >= 1 and info["graph_breaks"] == 0 and not info["fell_back"]
    assert info["recompiles"] == []
    assert info["frames"] == info["frames_after_step_2"]  # nothing compiled after step 2


def test_killed_run_resumes_to_the_weights_of_two_nodes_uninterrupted(runs):
    """B (1 node x 2 processes, Lightning's launcher) to step 10, resumed by C on 2 SLURM "nodes" x 1 task
    (SLURM_* variables as srun sets them: Lightning's SLURMEnvironment gives the ranks, the node ranks, the
    address and the port), ends equal to A (2 nodes under torchrun) bit for bit."""
    two_nodes, resumed = _result(runs["two_nodes"]), _result(runs["resumed"])
    assert (two_nodes["cluster_environment"], two_nodes["node_ranks"]) == ("TorchElasticEnvironment", [0, 1])
    assert (resumed["cluster_environment"], resumed["node_ranks"]) == ("SLURMEnvironment", [0, 1])
    resumed = torch.load(runs["resumed"] / "final.pt")
    uninterrupted = torch.load(runs["two_nodes"] / "final.pt")
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key


def test_consolidated_checkpoint_resumes_in_one_plain_process(runs, tmp_path):
    """2 ranks -> 1: the sharded checkpoint as one file; the `compiled` strategy resumes from it."""
    import lightning_plugin
    from fsdp_script import BATCH, Module, make_data
    from lightning_plugin.strategies.fsdp_checkpoint import consolidate_checkpoint

    sharded = runs["two_nodes"] / "checkpoints" / "epoch=1-step=20.ckpt"
    out = tmp_path / "full.ckpt"
    checkpoint = consolidate_checkpoint(sharded, out)
    final = torch.load(runs["two_nodes"] / "final.pt")
    assert set(checkpoint["state_dict"]) == set(final)
    for key, value in final.items():
        assert torch.equal(checkpoint["state_dict"][key], value), key
    module = Module()
    optimizer = module.configure_optimizers()
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    assert len(optimizer.state) == 10  # the model's parameters; the EMA's are frozen

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=lightning_plugin.CompiledStrategy(compile="never", tune_cpu=False),
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(make_data(), batch_size=2 * BATCH), ckpt_path=out)
    assert trainer.global_step == 30


def test_resume_on_another_world_size_uses_each_sample_of_the_epoch_once(runs, tmp_path):
    """1 process -> 2 -> 1 within one epoch of the project's loader (80 samples, batch 4, shuffled): 7 steps
    on one process; 2 processes (compiled_fsdp) resume there and save at step 10; that sharded checkpoint,
    consolidated, is resumed on one process. The samples trained on before and after each change make up
    the epoch, each once (without the remap, 1 -> 2 repeats the first 28 samples and 2 -> 1 skips some)."""
    from lightning_plugin.strategies.fsdp_checkpoint import consolidate_checkpoint

    one = json.loads((runs["one_process"] / "seen.json").read_text())
    two = [json.loads((runs["two_processes"] / f"seen_rank{r}.json").read_text()) for r in range(2)]
    full = tmp_path / "step10.ckpt"
    consolidate_checkpoint(runs["two_processes"] / "checkpoints" / "epoch=0-step=10.ckpt", full)
    back = _fit_one_process(tmp_path, full, max_epochs=1)

    def samples(*batches: list) -> list[int]:
        assert all(epoch == 0 for part in batches for epoch, _, _ in part)
        return sorted(i for part in batches for _, _, ids in part for i in ids)

    assert [b for _, b, _ in one] == list(range(7))
    assert all([b for _, b, _ in rank] == list(range(7, 14)) for rank in two)  # 52 samples: 7 batches each
    assert [b for _, b, _ in back] == list(range(10, 17))  # 80 - 28 - 3 * 2 * 4 = 28 samples: 7 batches
    assert samples(one, *two) == list(range(80))
    before_save = [[batch for batch in rank if batch[1] < 10] for rank in two]
    assert samples(one, *before_save, back) == list(range(80))


def test_atomic_save_keeps_the_last_checkpoint_when_a_save_fails(tmp_path, monkeypatch):
    import lightning.pytorch.strategies.model_parallel as model_parallel

    from lightning_plugin import CompiledFSDPStrategy

    strategy = CompiledFSDPStrategy()
    target = tmp_path / "last.ckpt"
    stale = tmp_path / ".last.ckpt.partial"
    stale.mkdir()  # left by a run killed while saving
    strategy.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, target)
    assert (target / ".metadata").is_file() and not stale.exists()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(model_parallel, "_distributed_checkpoint_save", fail)
    with pytest.raises(OSError, match="disk full"):
        strategy.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "epoch": 2}, target)
    assert torch.load(target / "meta.pt")["epoch"] == 1


def test_sharding_units_come_from_the_block_registry():
    """The blocks, not their containers (a registered ResNet, a model beside its EMA copy) nor their layers."""
    torchvision = pytest.importorskip("torchvision")
    from fsdp_script import Module
    from lcv_vision.models import create_model
    from lightning_plugin.strategies.fsdp_units import block_units, mixed_precision_policy

    def units(model):
        found = block_units(model)
        return len(found), sorted({type(u).__name__ for u in found})

    assert units(torchvision.models.resnet18(num_classes=4)) == (8, ["BasicBlock"])
    assert units(create_model("resnet18", num_classes=4)) == (
        8,
        ["BasicBlock"],
    )  # ResNet itself is registered
    assert units(create_model("vit_tiny_patch4_32", num_classes=4)) == (6, ["Block"])
    assert units(Module()) == (4, ["ConvBlock"])  # 2 in the model, 2 in its EMA copy
    timm = pytest.importorskip("timm")
    assert units(timm.create_model("vit_tiny_patch16_224")) == (12, ["Block"])  # 2 LayerNorm leaves per block
    assert units(timm.create_model("convnext_atto")) == (12, ["ConvNeXtBlock"])
    assert mixed_precision_policy("bf16-mixed").param_dtype == torch.bfloat16
    assert mixed_precision_policy("bf16-mixed").reduce_dtype == torch.float32
    assert mixed_precision_policy("32-true").param_dtype is None


def test_registered_by_name():
    from lightning_plugin import CompiledFSDPStrategy

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="compiled_fsdp", logger=False)
    assert isinstance(trainer.strategy, CompiledFSDPStrategy)


def test_sync_batchnorm_needs_a_gpu():
    """``sync_batchnorm=True`` would convert to SyncBatchNorm, which torch syncs on accelerators only: the
    strategy says so up front (the GPU check covers the CUDA path)."""
    import torch.distributed as dist

    from lightning_plugin import CompiledFSDPStrategy

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        bn = torch.nn.SyncBatchNorm(4).train()
        with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
            bn(torch.randn(2, 4, 3, 3))
    finally:
        dist.destroy_process_group()
    strategy = CompiledFSDPStrategy()
    strategy.parallel_devices = [torch.device("cpu")]
    with pytest.raises(ValueError, match=r"sync_batchnorm=True\) needs a GPU"):
        strategy._check_layer_sync()


@pytest.fixture
def one_process_group():
    """compiled_fsdp on one device starts a process group in this process: close it and its variables."""
    import torch.distributed as dist

    environ = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


def _fit_tiny(strategy, precision: str = "32-true"):
    from boring import TRAINER_KWARGS, TinyModule, make_loader

    torch.manual_seed(0)
    module = TinyModule()
    trainer = L.Trainer(
        **{
            **TRAINER_KWARGS,
            "strategy": strategy,
            "precision": precision,
            "limit_train_batches": 3,
            "use_distributed_sampler": False,
        }
    )
    trainer.fit(module, make_loader(n=24, batch_size=8))
    return trainer, module


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_activation_checkpointing_and_mixed_precision_on_one_rank(precision, one_process_group):
    """Recomputed blocks (BatchNorm inside) train as eager does: the recompute must not update BatchNorm's
    statistics a second time. Under bf16-mixed the blocks holding BatchNorms gather in fp32, with no break."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_plugin import CompiledFSDPStrategy

    strategy = CompiledFSDPStrategy(activation_checkpointing=True, backend="aot_eager", compile="always")
    trainer, module = _fit_tiny(strategy, precision)
    plan = trainer.strategy.sharding_plan
    assert len(plan.blocks) == 2 and len(plan.fp32_units) == (2 if precision == "bf16-mixed" else 0)
    stats = trainer.strategy.compile_stats
    assert stats.graphs >= 1 and stats.graph_breaks == 0 and not stats.fell_back
    got = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    assert all(v.dtype in (torch.float32, torch.int64) for v in got.values())

    eager_trainer, eager = _fit_tiny("auto", precision)
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    if dtype == torch.bfloat16:
        atol, rtol = tolerance("norm_grad", dtype)
    else:  # 24 samples in batches of 8: three steps
        atol, rtol = trajectory_tolerance(dtype, network_length(eager.net, (8, 3, 8, 8)), 3)
    for key, expected in eager.state_dict().items():
        torch.testing.assert_close(got[key].to(expected.dtype), expected, atol=atol, rtol=rtol, msg=key)


def test_lcv_export_of_a_sharded_checkpoint_gives_the_eager_logits(one_process_group, tmp_path, monkeypatch):
    """A digits-small run of ``lcv fit``'s module on ``compiled_fsdp`` (1 process, 2 steps) saves a sharded
    folder; consolidated, ``lcv export`` packages it, and the package's logits are those of the trained
    module gathered in the training process (the folder itself loads to the same network)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import lcv_vision.data.compiled as compiled
    from lcv_vision.cli import main as lcv
    from lcv_vision.deploy import load_package
    from lcv_vision.deploy.export import load_trained
    from lcv_vision.module import ClassificationModule
    from lcv_vision.recipes import build
    from lightning_plugin import CompiledFSDPStrategy
    from lightning_plugin.strategies.fsdp_checkpoint import consolidate_checkpoint

    # The augmentation graphs run eagerly (no Inductor compile of them): the checkpoint's path to a package is
    # under test, not the data pipeline (tests/data/test_data_compiled.py).
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    L.seed_everything(0, verbose=False)
    module, datamodule = build("digits-small")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=CompiledFSDPStrategy(compile="never", tune_cpu=False),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=datamodule)
    sharded = tmp_path / "sharded.ckpt"
    trainer.save_checkpoint(sharded)
    assert (sharded / ".metadata").is_file()
    gathered = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    full = tmp_path / "full.ckpt"
    consolidated = consolidate_checkpoint(sharded, full)["state_dict"]
    assert set(consolidated) == set(gathered)
    assert all(torch.equal(consolidated[k], v) for k, v in gathered.items())

    package = tmp_path / "digits.pt2"
    lcv(["export", str(full), "--out", str(package)])
    images = datamodule._build()["test"].images[:32]
    eager = ClassificationModule.load_from_checkpoint(full, map_location="cpu", weights_only=False).eval()
    assert eager.ema is not None  # the recipe evaluates the EMA weights; the package must too
    with torch.no_grad():
        reference = eager((images.float() / 255.0 - 0.5) / 0.5)  # digits-small's normalisation
    logits = load_package(package)(images)
    fan_ins = [
        m.weight[0].numel()
        for m in eager.ema.module.modules()
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))
    ]
    atol, _ = reduction_tolerance(torch.float32, sum(fan_ins))
    assert (logits - reference).abs().max().item() <= atol * (1.0 + reference.abs().max().item())
    assert torch.equal(logits.argmax(1), reference.argmax(1))
    from_folder = load_trained(sharded).network.state_dict()
    assert all(torch.equal(v, eager.ema.module.state_dict()[k]) for k, v in from_folder.items())
