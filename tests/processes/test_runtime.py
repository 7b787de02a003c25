"""The on-node runtime with real torch.distributed processes (gloo on CPU, fork).

One 8-process HSDP run (2 nodes x 4, shard 2, cyclic SLURM_PROCIDs) is shared by several
tests (groups, layout.json, replica shards, loss, reference, 1/S memory); the others
restart from or reshape its checkpoint. Tensor work happens in child processes
(``in_child``), so that the parent stays safe to fork.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import env_outside_job, hpc
from dist_helpers import in_child, job_envs, launch

from hpc_hsdp.errors import HsdpError
from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.plan.slurm_env import task_environments
from hpc_hsdp.plan.topology import plan_for
from hpc_hsdp.rundir.files import read_jsonl
from hpc_hsdp.task.checkpointing.checkpoint import complete_checkpoints
from tests.job_helpers import tiny_job
from tests.runtime_helpers import (
    compare_checkpoints,
    compare_states,
    full_checkpoint,
    synthetic_rows,
    wrapped_collectives,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = TrainingSpec.of(
    layers=2,
    width=32,
    heads=4,
    seq_len=16,
    batch_size=4,
    vocab_size=64,
    steps=6,
    seed=3,
    lr=1e-2,
    checkpoint_every=3,
    keep_checkpoints=2,
)

pytestmark = pytest.mark.dist


# ----------------------------------------------------------------------------- child-side functions


def train_and_report(ctx):
    """fn for run_task: the built-in training, then what the tests inspect."""
    from torch.distributed.tensor import DTensor

    from hpc_hsdp.task.training.loop import train

    result = train(ctx)
    params = dict(result.model.named_parameters())
    return {
        "summary": result.summary(ctx),
        "comm_stats": ctx.comm_stats,
        "wrapped_collectives": wrapped_collectives(),
        "local_bytes": {n: p.to_local().detach().contiguous().numpy().tobytes() for n, p in params.items()},
        "local_numel": sum(p.to_local().numel() for p in params.values()),
        "total_numel": sum(p.numel() for p in params.values()),
        "placements": sorted({str(p.placements) for p in params.values() if isinstance(p, DTensor)}),
        "losses": result.losses,
    }


class SimulatedCrash(Exception):
    pass


def train_then_crash_at_4(ctx):
    from hpc_hsdp.task.training.loop import train

    def on_step(step, record):
        if step == 4:
            raise SimulatedCrash

    try:
        train(ctx, on_step=on_step)
    except SimulatedCrash:
        return "crashed"
    return "finished"


def load_and_dump_full_state(ctx):
    """fn: resume (nothing left to train), then rank 0 saves the full model and optimizer state."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from hpc_hsdp.task.training.loop import train

    result = train(ctx)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(result.model, options=options)
    optim_sd = get_optimizer_state_dict(result.model, result.optimizer, options=options)
    if ctx.is_rank0:
        torch.save({"model": model_sd, "optim": optim_sd}, ctx.run_dir / "loaded_full.pt")
    return {"start_step": result.start_step, "last_step": result.last_step}


def compare_loaded_with_checkpoint(loaded_path, ckpt_path):
    import torch

    loaded = torch.load(loaded_path, weights_only=False)
    saved = full_checkpoint(ckpt_path)
    return {
        "model": compare_states(loaded["model"], saved["model"]),
        "optim_state": compare_states(loaded["optim"]["state"], saved["optim"]["state"]),
        "n_model": len(saved["model"]),
        "n_optim": len(saved["optim"]["state"]),
    }


def single_process_reference(training: TrainingSpec, world_size: int, ckpt_path):
    """Same model, same global batches, plain AdamW, no FSDP; compared with the HSDP checkpoint."""
    import torch

    from hpc_hsdp.models.builtin import ModelConfig, build_model, init_parameters, loss_fn

    model = build_model(ModelConfig.from_training(training), device="cpu")
    init_parameters(model, seed=training.optimizer.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=training.optimizer.lr, weight_decay=0.0)
    losses = {}
    for step in range(1, training.optimizer.steps + 1):
        x, y = synthetic_rows(
            training, step=step, rank=0, world_size=1, batch_size=world_size * training.dataset.batch_size
        )
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses[step] = float(loss)
    saved = full_checkpoint(ckpt_path)["model"]
    ours = model.state_dict()
    max_diff = max(float((ours[k] - saved[k]).abs().max()) for k in ours)
    return {"losses": losses, "max_param_diff": max_diff, "keys_match": sorted(ours) == sorted(saved)}


# ----------------------------------------------------------------------------- the shared run


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hsdp") / "run"
    spec = RunSpec(shard_size=2, run_dir=str(run_dir), device="cpu", training=TINY, timeout_s=120)
    outcomes = launch(spec, tasks_per_node=[4, 4], distribution="cyclic", fn=train_and_report, timeout_s=180)
    return {
        "run_dir": run_dir,
        "by_rank": {o.value["summary"]["rank"]: o.value for o in outcomes},
        "procid_of_rank": {o.value["summary"]["rank"]: o.procid for o in outcomes},
    }


def test_layout_json_under_cyclic_procids_keeps_shard_groups_on_one_node(hsdp_run):
    layout = json.loads((hsdp_run["run_dir"] / "layout.json").read_text())
    plan = plan_for(nodes=2, gpus_per_node=4, shard_size=2, node_names=("n1", "n2"))
    assert layout["plan"] == plan.to_dict()
    ranks = layout["ranks"]
    assert [r["rank"] for r in ranks] == list(range(8))
    assert any(r["slurm_procid"] != r["rank"] for r in ranks), "cyclic PROCIDs must differ from node-major ranks"
    for r in ranks:
        assert r["slurm_procid"] == hsdp_run["procid_of_rank"][r["rank"]]
        assert r["node"] == plan.node_names[plan.node_of_rank[r["rank"]]]
        assert r["local_rank"] == plan.local_rank_of_rank[r["rank"]]
        assert r["device"] == "cpu"
        assert tuple(r["shard_group"]) == plan.shard_group_of(r["rank"])
        assert tuple(r["replicate_group"]) == plan.replicate_group_of(r["rank"])
        assert len({ranks[m]["node"] for m in r["shard_group"]}) == 1
    assert (hsdp_run["run_dir"] / "logs" / "task-1.log").read_text().startswith("[hpc-hsdp] rank 4/8 node n2 procid 1")


def test_collectives_are_not_wrapped_without_comm_stats(hsdp_run):
    """--comm-stats off costs nothing: no recorder, torch's own functions on every rank."""
    for value in hsdp_run["by_rank"].values():
        assert value["comm_stats"] is None and value["wrapped_collectives"] == []


def test_replicas_hold_identical_shards(hsdp_run):
    by_rank = hsdp_run["by_rank"]
    assert by_rank[0]["placements"] == ["(Replicate(), Shard(dim=0))"]
    for group in plan_for(nodes=2, gpus_per_node=4, shard_size=2).replicate_groups:
        first = by_rank[group[0]]["local_bytes"]
        for other in group[1:]:
            assert by_rank[other]["local_bytes"] == first, f"rank {other} differs from rank {group[0]}"
    # and the two ranks of a shard group hold different halves
    assert by_rank[0]["local_bytes"] != by_rank[1]["local_bytes"]


def test_each_rank_holds_one_shard_of_the_parameters(hsdp_run):
    by_rank = hsdp_run["by_rank"]
    total = by_rank[0]["total_numel"]
    for group in ((0, 1), (2, 3)):
        assert sum(by_rank[r]["local_numel"] for r in group) == total
    for value in by_rank.values():
        assert abs(value["local_numel"] - total / 2) <= 0.02 * total  # uneven dim 0 only


def test_loss_decreases_and_metrics_are_complete(hsdp_run):
    records = read_jsonl(hsdp_run["run_dir"] / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, TINY.optimizer.steps + 1))
    assert records[-1]["loss"] < records[0]["loss"] - 0.1
    assert {r["world_size"] for r in records} == {8} and {r["shard_size"] for r in records} == {2}
    assert all(r["tokens_per_s"] > 0 and r["peak_mem_kind"] == "ru_maxrss" for r in records)
    losses = hsdp_run["by_rank"][5]["losses"]
    assert [losses[s] for s in range(1, 7)] == [r["loss"] for r in records]  # same global mean on every rank
    assert [step for step, _ in complete_checkpoints(hsdp_run["run_dir"])] == [3, 6]


def test_matches_single_process_reference(hsdp_run):
    final = hsdp_run["run_dir"] / "checkpoints" / "step-000006"
    ref = in_child(single_process_reference, TINY, 8, final)
    assert ref["keys_match"]
    # Reductions run in another order (reduce-scatter + all-reduce vs one batch); AdamW's
    # normalised update amplifies the rounding of tiny gradients: allow 1 % of one step (lr).
    assert ref["max_param_diff"] < 1e-2 * TINY.optimizer.lr, ref["max_param_diff"]
    records = read_jsonl(hsdp_run["run_dir"] / "metrics.jsonl")
    for record in records:
        assert abs(record["loss"] - ref["losses"][record["step"]]) < 1e-4


def test_resume_on_the_same_mesh_continues_exactly(hsdp_run, tmp_path):
    spec = RunSpec(shard_size=2, run_dir=str(tmp_path / "run"), device="cpu", training=TINY, timeout_s=120)
    first = launch(spec, tasks_per_node=[4, 4], fn=train_then_crash_at_4, timeout_s=180)
    assert {o.value for o in first} == {"crashed"}
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2, 3, 4]
    assert [s for s, _ in complete_checkpoints(spec.run_dir)] == [3]
    # what a crash can leave: a save marked COMPLETE but not yet renamed, a directory never marked
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "step-000005.tmp").mkdir()
    (checkpoints / "step-000005.tmp" / "COMPLETE").write_text("step 5\n")
    (checkpoints / "step-000009").mkdir()

    second = launch(spec, tasks_per_node=[4, 4], timeout_s=180)  # the built-in payload resumes
    assert {o.value["start_step"] for o in second} == {3}  # neither of them is loaded
    assert not (checkpoints / "step-000005.tmp").exists()  # the next save cleared it
    assert {o.value["steps"] for o in second} == {6}
    records = read_jsonl(metrics)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # step 4 rewritten, not repeated
    reference = read_jsonl(hsdp_run["run_dir"] / "metrics.jsonl")
    assert [r["loss"] for r in records] == [r["loss"] for r in reference]
    diffs = in_child(
        compare_checkpoints,
        tmp_path / "run" / "checkpoints" / "step-000006",
        hsdp_run["run_dir"] / "checkpoints" / "step-000006",
    )
    assert diffs == [], f"resumed run differs from the uninterrupted one in {diffs[:5]}"


def test_resume_on_another_mesh_shape_loads_exactly(hsdp_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(hsdp_run["run_dir"] / "checkpoints", run_dir / "checkpoints")
    # half the ranks, the same global batch (8 ranks x 4 samples): the data position carries over
    training = TINY.replace(global_batch_size=8 * TINY.dataset.batch_size)
    spec = RunSpec(shard_size=4, run_dir=str(run_dir), device="cpu", training=training, timeout_s=120)
    outcomes = launch(spec, tasks_per_node=[4], fn=load_and_dump_full_state, timeout_s=120)
    assert {(o.value["start_step"], o.value["last_step"]) for o in outcomes} == {(6, 6)}
    result = in_child(
        compare_loaded_with_checkpoint, run_dir / "loaded_full.pt", hsdp_run["run_dir"] / "checkpoints" / "step-000006"
    )
    assert result["n_model"] > 0 and result["n_optim"] > 0
    assert result["model"] == [] and result["optim_state"] == []


# ----------------------------------------------------------------------------- other launches


def test_16_ranks_2x8_shard_4_groups_match_the_plan(tmp_path):
    training = TrainingSpec.of(layers=1, width=16, heads=2, seq_len=8, batch_size=2, vocab_size=32, steps=2)
    spec = RunSpec(shard_size=4, run_dir=str(tmp_path), device="cpu", training=training, timeout_s=120)
    outcomes = launch(spec, tasks_per_node=[8, 8], distribution="cyclic", timeout_s=240)
    assert {o.value["steps"] for o in outcomes} == {2}
    layout = json.loads((tmp_path / "layout.json").read_text())
    plan = plan_for(nodes=2, gpus_per_node=8, shard_size=4, node_names=("n1", "n2"))
    assert [tuple(r["shard_group"]) for r in layout["ranks"]] == [plan.shard_group_of(r) for r in range(16)]
    assert [tuple(r["replicate_group"]) for r in layout["ranks"]] == [plan.replicate_group_of(r) for r in range(16)]
    assert layout["plan"]["shard_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert layout["plan"]["replicate_groups"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    for group in layout["plan"]["shard_groups"]:
        assert len({layout["ranks"][r]["node"] for r in group}) == 1
    assert [r["slurm_procid"] for r in layout["ranks"]][:4] == [0, 2, 4, 6]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_wrong_layout_fails_loudly_on_every_rank(tmp_path):
    spec = RunSpec(shard_size=2, run_dir=str(tmp_path), device="cpu", training=TINY, timeout_s=60)
    outcomes = launch(
        spec,
        tasks_per_node=[2, 2],
        distribution="cyclic",
        timeout_s=120,
        expect_failure=True,
        extra_env={"HPC_HSDP_FAULT_RANK_FROM_PROCID": "1"},
    )
    assert all(not o.ok for o in outcomes)
    for o in outcomes:
        assert o.value.startswith("GroupMismatchError: the realized device mesh does not match the plan"), o.value[:300]
        assert "axis" in o.value and "planned" in o.value
        table = o.value.split("Traceback")[0]
        assert re.search(r"^shard +\[0,1\] +\[0,1\] +n1,n2 +the plan puts this group inside one node", table, re.M)
        assert re.search(r"^node +\[2,3\] +\[2,3\] +n1,n2 ", table, re.M)
    assert not (tmp_path / "layout.json").exists()


def test_cli_run_with_entry(tmp_path):
    """The real CLI path: `python -m hpc_hsdp run ... --entry` on two SLURM-like tasks."""
    run_dir = tmp_path / "run"
    envs = job_envs(tasks_per_node=[2], extra_env={"PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"})
    args = [
        sys.executable,
        "-m",
        "hpc_hsdp",
        "run",
        "--shard",
        "2",
        "--run-dir",
        str(run_dir),
        "--device",
        "cpu",
        "--entry",
        "dist_helpers:entry_train_until_stop",
        "--timeout",
        "60",
        "--steps",
        "4",
        *tiny_job(width=16, heads=2, batch_size=None, vocab_size=32),
    ]
    base = env_outside_job()
    procs = [
        subprocess.Popen(args, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for env in envs
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    for rank in (0, 1):
        summary = json.loads((run_dir / f"entry-rank{rank}.json").read_text())
        assert summary["stopped"] and summary["steps"] == 2 and summary["on_step_calls"] == [1, 2]
    assert [s for s, _ in complete_checkpoints(run_dir)] == [2]  # saved where it stopped
    assert json.loads((run_dir / "layout.json").read_text())["plan"]["shard_groups"] == [[0, 1]]
    assert "step     2/4" in outputs[0]


def test_torchrun_launch_uses_torchruns_variables(tmp_path):
    base = env_outside_job()
    torchrun = Path(sys.executable).with_name("torchrun")
    args = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "hpc_hsdp",
        "run",
        "--shard",
        "2",
        "--run-dir",
        str(tmp_path),
        "--device",
        "cpu",
        "--timeout",
        "60",
        "--steps",
        "2",
        *tiny_job(width=16, heads=2, batch_size=None, vocab_size=32),
    ]
    done = subprocess.run(args, env={**base, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    layout = json.loads((tmp_path / "layout.json").read_text())
    assert layout["launch_mode"] == "torchrun"
    assert [(r["rank"], r["local_rank"], r["shard_group"]) for r in layout["ranks"]] == [(0, 0, [0, 1]), (1, 1, [0, 1])]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def run_cli_tasks(args: list[str], envs: list[dict]) -> tuple[list[int], list[tuple[str, str]]]:
    """``args`` once per task environment, at once, outside any SLURM of the caller's: the exit
    codes and (stdout, stderr) of each."""
    base = env_outside_job()
    procs = [
        subprocess.Popen(args, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for env in envs
    ]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], outputs


def test_cli_run_prints_the_mismatch_table_and_exits_2(tmp_path):
    envs = job_envs(
        tasks_per_node=[2, 2],
        distribution="cyclic",
        extra_env={"HPC_HSDP_FAULT_RANK_FROM_PROCID": "1", "OMP_NUM_THREADS": "1"},
    )
    args = [
        sys.executable,
        "-m",
        "hpc_hsdp",
        "run",
        "--shard",
        "2",
        "--run-dir",
        str(tmp_path),
        "--device",
        "cpu",
        "--timeout",
        "60",
    ]
    codes, outputs = run_cli_tasks(args, envs)
    assert codes == [2, 2, 2, 2], outputs
    for _, err in outputs:
        assert "axis   planned  realized  nodes" in err
        assert err.rstrip().splitlines()[-1].startswith("hpc-hsdp: error: the realized device mesh does not match")
        assert "Traceback" not in err


def test_cli_run_ends_without_the_interpreters_teardown(tmp_path):
    """`hpc-hsdp run` (srun's and torchrun's task command) ends through end_task: the exit
    handlers run, the teardown where gloo's worker threads can abort a finished task does not."""
    from tests.emulator_helpers import TEARDOWN_PROBE

    (tmp_path / "teardown_probe.py").write_text(TEARDOWN_PROBE)
    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "hpc_hsdp",
        "run",
        "--shard",
        "2",
        "--run-dir",
        str(run),
        "--device",
        "cpu",
        "--timeout",
        "60",
        "--entry",
        "teardown_probe:main",
    ]
    envs = job_envs(tasks_per_node=[2], extra_env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)})
    codes, outputs = run_cli_tasks(args, envs)
    assert codes == [0, 0], outputs
    assert sorted(p.name for p in run.glob("rank*")) == ["rank0.atexit", "rank1.atexit"]


def test_a_shard_larger_than_a_node_is_refused_on_the_task_before_torch_loads(tmp_path):
    """8,4 tasks with --shard 8: each task says why in one line and exits 2 before it imports
    torch, so a job that cannot form its mesh ends at once (12 tasks importing torch first took
    the dev cluster's test of it 40 s on this machine)."""
    env = task_environments(tasks_per_node=(8, 4), node_names=["n1", "n2"], job_id="78")[11]
    out = hpc(
        *("run", "--shard", "8", "--device", "cpu", "--run-dir", str(tmp_path)),
        env=env,
        timeout=60,
        python_options=("-X", "importtime"),
    )
    assert out.returncode == 2, out.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "hpc_hsdp.cli" in imported and not [m for m in imported if m.split(".")[0] == "torch"]
    [line] = [line for line in out.stderr.strip().splitlines() if not line.startswith("import time:")]
    assert line.startswith("hpc-hsdp: error: ") and "shard size 8 is larger than the smallest node (4 tasks)" in line


HANG = """
import sys, time
import hpc_hsdp
ctx = hpc_hsdp.init(1, "cpu")
print("ready", flush=True)
deadline = time.time() + 30
while time.time() < deadline and not __import__("os").path.exists(sys.argv[1]):
    time.sleep(0.05)  # a "hung" rank
ctx.shutdown()
print("survived", flush=True)
"""


def test_sigquit_dumps_every_threads_stack_and_the_rank_goes_on(tmp_path):
    import signal

    env = env_outside_job(job_envs(tasks_per_node=[1])[0])
    proc = subprocess.Popen(
        [sys.executable, "-c", HANG, str(tmp_path / "go")],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGQUIT)
        time.sleep(0.5)
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "survived" in out, err
    assert "most recent call first" in err and "<string>" in err


def test_cuda_requested_without_cuda_is_a_clear_error():
    import torch

    from hpc_hsdp.task.parallelism.dist import init

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    env = task_environments(tasks_per_node=[1], node_names=["n1"], job_id="7")[0]
    with pytest.raises(HsdpError, match="--device cuda but CUDA is not usable on node n1"):
        init(1, "cuda", env=env)


def test_device_auto_with_gpus_given_but_cuda_unusable_fails_with_the_reason():
    """SLURM gave the task GPUs (CUDA_VISIBLE_DEVICES) but this torch cannot use them (a CPU
    build here): --device auto must not fall back to a slow CPU run that "succeeds"."""
    import torch

    from hpc_hsdp.task.parallelism.dist import init

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    env = task_environments(tasks_per_node=[1, 1], node_names=["n1", "n2"], job_id="7", gpus_per_node=4)[0]
    with pytest.raises(
        HsdpError,
        match=r"was given GPUs \(CUDA_VISIBLE_DEVICES=0,1,2,3\) but CUDA is not usable: "
        r"this torch \(.*\) is a CPU-only build; .*--device cpu",
    ):
        init(1, "auto", env=env)
    env_without_gpus = task_environments(tasks_per_node=[1], node_names=["n1"], job_id="7")[0]
    from hpc_hsdp.plan.topology import RankLayout

    assert RankLayout.from_env(env_without_gpus, shard_size=1).device == "cpu"  # no GPU given: CPU is fine


def _device_of(ctx):
    return [ctx.layout.device, str(ctx.device)]


def test_forced_cpu_ignores_gpus_it_will_not_use(tmp_path):
    """Three tasks on a node with two GPUs visible to each: a GPU run must refuse local
    rank 2, a --device cpu run must not care."""
    spec = RunSpec(shard_size=3, run_dir=str(tmp_path), device="cpu")
    extra = {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_GPUS_ON_NODE": "2"}
    outcomes = launch(spec, tasks_per_node=[3], fn=_device_of, extra_env=extra)
    assert [o.value for o in outcomes] == [["cpu", "cpu"]] * 3


@pytest.mark.gpu
def test_gpu_single_task_runs_on_cuda(tmp_path):
    """One task, NCCL on cuda:0, through the real CLI. A subprocess, not ``launch``: this
    process has already asked CUDA whether it is available, and a forked child of a process
    that initialised the CUDA driver cannot use it."""
    env = job_envs(tasks_per_node=[1])[0]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    args = [
        "run",
        "--shard",
        "1",
        "--run-dir",
        str(tmp_path),
        "--device",
        "cuda",
        "--timeout",
        "120",
        "--steps",
        "5",
        "--layers",
        "2",
        "--width",
        "64",
        "--heads",
        "4",
        "--seq-len",
        "32",
        "--grad-accum",
        "2",
        "--clip-grad",
        "1.0",
        "--lr-schedule",
        "cosine",
        "--eval-every",
        "5",
        "--entry",
        "dist_helpers:entry_gpu_report",
    ]
    done = hpc(*args, env=env, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    layout = json.loads((tmp_path / "layout.json").read_text())
    assert layout["backend"] == "nccl" and layout["ranks"][0]["device"] == "cuda:0"
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[-1]["peak_mem_kind"] == "cuda_max_allocated" and records[-1]["peak_mem_bytes"] > 0
    assert records[-1]["peak_mem_reserved_bytes"] >= records[-1]["peak_mem_bytes"]
    assert {r["precision"] for r in records} == {"bf16"}  # --precision auto on CUDA
    assert "eval_loss" in records[-1] and all(r["data_wait_s"] >= 0 for r in records)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [5]
    report = json.loads((tmp_path / "gpu-report-rank0.json").read_text())
    assert report["tf32_matmul"] and report["tf32_cudnn"]
    assert len(report["syncs_in_steps_3_and_4"]) <= 2, report["syncs_in_steps_3_and_4"]  # one host sync per step
    import pickle

    trace = pickle.loads((tmp_path / "hang" / "nccl-trace-rank0.pkl").read_bytes())  # on by default
    assert any("nccl:" in str(entry.get("profiling_name")) for entry in trace["entries"]), str(trace)[:2000]


def test_resume_drops_a_metrics_line_torn_by_a_crash(tmp_path):
    """A rank 0 killed in the middle of an append leaves half a line; the resumed run's first
    record must not be glued to it (read_jsonl would stop there and lose every later step)."""
    from hpc_hsdp.rundir.files import append_jsonl
    from hpc_hsdp.rundir.training.metrics import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo')
    assert truncate_metrics(path, keep_through_step=2) == 0
    append_jsonl(path, {"step": 3, "loss": 1.8})
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    assert truncate_metrics(path, keep_through_step=1) == 2
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n'
    assert truncate_metrics(tmp_path / "absent.jsonl", keep_through_step=0) == 0
    assert not (tmp_path / "absent.jsonl").exists()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}),
        ({"TORCH_FR_BUFFER_SIZE": "0"}, {}),  # the job turned it off on purpose
        ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}, {}),
        ({"NCCL_DEBUG": "INFO"}, {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}),
    ],
)
def test_the_nccl_flight_recorder_is_on_unless_the_job_sized_it(env, expected):
    from hpc_hsdp.task.parallelism.dist import flight_recorder_env

    assert flight_recorder_env(env) == expected
