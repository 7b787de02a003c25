"""task/training/coordinator.py and task/training/replica_coordinator.py on their own: the ordinary job's step
coordinator (OneGroup) and a replica group's (ReplicaGroup), the latter with a scripted stand-in
for torchft's Manager (the quorum's answer, a heal, should_commit). In one process: a gloo
process group of one rank where a step needs collectives. The replica groups through torchft
for real: tests/processes/test_fault_tolerance.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.plan.replica_layout import group_rows
from hpc_hsdp.plan.topology import ParallelDims
from hpc_hsdp.rundir.checkpointing.state import COMPLETE, checkpoint_root, step_dir_name
from hpc_hsdp.rundir.observation.replica_membership import MEMBERSHIP_LOG
from hpc_hsdp.task.training.coordinator import OneGroup, StepCoordinator, coordinator_for
from hpc_hsdp.task.training.replica_coordinator import QuorumLost, ReplicaGroup
from hpc_hsdp.task.training.run_data import open_data

SEQ_LEN = 8


def _first_optimizer_step() -> None:
    model = nn.Linear(1, 1)
    model(torch.ones(1, 1)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()


_first_optimizer_step()  # at import: torch's first optimizer step sets TORCHINDUCTOR_CACHE_DIR, not a test's doing


def _training(**overrides) -> TrainingSpec:
    values = dict(seq_len=SEQ_LEN, batch_size=6, grad_accum=1, steps=12, vocab_size=64, clip_grad=0.0, lr=0.1)
    return TrainingSpec.of(**{**values, **overrides})


def _ctx(tmp_path: Path, *, replica=None, rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        rank=rank,
        world_size=1,
        data_rank=rank,
        data_world_size=1,
        dims=ParallelDims(replicate=1, shard=1),
        is_rank0=rank == 0,
        device=torch.device("cpu"),
        run_dir=tmp_path,
        replica=replica,
        plan=SimpleNamespace(num_replicas=1),
    )


class MeanOfLinear:
    """An adapter: a linear map of the token ids, its mean as the loss."""

    def loss(self, model, inputs, targets):
        return model(inputs.float()).mean()


@dataclass
class Quorum:
    participants: int
    index: int | None
    quorum_id: int = 1
    heal_from: ReplicaGroup | None = None
    """A live peer whose state this group fetches (it is behind): torchft's heal."""


class FakeManager:
    """Stands in for torchft's Manager: each ``start_quorum`` takes the next scripted answer (a
    :class:`Quorum`, or an exception to raise), ``should_commit`` the next of ``commits`` (a
    commit moves the step on, as torchft's does); the sum over the live groups is this group's own."""

    def __init__(self, group: ReplicaGroup, quorums=(), commits=()) -> None:
        self.group, self.quorums, self.commits = group, list(quorums), list(commits)
        self.step, self._quorum_id, self._quorum_future = 0, -1, None
        self.participants, self.index, self.shut_down = 0, None, False

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]

    def current_step(self) -> int:
        return self.step

    def start_quorum(self, timeout) -> None:
        answer = self.quorums.pop(0)
        if isinstance(answer, Exception):
            self._quorum_future = answer  # what a failed request leaves behind in torchft
            raise answer
        assert self._quorum_future is None, "a failed request was not cleared before the next"
        self._quorum_id, self.participants, self.index = answer.quorum_id, answer.participants, answer.index
        if answer.heal_from is not None:
            self.group.load_state_dict(answer.heal_from.state_dict())
            self.step = answer.heal_from.manager.current_step()

    def num_participants(self) -> int:
        return self.participants

    def participating_rank(self):
        return self.index

    def should_commit(self) -> bool:
        agreed = self.commits.pop(0)
        self.step += agreed
        return agreed

    def allreduce(self, tensor, reduce_op=None):
        return SimpleNamespace(wait=lambda: tensor)

    def shutdown(self, wait: bool = True) -> None:
        self.shut_down = True


def _replica_group(tmp_path, *, replica_id=1, groups=3, start_step=0, quorums=(), commits=(), state=None, **training):
    """An opened ReplicaGroup with a FakeManager; ``saved`` lists the steps its ``save_now`` saved."""
    group = ReplicaGroup(
        _ctx(tmp_path, replica=(replica_id, groups, 0)),
        _training(fault_tolerance="replica", **training),
        make_manager=lambda g: FakeManager(g, quorums, commits),
    )
    torch.manual_seed(replica_id)
    model = nn.Linear(SEQ_LEN, 1)
    _open(group, model, torch.optim.AdamW(model.parameters(), lr=0.1), start_step=start_step, state=state)
    return group


def _open(group: ReplicaGroup, model, optimizer, *, start_step: int, state: dict | None = None) -> None:
    """``group.open``, its ``save_now`` recording the steps it saved in ``group.saved``."""
    group.saved = []

    def save_now():
        group.saved.append(group.manager.current_step())
        return group.manager.current_step()

    data = open_data(group.training, 1)
    state = {} if state is None else state
    group.open(data, MeanOfLinear(), model, optimizer, start_step=start_step, state=state, save_now=save_now)


@pytest.fixture
def one_rank():
    """A gloo process group of this one process (a step's all_reduce, the fall back's broadcast)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _membership(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / MEMBERSHIP_LOG).read_text().splitlines()]


# ---------------------------------------------------------------------------- the choice


def test_the_options_choose_the_coordinator_and_both_answer_what_the_engine_asks(tmp_path):
    ordinary = coordinator_for(_ctx(tmp_path), _training())
    replica = coordinator_for(_ctx(tmp_path, replica=(2, 3, 1)), _training(fault_tolerance="replica"))
    assert type(ordinary) is OneGroup and type(replica) is ReplicaGroup
    assert (replica.replica_id, replica.num_groups, replica.attempt) == (2, 3, 1)
    assert isinstance(ordinary, StepCoordinator) and isinstance(replica, StepCoordinator)


def test_the_engine_never_names_fault_tolerance():
    source = (Path(__file__).resolve().parents[2] / "hpc_hsdp" / "task" / "training" / "engine.py").read_text()
    for name in ("torchft", "replica_group", "ReplicaGroup", "fault_tolerance", ".ft"):
        assert name not in source, name


# ---------------------------------------------------------------------------- the ordinary job


def test_one_group_trains_the_steps_after_the_last_one_from_the_loader_and_always_leads(tmp_path, one_rank):
    ctx, training = _ctx(tmp_path), _training(steps=5)
    coordinator = OneGroup(ctx, training)
    model = nn.Linear(SEQ_LEN, 1)
    data = open_data(training, 1)
    coordinator.open(
        data, MeanOfLinear(), model, torch.optim.SGD(model.parameters(), lr=0.1), start_step=2, state={}, save_now=None
    )
    assert list(coordinator.steps(lambda: 2)) == [3, 4, 5]
    try:
        number, batches, waited = coordinator.begin(3)
        assert number == 3 and waited >= 0
        expected = data.order.sample_ids(data.layout.step_positions(3))
        assert np.array_equal(np.concatenate([b.sample_ids for b in batches]), expected)
        before = model.weight.detach().clone()
        out, committed = coordinator.train_step(batches, lr=0.1, stop_code=None)
        assert committed and out.shape == (3,) and not torch.equal(model.weight, before)
    finally:
        coordinator.close_steps()
    assert not coordinator.loader._thread.is_alive()
    assert coordinator.leads and coordinator.prints_step_lines and coordinator.rank_label == 0
    assert coordinator.take_record_fields() == {}


# ---------------------------------------------------------------------------- a replica group


def test_a_replica_group_trains_the_step_after_its_last_committed_one_with_its_share_of_the_rows(tmp_path):
    group = _replica_group(tmp_path, replica_id=1, start_step=4, quorums=[Quorum(participants=2, index=1)])
    done, trained = [10], []
    for number in group.steps(lambda: done[0]):
        trained.append(number)
        if number != 11 or trained.count(11) == 2:  # step 11 does not commit the first time
            done[0] = number
    assert trained == [11, 11, 12]  # to --steps 12
    number, batches, _ = group.begin(5)
    assert number == 5 and group.replicas == 2 and group.index == 1
    layout = group.data.layout
    positions = layout.step_positions(5)
    ((start, stop),) = group_rows(
        layout.global_batch, participants=2, group_index=1, group_world=1, rank=0, max_rows=layout.rank_batch
    )
    assert [b.sample_ids.tolist() for b in batches] == [group.data.order.sample_ids(positions[start:stop]).tolist()]
    assert [(m["step"], m["replicas"], m["of"], m["cause"]) for m in _membership(tmp_path)] == [(5, 2, 3, "start")]


def test_a_group_that_is_behind_heals_from_a_live_peer_and_goes_on_from_its_step(tmp_path):
    peer = _replica_group(tmp_path / "peer", replica_id=0, start_step=9, state={"seen": 7})
    peer.raw_optimizer.zero_grad()
    peer.model(torch.ones(1, SEQ_LEN)).sum().backward()
    peer.raw_optimizer.step()  # optimizer state worth sending
    state = {"ours": 1}
    group = _replica_group(
        tmp_path,
        replica_id=1,
        start_step=4,
        state=state,
        quorums=[
            Quorum(participants=2, index=1, quorum_id=1),
            Quorum(participants=2, index=1, quorum_id=2, heal_from=peer),
        ],
    )
    group.quorum()
    assert group.quorum() == 10 and group.healed_at == 9
    assert state == {"seen": 7}  # the engine's own state, replaced in place
    assert torch.equal(group.model.weight, peer.model.weight)
    ours, theirs = group.raw_optimizer.state_dict()["state"], peer.raw_optimizer.state_dict()["state"]
    assert torch.equal(ours[0]["exp_avg"], theirs[0]["exp_avg"])
    assert [m["cause"] for m in _membership(tmp_path)][-1] == "healed from a live peer at step 9"


def test_the_first_live_group_leads_and_the_record_carries_the_quorum_and_the_retries(tmp_path, one_rank):
    group = _replica_group(
        tmp_path,
        replica_id=2,
        quorums=[Quorum(participants=2, index=1), Quorum(participants=2, index=1), Quorum(participants=1, index=0)],
        commits=[False, True, True],
    )
    assert group.rank_label == "2-0" and group.prints_step_lines
    number, batches, _ = group.begin(1)
    assert not group.leads
    before = group.model.weight.detach().clone()
    out, committed = group.train_step(batches, lr=0.05, stop_code=None)
    assert not committed and torch.equal(group.model.weight, before)  # a lost group: trained again
    assert out.shape == (3,) and group.raw_optimizer.param_groups[0]["lr"] == 0.05
    number, batches, _ = group.begin(1)
    assert number == 1  # the same step again
    _, committed = group.train_step(batches, lr=0.05, stop_code=None)
    assert committed and not torch.equal(group.model.weight, before)
    fields = {"replicas": 2, "replica_groups": 3, "replica_id": 2, "retries": 1}
    assert group.take_record_fields() == fields
    number, batches, _ = group.begin(2)
    assert number == 2 and group.leads  # the other group was lost: this one leads now
    assert group.take_record_fields() == dict(fields, replicas=1, retries=0)
    assert [m["cause"] for m in _membership(tmp_path)] == ["start", "a replica group was lost"]


def test_a_failed_quorum_request_is_asked_again_until_the_quorum_timeout(tmp_path):
    group = _replica_group(
        tmp_path, quorum_timeout=30.0, quorums=[TimeoutError("lighthouse gone"), Quorum(participants=1, index=0)]
    )
    assert group.quorum() == 1


def test_below_min_replicas_one_surviving_group_saves_the_last_committed_step_for_all(tmp_path, one_rank):
    lost = [TimeoutError("no quorum")]
    first = _replica_group(tmp_path, replica_id=1, start_step=6, quorum_timeout=0.5, quorums=lost)
    second = _replica_group(tmp_path, replica_id=2, start_step=6, quorum_timeout=0.5, quorums=list(lost))
    for group in (first, second):
        assert not group.leads
        with pytest.raises(QuorumLost, match="no quorum of --min-replicas"):
            group.begin(7)
    assert (first.saved, first.leads) == ([6], True)  # the first to claim saves, as the leader
    assert (second.saved, second.leads) == ([], False)  # the lock is held: one group saves for all


def test_no_fall_back_save_where_the_last_committed_step_is_saved_already(tmp_path, one_rank):
    saved = checkpoint_root(tmp_path) / step_dir_name(6)
    saved.mkdir(parents=True)
    (saved / COMPLETE).write_text("")
    group = _replica_group(tmp_path, start_step=6, quorum_timeout=0.5, quorums=[TimeoutError("no quorum")])
    with pytest.raises(QuorumLost):
        group.begin(7)
    assert group.saved == []


def test_closing_shuts_torchfts_manager_down(tmp_path):
    group = _replica_group(tmp_path)
    group.close_steps()
    group.close()
    assert group.manager.shut_down


# ---------------------------------------------------------------------------- through torchft, for real


@pytest.fixture
def lighthouse(monkeypatch):
    """An in-process torchft lighthouse that needs ``min_replicas`` groups, and this process's
    rank of a real gloo process group (its store at ``store_port``): one replica group's world."""
    from dist_helpers import free_port
    from torchft.coordination import LighthouseServer

    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    servers = []

    def start(min_replicas: int):
        servers.append(LighthouseServer(bind="[::]:0", min_replicas=min_replicas))
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", servers[-1].address())
        return port

    try:
        yield start
    finally:
        for server in servers:
            server.shutdown()
        dist.destroy_process_group()


def _real_group(tmp_path, store_port: int, **training) -> ReplicaGroup:
    ctx = _ctx(tmp_path, replica=(0, 2, 0))
    ctx.layout = SimpleNamespace(master_addr="127.0.0.1", master_port=store_port)
    group = ReplicaGroup(ctx, _training(fault_tolerance="replica", **training))
    torch.manual_seed(0)
    model = nn.Linear(SEQ_LEN, 1)
    _open(group, model, torch.optim.SGD(model.parameters(), lr=0.1), start_step=3)
    return group


def test_one_live_group_through_torchft_goes_on_from_its_resumed_step_and_commits(tmp_path, lighthouse):
    group = _real_group(tmp_path, lighthouse(1), min_replicas=1, quorum_timeout=20.0)
    try:
        for expected in (4, 5):
            before = group.model.weight.detach().clone()
            number, batches, _ = group.begin(0)
            out, committed = group.train_step(batches, lr=0.1, stop_code=None)
            assert (number, committed, group.leads) == (expected, True, True)
            assert not torch.equal(group.model.weight, before)
            assert group.take_record_fields() == {"replicas": 1, "replica_groups": 2, "replica_id": 0, "retries": 0}
    finally:
        group.close()
    assert [m["step"] for m in _membership(tmp_path)] == [4]


def test_without_min_replicas_live_through_torchft_the_quorum_is_lost_and_the_last_step_saved(tmp_path, lighthouse):
    group = _real_group(tmp_path, lighthouse(2), min_replicas=2, quorum_timeout=1.0)
    try:
        with pytest.raises(QuorumLost, match="no quorum of --min-replicas 2 groups within --quorum-timeout 1 s"):
            group.begin(0)
    finally:
        group.close()
    assert (group.saved, group.leads) == ([3], True)
    assert not (tmp_path / MEMBERSHIP_LOG).exists()
